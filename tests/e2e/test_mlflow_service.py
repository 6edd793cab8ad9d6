"""MLflow behind the hub: a real `mlflow server --app-name gpupool` started by `gpupool up`, real hub tokens.

The notebook flow runs inside a spawned user server (its kernel, its environment); the other checks use
real hub users' tokens against the service through the real proxy. The gate's reading and forwarding of a
request, which needs no server: tests/unit/mlflow/test_mlflow_gate.py.
"""

from __future__ import annotations

import json
import shutil
import textwrap
import time
from datetime import timedelta
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest
import requests

from gpupool.hub.accounting.bills import round_half_up
from gpupool.hub.accounting.ledger import Ledger
from gpupool.policies.periods import utcnow
from harness import Browser, Hub, wait_for
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
REPO_ROOT = Path(__file__).resolve().parents[2]


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
        try:  # what a user's code might claim it ran on: the server refuses it
            client.create_run(run.info.experiment_id, tags={{"gpupool.share": "8"}})
            forged = "accepted"
        except Exception as error:
            forged = str(error)
        version = client.get_latest_versions({MODEL!r})[0].version
        client.set_registered_model_alias({MODEL!r}, "candidate", version)
        print(json.dumps({{"env": env, "run_id": run.info.run_id, "experiment_id": run.info.experiment_id,
                           "version": version, "tags": client.get_run(run.info.run_id).data.tags,
                          "forged": forged}}))
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
    # The run is tagged with who ran it on what share: the server's facts (the ledger's record of the server the
    # token belongs to), which the run-context plugin sent too; a claim of another share is refused.
    tags = notebook["tags"]
    assert tags["gpupool.user"] == "alice" and tags["gpupool.team"] == "vision"
    assert tags["gpupool.profile"] == "h200-quarter" and tags["gpupool.share"] == "1/4"
    assert tags["gpupool.gpu_model"] == "H200" and "gpupool.job" not in tags
    assert notebook["forged"].startswith("PERMISSION_DENIED: gpupool.share is set by the platform"), notebook["forged"]
    assert "server alice/, whose gpupool.share is '1/4', not '8'" in notebook["forged"], notebook["forged"]
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


def test_a_policy_edit_reaches_the_services_checks(tmp_path):
    from harness import wait_for
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
    ledger = Ledger(hub.ledger_url)
    # rita holds half a card through the whole run, and held a quarter for an hour before it started.
    ledger.open_interval("rita-before", "rita", "vision", "h200-quarter", "H200", Fraction(1, 4),
                         now - timedelta(hours=3))
    ledger.close_interval("rita-before", now - timedelta(hours=2), "stopped")
    ledger.open_interval("rita-1", "rita", "vision", "h200-quarter", "H200", Fraction(1, 2), now - timedelta(hours=1))
    try:
        experiment = call(hub, "rita", "POST", API + "experiments/create", json={"name": "vision/costs"})
        assert experiment.status_code == 200, experiment.text
        # A client's start and end would choose the window the run is priced over: the server's clock decides.
        created = call(hub, "rita", "POST", API + "runs/create", json={
            "experiment_id": experiment.json()["experiment_id"],
            "start_time": int((now - timedelta(hours=3)).timestamp() * 1000)})
        assert created.status_code == 200, created.text
        run_id, start_ms = created.json()["run"]["info"]["run_id"], created.json()["run"]["info"]["start_time"]
        assert start_ms >= now.timestamp() * 1000
        forged = call(hub, "rita", "POST", API + "runs/set-tag", json={"run_id": run_id, "key": "gpupool.cost",
                                                                       "value": "0"})
        assert forged.status_code == 403
        wait_for(lambda: time.time() >= start_ms // 1000 + 1, timeout=10, every=0.05,
                 message="the clock never reached the run's next second")  # so that the run holds a ledger second
        ended = call(hub, "rita", "POST", API + "runs/update", json={
            "run_id": run_id, "status": "FINISHED", "end_time": start_ms})
        assert ended.status_code == 200, ended.text
    finally:
        ledger.close_interval("rita-1", utcnow(), "stopped")
        ledger.dispose()
    run = call(hub, "rita", "GET", API + "runs/get", params={"run_id": run_id}).json()["run"]
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    # The server wrote who ran it and what it cost: half a card over each ledger second of the run, at 3.20.
    seconds = run["info"]["end_time"] // 1000 - start_ms // 1000
    assert run["info"]["start_time"] == start_ms and seconds >= 1, run["info"]
    assert tags["gpupool.user"] == "rita"
    assert Fraction(tags["gpupool.gpu_seconds"]) == Fraction(1, 2) * seconds, (seconds, tags)
    hours = Fraction(1, 2) * seconds / 3600
    assert Decimal(tags["gpupool.gpu_hours"]) == round_half_up(hours, 6)
    assert Decimal(tags["gpupool.cost"]) == round_half_up(hours * Fraction("3.20"), 4) > 0
    assert tags["gpupool.currency"] == "EUR"

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


