"""MLflow behind the hub: a real `mlflow server --app-name gpupool` started by `gpupool up`, real hub tokens.

The notebook flow runs inside a spawned user server (its kernel, its environment); the other checks use
real hub users' tokens against the service through the real proxy.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from datetime import timedelta
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest
import requests

from gpupool.hub.accounting.ledger import Ledger
from gpupool.hub.accounting.periods import utcnow
from gpupool.hub.harness import Browser, Hub
from gpupool.mlflow.cost import COST_TAGS

POLICY = {
    "policy.yaml": """
models:
  H200: {vendor: nvidia, memory_gib: 141, backends: [hami]}
inventory: [{model: H200, count: 2}]
teams:
  vision: {members: [alice, rita], reviewers: [rita]}
  nlp: {members: [nadia]}
profiles:
  h200-quarter: {display_name: 0.25 × H200, gpu: {model: H200, share: 0.25}, teams: [vision, nlp]}
billing: {prices: {H200: '3.20'}}
""",
}
SELF = 'c.LocalGPUSpawner.run_as = "self"\n'
PASSWORD = "a-test-password"
# The browser logs in with JupyterHub's own DummyAuthenticator: NativeAuthenticator 1.3's login handler fails
# on JupyterHub 6 (it reads the removed `statsd` attribute), which is not what these tests are about.
BROWSER_LOGIN = f'c.JupyterHub.authenticator_class = "dummy"\nc.DummyAuthenticator.password = {PASSWORD!r}\n'
MODEL = "vision-classifier"
REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    hub = Hub(tmp_path_factory.mktemp("mlflow"), POLICY, SELF + BROWSER_LOGIN)
    hub.start()
    try:
        hub.wait_service("mlflow", "health")
        for user, team in [("alice", "vision"), ("rita", "vision"), ("nadia", "nlp")]:
            hub.add_user(user, team)
        yield hub
    finally:
        hub.stop()


_tokens: dict[tuple[str, str], str] = {}


def token_of(hub: Hub, user: str) -> str:
    key = (hub.url, user)
    if key not in _tokens:
        hub.api("POST", f"/users/{user}")
        reply = hub.api("POST", f"/users/{user}/tokens", json={"note": "test"})
        assert reply.status_code == 201, reply.text
        _tokens[key] = reply.json()["token"]
    return _tokens[key]


def call(hub: Hub, user: str | None, method: str, path: str, **kw) -> requests.Response:
    headers = {"Authorization": f"Bearer {token_of(hub, user)}"} if user else {}
    headers.update(kw.pop("headers", {}))
    return requests.request(method, f"{hub.url}/services/mlflow/{path}", headers=headers, timeout=60,
                            allow_redirects=False, **kw)


API = "api/2.0/mlflow/"


@pytest.fixture(scope="module")
def notebook(hub):
    """alice's server (team vision) logs a run, registers a model and marks it `candidate`, from its kernel."""
    reply = hub.api("POST", "/users/alice/server", json={"profile": "h200-quarter"})
    assert reply.status_code in (201, 202), reply.text
    hub.wait_ready("alice", timeout=180)
    code = textwrap.dedent(f"""
        import json, os, tempfile, time
        import mlflow, mlflow.pyfunc
        from mlflow import MlflowClient

        class Echo(mlflow.pyfunc.PythonModel):
            def predict(self, context, model_input):
                return model_input

        env = {{k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "GPUPOOL_TEAM")}}
        env["token_is_server_token"] = os.environ["MLFLOW_TRACKING_TOKEN"] == os.environ["JUPYTERHUB_API_TOKEN"]
        with mlflow.start_run() as run:
            mlflow.log_metric("accuracy", 0.93)
            mlflow.log_metric("accuracy", 0.95, step=1)
            path = os.path.join(tempfile.mkdtemp(), "notes.txt")
            open(path, "w").write("trained on vision data")
            mlflow.log_artifact(path)
            info = mlflow.pyfunc.log_model(name="model", python_model=Echo(), pip_requirements=["mlflow"],
                                           registered_model_name={MODEL!r})
            # Into the run's next second of the ledger (which counts whole seconds), however fast the machine.
            time.sleep(max(0.0, run.info.start_time // 1000 + 1.05 - time.time()))
        client = MlflowClient()
        version = client.get_latest_versions({MODEL!r})[0].version
        client.set_registered_model_alias({MODEL!r}, "candidate", version)
        print(json.dumps({{"env": env, "run_id": run.info.run_id, "experiment_id": run.info.experiment_id,
                           "version": version, "tags": client.get_run(run.info.run_id).data.tags}}))
    """)
    output = hub.run_in_kernel("alice", code)
    result = json.loads(output.strip().splitlines()[-1])
    yield result
    hub.stop_server("alice")