def test_a_user_cannot_tag_a_run_with_what_it_ran_on_or_what_it_cost(hub):
    """The attack of issue 33: an nlp user's run stored as team=vision, share=8, its cost steered to 0."""
    created = call(hub, "nadia", "POST", API + "experiments/create", json={"name": "nlp/forged"})
    assert created.status_code == 200, created.text
    experiment_id = created.json()["experiment_id"]
    platform_tags = [("gpupool.team", "vision"), ("gpupool.profile", "h200-quarter"), ("gpupool.share", "8"),
                     ("gpupool.gpu_model", "H200"), ("gpupool.job", "0123456789ab"), ("gpupool.cost", "0"),
                     ("gpupool.gpu_hours", "0"), ("gpupool.gpu_seconds", "0"), ("gpupool.currency", "EUR")]
    for tag, value in platform_tags:
        for prefix in (API, "ajax-api/2.0/mlflow/"):  # the client's and the UI's doors
            reply = call(hub, "nadia", "POST", prefix + "runs/create",
                         json={"experiment_id": experiment_id, "tags": [{"key": tag, "value": value}]})
            assert reply.status_code == 403, (tag, prefix, reply.text)
            assert reply.json()["message"].startswith(f"{tag} is set by the platform"), reply.text
    run = call(hub, "nadia", "POST", API + "runs/create", json={"experiment_id": experiment_id})
    assert run.status_code == 200, run.text
    run_id, start_ms = run.json()["run"]["info"]["run_id"], run.json()["run"]["info"]["start_time"]
    for tag, value in platform_tags + [("gpupool.user", "alice")]:
        for path, body in [("runs/set-tag", {"run_id": run_id, "key": tag, "value": value}),
                           ("runs/delete-tag", {"run_id": run_id, "key": tag}),
                           ("runs/log-batch", {"run_id": run_id, "tags": [{"key": tag, "value": value}]})]:
            for prefix in (API, "ajax-api/2.0/mlflow/"):
                reply = call(hub, "nadia", "POST", prefix + path, json=body)
                assert reply.status_code == 403, (tag, prefix + path, reply.text)
                assert reply.json()["message"].startswith(f"{tag} is set by the platform"), reply.text
    # A logged model carries the same tags (MLflow's client tags it with the run's context): the same rule.
    model = call(hub, "nadia", "POST", API + "logged-models", json={
        "experiment_id": experiment_id, "name": "m", "tags": [{"key": "gpupool.team", "value": "vision"}]})
    assert model.status_code == 403 and "gpupool.team is set by the platform" in model.json()["message"]
    model = call(hub, "nadia", "POST", API + "logged-models", json={"experiment_id": experiment_id, "name": "m"})
    assert model.status_code == 200, model.text
    model_id = model.json()["model"]["info"]["model_id"]
    forged = call(hub, "nadia", "PATCH", API + f"logged-models/{model_id}/tags",
                  json={"model_id": model_id, "tags": [{"key": "gpupool.cost", "value": "0"}]})
    assert forged.status_code == 403 and "gpupool.cost is set by the platform" in forged.json()["message"]
    removed = call(hub, "nadia", "DELETE", API + f"logged-models/{model_id}/tags/gpupool.user")
    assert removed.status_code == 403 and "gpupool.user is set by the platform" in removed.json()["message"]
    # An end before the start would price the run at 0: the server ends it by its own clock.
    ended = call(hub, "nadia", "POST", API + "runs/update",
                 json={"run_id": run_id, "status": "FINISHED", "end_time": start_ms - 3_600_000})
    assert ended.status_code == 200, ended.text
    stored = call(hub, "nadia", "GET", API + "runs/get", params={"run_id": run_id}).json()["run"]
    assert stored["info"]["end_time"] >= start_ms, stored["info"]
    tags = {t["key"]: t["value"] for t in stored["data"]["tags"]}
    assert tags["gpupool.user"] == "nadia" and Decimal(tags["gpupool.cost"]) == 0 and tags["gpupool.currency"] == "EUR"
    assert not {"gpupool.team", "gpupool.profile", "gpupool.share", "gpupool.gpu_model", "gpupool.job"} & set(tags)