def test_a_notebook_logs_runs_and_registers_models_with_its_servers_environment(hub, notebook):
    env = notebook["env"]
    assert env["MLFLOW_TRACKING_URI"] == f"{hub.url}/services/mlflow"
    assert env["MLFLOW_EXPERIMENT_NAME"] == "vision" and env["GPUPOOL_TEAM"] == "vision"
    assert env["token_is_server_token"] is True
    # The run-context plugin tagged the run with who ran it on what share.
    tags = notebook["tags"]
    assert tags["gpupool.user"] == "alice" and tags["gpupool.team"] == "vision"
    assert tags["gpupool.profile"] == "h200-quarter" and tags["gpupool.share"] == "1/4"
    # When the run ended, the server priced alice's quarter H200 over every ledger second of the run (her
    # server held it all along), and the author is alice.
    run = call(hub, "alice", "GET", API + "runs/get", params={"run_id": notebook["run_id"]}).json()["run"]
    seconds = run["info"]["end_time"] // 1000 - run["info"]["start_time"] // 1000
    assert seconds > 0 and Fraction(tags["gpupool.gpu_seconds"]) == Fraction(1, 4) * seconds, (seconds, tags)
    assert Fraction(tags["gpupool.gpu_hours"]) > 0 and Decimal(tags["gpupool.cost"]) > 0, tags
    assert tags["gpupool.currency"] == "EUR"
    assert tags["mlflow.user"] == "alice" and run["info"]["user_id"] == "alice"
    assert {m["key"]: m["value"] for m in run["data"]["metrics"]} == {"accuracy": 0.95}
    assert run["info"]["artifact_uri"].startswith("mlflow-artifacts:/vision/")
    listing = call(hub, "alice", "GET", API + "artifacts/list", params={"run_id": notebook["run_id"]}).json()
    assert "notes.txt" in [f["path"] for f in listing["files"]]
    experiment = call(hub, "alice", "GET", API + "experiments/get",
                      params={"experiment_id": notebook["experiment_id"]}).json()["experiment"]
    assert experiment["name"] == "vision"
    assert {"key": "gpupool.team", "value": "vision"} in experiment["tags"]


def test_only_reviewers_move_a_model_to_production_and_every_change_is_recorded(hub, notebook, monkeypatch):
    version = notebook["version"]
    body = {"name": MODEL, "alias": "production", "version": version}
    refused = call(hub, "alice", "POST", API + "registered-models/alias", json=body)
    assert refused.status_code == 403 and "reviewers" in refused.json()["message"]
    assert call(hub, "rita", "POST", API + "registered-models/alias", json=body).status_code == 200
    mv = call(hub, "rita", "GET", API + "model-versions/get", params={"name": MODEL, "version": version}).json()
    tags = {t["key"]: t["value"] for t in mv["model_version"]["tags"]}
    assert tags["gpupool.alias.candidate.set_by"] == "alice"
    assert tags["gpupool.alias.production.set_by"] == "rita"
    assert tags["gpupool.alias.production.previous_version"] == "none"
    assert "gpupool.alias.production.set_at" in tags
    assert set(mv["model_version"]["aliases"]) == {"candidate", "production"}
    # Nobody forges that history.
    forged = call(hub, "alice", "POST", API + "model-versions/set-tag",
                  json={"name": MODEL, "version": version, "key": "gpupool.alias.production.set_by", "value": "x"})
    assert forged.status_code == 403

    # Loading the production model with a user server's environment (alice's token, the hub URL).
    import mlflow
    import mlflow.pyfunc
    import pandas as pd

    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", token_of(hub, "alice"))
    mlflow.set_tracking_uri(f"{hub.url}/services/mlflow")
    try:
        model = mlflow.pyfunc.load_model(f"models:/{MODEL}@production")
        frame = pd.DataFrame({"x": [1, 2]})
        assert model.predict(frame).equals(frame)
    finally:
        mlflow.set_tracking_uri(None)


def test_nlp_sees_and_touches_nothing_of_vision(hub, notebook):
    run_id, experiment_id, version = notebook["run_id"], notebook["experiment_id"], notebook["version"]
    artifact_uri = call(hub, "alice", "GET", API + "runs/get", params={"run_id": run_id}).json()["run"]["info"][
        "artifact_uri"]
    artifact_path = artifact_uri[len("mlflow-artifacts:/"):]
    model_id = call(hub, "alice", "POST", API + "logged-models/search",
                    json={"experiment_ids": [experiment_id]}).json()["models"][0]["info"]["model_id"]
    routes = [
        ("GET", API + "experiments/get", {"params": {"experiment_id": experiment_id}}),
        ("GET", API + "experiments/get-by-name", {"params": {"experiment_name": "vision"}}),
        ("POST", API + "experiments/update", {"json": {"experiment_id": experiment_id, "new_name": "mine"}}),
        ("POST", API + "experiments/delete", {"json": {"experiment_id": experiment_id}}),
        ("POST", API + "experiments/set-experiment-tag", {"json": {"experiment_id": experiment_id, "key": "k",
                                                                    "value": "v"}}),
        ("POST", API + "runs/create", {"json": {"experiment_id": experiment_id}}),
        ("GET", API + "runs/get", {"params": {"run_id": run_id}}),
        ("POST", API + "runs/search", {"json": {"experiment_ids": [experiment_id]}}),
        ("POST", API + "runs/log-metric", {"json": {"run_id": run_id, "key": "accuracy", "value": 0.1,
                                                     "timestamp": 1, "step": 9}}),
        ("POST", API + "runs/log-batch", {"json": {"run_id": run_id, "metrics": [
            {"key": "accuracy", "value": 0.1, "timestamp": 1, "step": 9}]}}),
        ("POST", API + "runs/set-tag", {"json": {"run_id": run_id, "key": "k", "value": "v"}}),
        ("POST", API + "runs/update", {"json": {"run_id": run_id, "status": "KILLED"}}),
        ("POST", API + "runs/delete", {"json": {"run_id": run_id}}),
        ("GET", API + "metrics/get-history", {"params": {"run_id": run_id, "metric_key": "accuracy"}}),
        ("GET", "ajax-api/2.0/mlflow/metrics/get-history-bulk-interval",
         {"params": {"run_ids": run_id, "metric_key": "accuracy"}}),
        ("GET", API + "artifacts/list", {"params": {"run_id": run_id}}),
        ("GET", "get-artifact", {"params": {"run_id": run_id, "path": "notes.txt"}}),
        ("GET", f"api/2.0/mlflow-artifacts/artifacts/{artifact_path}/notes.txt", {}),
        ("PUT", f"api/2.0/mlflow-artifacts/artifacts/{artifact_path}/evil.txt", {"data": b"x"}),
        ("DELETE", f"api/2.0/mlflow-artifacts/artifacts/{artifact_path}/notes.txt", {}),
        ("GET", "api/2.0/mlflow-artifacts/artifacts", {"params": {"path": artifact_path}}),
        ("GET", "api/2.0/mlflow-artifacts/artifacts", {}),
        ("GET", API + f"logged-models/{model_id}", {}),
        ("POST", API + "logged-models/search", {"json": {"experiment_ids": [experiment_id]}}),
        ("GET", API + "registered-models/get", {"params": {"name": MODEL}}),
        ("POST", API + "registered-models/rename", {"json": {"name": MODEL, "new_name": "stolen"}}),
        ("DELETE", API + "registered-models/delete", {"json": {"name": MODEL}}),
        ("POST", API + "registered-models/set-tag", {"json": {"name": MODEL, "key": "k", "value": "v"}}),
        ("GET", API + "registered-models/alias", {"params": {"name": MODEL, "alias": "production"}}),
        ("POST", API + "registered-models/alias", {"json": {"name": MODEL, "alias": "candidate", "version": version}}),
        ("DELETE", API + "registered-models/alias", {"json": {"name": MODEL, "alias": "production"}}),
        ("POST", API + "model-versions/create", {"json": {"name": MODEL, "source": artifact_uri}}),
        ("GET", API + "model-versions/get", {"params": {"name": MODEL, "version": version}}),
        ("GET", API + "model-versions/get-download-uri", {"params": {"name": MODEL, "version": version}}),
        ("PATCH", API + "model-versions/update", {"json": {"name": MODEL, "version": version, "description": "x"}}),
        ("DELETE", API + "model-versions/delete", {"json": {"name": MODEL, "version": version}}),
        ("GET", "model-versions/get-artifact", {"params": {"name": MODEL, "version": version, "path": "MLmodel"}}),
        ("POST", "graphql", {"json": {"query": "query q($id: String) { mlflowGetRun(input: {runId: $id}) "
                                               "{ run { info { runName } } } }", "variables": {"id": run_id}}}),
        ("POST", "graphql", {"json": {"query": f'{{ mlflowGetExperiment(input: {{experimentId: "{experiment_id}"}})'
                                               " { experiment { name } } }"}}),
        ("POST", "graphql", {"json": {"query": "{ mlflowSearchModelVersions(input: {filter: \"\"}) "
                                               "{ modelVersions { name } } }"}}),
    ]
    # The same reads work for vision itself, so the refusals below are about the team, not the request.
    for method, path, kw in routes:
        # (Not: listing the whole artifact store, the alias only a reviewer sets, GraphQL's unchecked search.)
        if kw and "production" not in str(kw) and "mlflowSearchModelVersions" not in str(kw) and (
                method == "GET" or path == "graphql" or path.endswith("search")):
            reply = call(hub, "alice", method, path, **kw)
            assert reply.status_code == 200, (method, path, reply.status_code, reply.text[:300])
            if path == "graphql":
                assert not reply.json().get("errors"), reply.text[:300]
    before = call(hub, "alice", "GET", API + "runs/get", params={"run_id": run_id}).json()
    for method, path, kw in routes:
        reply = call(hub, "nadia", method, path, **kw)
        assert reply.status_code in (403, 404), (method, path, reply.status_code, reply.text[:300])
    assert call(hub, "alice", "GET", API + "runs/get", params={"run_id": run_id}).json() == before
    assert call(hub, "alice", "GET", API + "registered-models/get", params={"name": MODEL}).status_code == 200

    # Lists and searches: nlp's own objects only.
    assert call(hub, "nadia", "POST", API + "experiments/create", json={"name": "nlp"}).status_code == 200
    experiments = call(hub, "nadia", "POST", API + "experiments/search", json={"max_results": 1000}).json()
    assert [e["name"] for e in experiments["experiments"]] == ["nlp"]
    for path in ("registered-models/search", "model-versions/search"):
        listed = call(hub, "nadia", "GET", API + path, params={"max_results": 1000}).json()
        assert not listed.get("registered_models") and not listed.get("model_versions"), listed
    # alice (vision) sees vision's, not nlp's; the admin sees both.
    mine = call(hub, "alice", "POST", API + "experiments/search", json={"max_results": 1000}).json()
    assert [e["name"] for e in mine["experiments"]] == ["vision"]
    versions = call(hub, "alice", "GET", API + "model-versions/search", params={"filter": f"name='{MODEL}'"}).json()
    assert [v["name"] for v in versions["model_versions"]] == [MODEL]