def test_a_browser_logs_in_through_the_hub_and_sees_its_teams_experiment_without_errors(hub, notebook, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("headless Chromium is not installed (apt-get install chromium chromium-driver; "
                    "`make install` does it as root)")
    from selenium.common.exceptions import TimeoutException

    shots = REPO_ROOT / "docs" / "screenshots"
    run_name = call(hub, "alice", "GET", API + "runs/get", params={"run_id": notebook["run_id"]}).json()["run"][
        "info"]["run_name"]
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
        # The first page a user sees: the experiments (MLflow's own first page is its GenAI home: a demo, prompts,
        # the AI gateway, all refused here), the model registry beside them, and the way back to the hub.
        b.get(f"{hub.url}/services/mlflow/")
        b.wait(lambda d: d.current_url.endswith("#/experiments"), 120, "the first page is not the experiments")
        b.wait_for_text("vision", 300)
        b.wait_page_loaded()
        assert "nlp" not in [a.text for a in b.css("a")]
        nav = [a.text for a in b.css("aside a") if a.is_displayed()]
        b.screenshot(shots / "mlflow-experiments.png")
        first_page, first_text = errors(), b.text()
        # The team's experiment: its runs, the notebook's among them.
        b.start_recording()
        b.get(f"{hub.url}/services/mlflow/#/experiments/{notebook['experiment_id']}")
        try:
            b.wait(lambda d: run_name in b.text(), 300)
        except TimeoutException:
            raise AssertionError(f"the experiment page never listed the notebook's run {run_name!r}; it shows:\n"
                                 f"{b.text()[:2000]}\nstill loading: {b.loading()}") from None
        b.wait_page_loaded()
        b.screenshot(shots / "mlflow-experiment.png")
        body, experiment_page = b.text(), errors()
        experiment_nav = [a.text for a in b.css("aside a") if a.is_displayed()]
        assistant = [e for e in b.css("[data-assistant-ui]") if e.is_displayed()]
        # The model registry, and back to the hub from it.
        b.get(f"{hub.url}/services/mlflow/#/models")
        b.wait_for_text(MODEL, 300)
        # A link that asks for the GenAI mode (MLflow's UI reads `workflowType` from the route, and opens an
        # experiment on its traces' overview in that mode) opens the experiment in the "Model training" mode: its
        # runs, no Traces.
        b.get(f"{hub.url}/services/mlflow/#/experiments/{notebook['experiment_id']}?workflowType=genai")
        try:
            b.wait(lambda d: "workflowType=genai" not in d.current_url and run_name in b.text(), 300)
        except TimeoutException:
            raise AssertionError(f"the GenAI mode's address did not open the experiment's runs: at "
                                 f"{b.driver.current_url}, it shows:\n{b.text()[:1000]}") from None
        b.wait_page_loaded()
        asked_genai_nav = [a.text for a in b.css("aside a") if a.is_displayed()]
        b.click("#gpupool-hub-link")
        b.wait(lambda d: d.current_url.endswith("/hub/home"), 120, "the hub link did not lead to the hub's home")
        b.wait_for_text("alice", 120)
    finally:
        b.screenshot(tmp_path / "mlflow-ui-last.png")
        b.quit()
    assert first_page == [] and experiment_page == [], (first_page, experiment_page)
    assert "Failed to load" not in body, body[:2000]
    assert "Experiments" in nav and "Model registry" in nav and "Hub home" in nav, nav
    assert "Runs" in experiment_nav and "Traces" not in experiment_nav and "Hub home" in experiment_nav, experiment_nav
    assert "Runs" in asked_genai_nav and "Traces" not in asked_genai_nav, asked_genai_nav
    assert assistant == [], "the assistant's button is shown"
    # What a private platform's first page must not show: what gpupool refuses (GenAI's pages, the demo, the
    # assistant) and a telemetry notice.
    for refused in ("GenAI", "Prompts", "MCP registry", "AI Gateway", "Start Demo", "Welcome to MLflow",
                    "Assistant", "Settings", "Information about UI telemetry"):
        assert refused not in first_text and refused not in " ".join(nav), (refused, nav, first_text)


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