BAD_LOCATIONS = [
    "file:///etc",
    "/etc/passwd",
    "mlflow-artifacts:/vision/../nlp/x",
    "mlflow-artifacts:/vision/%2e%2e/nlp",
    "mlflow-artifacts:/vision/x#/../../nlp",
    "mlflow-artifacts:/vision/x?/../nlp",
    "mlflow-artifacts:/nlp/x",
    "mlflow-artifacts://evil.example.org/vision/x",
    "s3://other-bucket/vision",
    "http://169.254.169.254/latest/meta-data",
    "mlflow-artifacts:/vision\\..\\nlp",
]


@pytest.mark.parametrize("location", BAD_LOCATIONS)
def test_an_artifact_location_outside_the_team_root_is_refused_and_nothing_is_made(hub, location):
    name = f"bad-{abs(hash(location))}"
    reply = call(hub, "alice", "POST", API + "experiments/create", json={"name": name, "artifact_location": location})
    assert reply.status_code == 400, reply.text
    assert "mlflow-artifacts:/vision/" in reply.json()["message"]
    assert call(hub, "alice", "GET", API + "experiments/get-by-name",
                params={"experiment_name": name}).status_code == 404


@pytest.mark.parametrize("source", BAD_LOCATIONS + ["runs:/0123456789abcdef/../../x", "models:/m-nonexistent"])
def test_a_model_version_source_outside_the_team_root_is_refused(hub, notebook, source):
    before = call(hub, "alice", "GET", API + "model-versions/search", params={"filter": f"name='{MODEL}'"}).json()
    reply = call(hub, "alice", "POST", API + "model-versions/create", json={"name": MODEL, "source": source})
    assert 400 <= reply.status_code < 500, reply.text
    after = call(hub, "alice", "GET", API + "model-versions/search", params={"filter": f"name='{MODEL}'"}).json()
    assert len(after["model_versions"]) == len(before["model_versions"])


def test_bad_requests_get_4xx_never_500(hub):
    assert call(hub, None, "GET", API + "experiments/search").status_code == 401
    assert call(hub, "alice", "GET", "api/2.0/mlflow/no-such-route").status_code == 404
    assert call(hub, "alice", "POST", "api/2.0/mlflow/gateway/routes", json={}).status_code == 404
    assert call(hub, "alice", "POST", API + "experiments/create", data=b"{not json",
                headers={"Content-Type": "application/json"}).status_code == 400
    assert call(hub, "alice", "POST", API + "experiments/create", json=["a list"]).status_code == 400
    assert call(hub, "alice", "GET", API + "experiments/get", params={"experiment_id": "1 OR 1=1"}).status_code == 400
    big = call(hub, "alice", "POST", API + "runs/log-batch", data=b"x" * (5 * 1024 * 1024),
               headers={"Content-Type": "application/json"})
    assert big.status_code == 413
    # A name that is another team's is not free to take (it would be that team's default experiment).
    squat = call(hub, "nadia", "POST", API + "experiments/create", json={"name": "vision/mine"})
    assert squat.status_code == 403
    nlp = call(hub, "nadia", "POST", API + "experiments/create", json={"name": "nlp/renamed-later"})
    assert nlp.status_code == 200, nlp.text
    renamed = call(hub, "nadia", "POST", API + "experiments/update",
                   json={"experiment_id": nlp.json()["experiment_id"], "new_name": "vision/taken"})
    assert renamed.status_code == 403
    forged = call(hub, "nadia", "POST", API + "experiments/create",
                  json={"name": "x", "tags": [{"key": "gpupool.team", "value": "vision"}]})
    assert forged.status_code == 403
    # A token without access to the service is refused.
    reply = hub.api("POST", "/users/alice/tokens", json={"note": "no mlflow", "scopes": ["read:users:name!user"]})
    assert reply.status_code == 201, reply.text
    narrow = requests.get(f"{hub.url}/services/mlflow/{API}experiments/search", timeout=30,
                          headers={"Authorization": f"Bearer {reply.json()['token']}"})
    assert narrow.status_code == 403


def test_mlflow_reads_exactly_the_checked_parameters_and_gets_the_body_as_sent_when_unchanged():
    from gpupool.mlflow.auth import Request

    def forwarded(body: bytes, change: tuple | None = None) -> tuple[dict, bytes]:
        request = Request({"method": "POST", "path": "/m/api/2.0/mlflow/runs/log-batch", "headers": []}, "/m", body)
        request.params()
        if change:
            request.set_param(*change)
        request.rewrite()
        assert json.loads(request.body) == request.params()  # what MLflow parses is what the gate checked
        return request.params(), request.body

    sent = b'{"run_id": "abc",  "run_id": "def", "metrics": [{"key": "loss", "value": 0.5}]}'
    assert forwarded(sent) == ({"run_id": "def", "metrics": [{"key": "loss", "value": 0.5}]}, sent)
    params, body = forwarded(sent, ("user_id", "alice"))
    assert params["user_id"] == "alice" and body != sent
    double = json.dumps(sent.decode()).encode()  # old clients' double-encoded JSON: forwarded as one object
    assert forwarded(double)[1] == json.dumps({"run_id": "def", "metrics": [{"key": "loss", "value": 0.5}]}).encode()
    assert forwarded(b" ") == ({}, b"{}")


def test_the_event_loop_never_reads_mlflows_database(tmp_path):
    """Calls on owners not yet remembered are decided in a worker thread, from the request as sent; remembered ones
    on the event loop, with no database read at all."""
    import threading
    from types import SimpleNamespace

    import anyio

    from gpupool.mlflow.auth import Gate, HubGate, Request, Stores
    from gpupool.mlflow.permissions import Refused, Viewer

    reads = []

    class Tracking:
        def get_experiment(self, experiment_id):
            reads.append((experiment_id, threading.current_thread()))
            return SimpleNamespace(tags={"gpupool.team": "vision"})

    stores = Stores()
    stores._handlers = SimpleNamespace(_get_tracking_store=Tracking)
    gate = HubGate(None, Gate(stores, str(tmp_path), ""), None, "/m")
    alice, nadia = Viewer("alice", False, ("vision",), frozenset()), Viewer("nadia", False, ("nlp",), frozenset())
    body = json.dumps({"experiment_id": "7", "tags": [{"key": "mlflow.user", "value": "mallory"}]}).encode()

    def create_run() -> Request:
        return Request({"method": "POST", "path": "/m/api/2.0/mlflow/runs/create", "headers": []}, "/m", body)

    async def decide_three_times():
        first, second, refused = create_run(), create_run(), create_run()
        await gate.decide(alice, first)
        await gate.decide(alice, second)
        with pytest.raises(Refused) as error:
            await gate.decide(nadia, refused)
        assert error.value.status == 404
        return threading.current_thread(), first, second

    loop_thread, first, second = anyio.run(decide_three_times)
    assert [experiment for experiment, _ in reads] == ["7"] and reads[0][1] is not loop_thread
    for request in (first, second):
        assert json.loads(request.body) == {"experiment_id": "7", "user_id": "alice", "tags": [
            {"key": "gpupool.user", "value": "alice"}, {"key": "mlflow.user", "value": "alice"}]}


def test_a_policy_edit_reaches_the_services_checks(tmp_path):
    from gpupool.hub.harness import wait_for
    from gpupool.mlflow.auth import Gate
    from gpupool.mlflow.permissions import viewer_of

    (tmp_path / "policy.yaml").write_text(POLICY["policy.yaml"])
    gate = Gate(None, str(tmp_path), "")
    bo = {"name": "bo", "admin": False, "groups": []}
    assert viewer_of(bo, gate.policy).teams == ()
    (tmp_path / "policy.yaml").write_text(POLICY["policy.yaml"].replace("members: [nadia]", "members: [nadia, bo]"))
    wait_for(lambda: viewer_of(bo, gate.policy).teams == ("nlp",), timeout=30, every=0.1,
             message="bo never joined nlp in the MLflow service's checks")


def test_a_runs_author_is_the_caller_whatever_the_client_sends(hub):
    experiment = call(hub, "alice", "POST", API + "experiments/create", json={"name": "vision/authors"})
    assert experiment.status_code == 200, experiment.text
    forged = {"key": "mlflow.user", "value": "someone-else"}
    created = call(hub, "alice", "POST", API + "runs/create", json={
        "experiment_id": experiment.json()["experiment_id"], "user_id": "someone-else", "tags": [forged]})
    assert created.status_code == 200, created.text
    run_id = created.json()["run"]["info"]["run_id"]

    def author():
        run = call(hub, "alice", "GET", API + "runs/get", params={"run_id": run_id}).json()["run"]
        return run["info"]["user_id"], {t["key"]: t["value"] for t in run["data"]["tags"]}["mlflow.user"]

    assert author() == ("alice", "alice")
    # Nobody changes it later, not even the author.
    for path, body in [("runs/set-tag", {"run_id": run_id, **forged}),
                       ("runs/delete-tag", {"run_id": run_id, "key": "mlflow.user"}),
                       ("runs/log-batch", {"run_id": run_id, "tags": [forged]})]:
        reply = call(hub, "alice", "POST", API + path, json=body)
        assert reply.status_code == 403 and "author" in reply.json()["message"], (path, reply.text)
    reply = call(hub, "alice", "POST", API + "runs/update", json={"run_id": run_id, "user_id": "someone-else"})
    assert reply.status_code == 400 and "user_id" in reply.json()["message"], reply.text
    assert author() == ("alice", "alice")


def test_registered_model_names_start_with_their_team(hub):
    taken = call(hub, "nadia", "POST", API + "registered-models/create", json={"name": "vision-detector"})
    assert taken.status_code == 403 and "belongs to team 'vision'" in taken.json()["message"], taken.text
    for name in ("detector", "nlp/detector"):
        bad = call(hub, "nadia", "POST", API + "registered-models/create", json={"name": name})
        assert bad.status_code == 400, bad.text
        assert "starts with its team's name and '-', e.g. 'nlp-classifier'" in bad.json()["message"]
    assert call(hub, "nadia", "POST", API + "registered-models/create", json={"name": "nlp-tagger"}).status_code == 200
    # A rename keeps the rule and the team.
    renamed = call(hub, "nadia", "POST", API + "registered-models/rename",
                   json={"name": "nlp-tagger", "new_name": "vision-tagger"})
    assert renamed.status_code == 403, renamed.text
    assert call(hub, "nadia", "POST", API + "registered-models/rename",
                json={"name": "nlp-tagger", "new_name": "tagger"}).status_code == 400
    assert call(hub, "nadia", "POST", API + "registered-models/rename",
                json={"name": "nlp-tagger", "new_name": "nlp-tagger-v2"}).status_code == 200
    # The name vision documents stays free for vision.
    mine = call(hub, "alice", "POST", API + "registered-models/create", json={"name": "vision-detector"})
    assert mine.status_code == 200, mine.text


def test_a_finished_run_is_tagged_with_its_gpu_hours_and_cost_from_the_ledger(hub):
    now = utcnow().replace(microsecond=0)
    start = now - timedelta(hours=3)
    ledger = Ledger(hub.ledger_url)
    # rita held half a card for two hours inside the run, and a quarter for an hour before it started.
    ledger.open_interval("rita-before", "rita", "vision", "h200-quarter", "H200", Fraction(1, 4),
                         start - timedelta(hours=1))
    ledger.close_interval("rita-before", start, "stopped")
    ledger.open_interval("rita-1", "rita", "vision", "h200-quarter", "H200", Fraction(1, 2), start + timedelta(hours=1))
    ledger.close_interval("rita-1", start + timedelta(hours=3), "stopped")
    ledger.dispose()
    experiment = call(hub, "rita", "POST", API + "experiments/create", json={"name": "vision/costs"})
    assert experiment.status_code == 200, experiment.text
    experiment_id = experiment.json()["experiment_id"]
    created = call(hub, "rita", "POST", API + "runs/create", json={
        "experiment_id": experiment_id, "start_time": int(start.timestamp() * 1000),
        "tags": [{"key": "gpupool.team", "value": "vision"}, {"key": "gpupool.profile", "value": "h200-quarter"},
                 {"key": "gpupool.user", "value": "alice"}]})
    assert created.status_code == 200, created.text
    run_id = created.json()["run"]["info"]["run_id"]
    forged = call(hub, "rita", "POST", API + "runs/set-tag", json={"run_id": run_id, "key": "gpupool.cost",
                                                                   "value": "0"})
    assert forged.status_code == 403
    ended = call(hub, "rita", "POST", API + "runs/update", json={
        "run_id": run_id, "status": "FINISHED", "end_time": int(now.timestamp() * 1000)})
    assert ended.status_code == 200, ended.text
    tags = {t["key"]: t["value"] for t in call(hub, "rita", "GET", API + "runs/get",
                                               params={"run_id": run_id}).json()["run"]["data"]["tags"]}
    # The server wrote who ran it (not what the client claimed) and what it cost: 0.5 × 2 h at 3.20.
    assert tags["gpupool.user"] == "rita"
    assert Fraction(tags["gpupool.gpu_hours"]) == 1
    assert tags["gpupool.gpu_seconds"] == "3600"  # half a card for 7200 s
    assert Decimal(tags["gpupool.cost"]) == Decimal("3.20") and tags["gpupool.currency"] == "EUR"

    # A model version made from the run carries the run's cost, written by the server; a client's is refused.
    assert call(hub, "rita", "POST", API + "registered-models/create", json={"name": "vision-costs"}).status_code == 200
    source = f"runs:/{run_id}/model"
    forged = call(hub, "rita", "POST", API + "model-versions/create", json={
        "name": "vision-costs", "source": source, "run_id": run_id, "tags": [{"key": "gpupool.cost", "value": "0"}]})
    assert forged.status_code == 403 and "gpupool.cost" in forged.json()["message"]
    made = call(hub, "rita", "POST", API + "model-versions/create",
                json={"name": "vision-costs", "source": source, "run_id": run_id})
    assert made.status_code == 200, made.text
    version = call(hub, "rita", "GET", API + "model-versions/get",
                   params={"name": "vision-costs", "version": made.json()["model_version"]["version"]}).json()
    version_tags = {t["key"]: t["value"] for t in version["model_version"]["tags"]}
    assert {k: version_tags[k] for k in COST_TAGS} == {k: tags[k] for k in COST_TAGS}


def test_a_browser_logs_in_through_the_hub_and_sees_its_teams_experiment_without_errors(hub, notebook, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("headless Chromium is not installed (apt-get install chromium chromium-driver; "
                    "`make install` does it as root)")
    from selenium.common.exceptions import TimeoutException

    shots = REPO_ROOT / "docs" / "screenshots"
    b = Browser(chromium, driver)

    def errors() -> list[str]:
        return b.failed_requests() + [f"console: {m}" for m in b.console_errors()]

    try:
        b.get(f"{hub.url}/services/mlflow/")
        b.wait(lambda d: "/hub/login" in d.current_url, 60, "the logged-out browser was not sent to the hub login")
        b.fill({"username_input": "alice", "password_input": PASSWORD})
        b.click("#login_submit")
        b.wait(lambda d: "/services/mlflow/" in d.current_url, 120, "the hub login did not lead back to MLflow")
        b.start_recording()  # the hub's login pages are not what this test is about
        # The first page a user sees.
        b.get(f"{hub.url}/services/mlflow/")
        b.wait_for_text("vision", 300)
        b.wait_page_loaded()
        assert "nlp" not in [a.text for a in b.css("a")]
        b.screenshot(shots / "mlflow-experiments.png")
        first_page, first_text = errors(), b.text()
        # The team's experiment, in its default view.
        b.start_recording()
        b.get(f"{hub.url}/services/mlflow/#/experiments/{notebook['experiment_id']}")
        # Its default view (Overview) draws the experiment's charts: data, "no data", or the error this is about.
        try:
            b.wait(lambda d: any(text in b.text() for text in ("No data available", "Failed to load")), 300)
        except TimeoutException:
            raise AssertionError(f"the experiment page drew no charts in 300 s; it shows:\n{b.text()[:2000]}\n"
                                 f"still loading: {b.loading()}") from None
        b.wait_page_loaded()
        b.screenshot(shots / "mlflow-experiment.png")
        body, experiment_page = b.text(), errors()
    finally:
        b.screenshot(tmp_path / "mlflow-ui-last.png")
        b.quit()
    assert first_page == [] and experiment_page == [], (first_page, experiment_page)
    assert "Failed to load" not in body, body[:2000]
    # What a private platform's first page must not show: the assistant opened by itself, a telemetry notice.
    assert "Information about UI telemetry" not in first_text and "Assistant" not in first_text, first_text


@pytest.mark.postgresql
def test_mlflow_runs_and_models_on_postgresql(postgres_server, tmp_path_factory):
    hub = Hub(tmp_path_factory.mktemp("mlflow-pg"), POLICY, SELF,
              mlflow_backend_url=postgres_server.create_database("mlflow"))
    hub.start()
    try:
        hub.wait_service("mlflow", "health")
        hub.add_user("alice", "vision")
        hub.add_user("nadia", "nlp")
        created = call(hub, "alice", "POST", API + "experiments/create", json={"name": "vision"})
        assert created.status_code == 200, created.text
        run = call(hub, "alice", "POST", API + "runs/create", json={"experiment_id": created.json()["experiment_id"]})
        assert run.status_code == 200, run.text
        assert call(hub, "alice", "POST", API + "registered-models/create", json={"name": MODEL}).status_code == 200
        assert call(hub, "nadia", "GET", API + "registered-models/get", params={"name": MODEL}).status_code == 404
        listed = call(hub, "nadia", "POST", API + "experiments/search", json={}).json()
        assert listed.get("experiments", []) == []
    finally:
        hub.stop()
