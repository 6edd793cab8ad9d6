"""The pure core of the MLflow service: artifact roots, the team of a new object, routes, alias rules, run cost."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from decimal import Decimal
from fractions import Fraction

import pytest

from gpupool.hub.accounting.ledger import Interval
from gpupool.mlflow.cost import run_cost
from gpupool.mlflow.permissions import (
    ROUTES,
    Refused,
    answer,
    Viewer,
    check_alias,
    check_location,
    model_name_team,
    route_of,
    run_context,
    team_for_model,
    team_for_new,
    viewer_of,
)
from gpupool.policies import load_policy

TEAMS = ["vision", "nlp", "vision-extra"]
ALICE = Viewer("alice", False, ("vision",), frozenset())
RITA = Viewer("rita", False, ("vision",), frozenset({"vision"}))
BOTH = Viewer("bo", False, ("nlp", "vision"), frozenset())
ROOT = Viewer("root", True, (), frozenset())


@pytest.mark.parametrize("uri", ["mlflow-artifacts:/vision/abc", "mlflow-artifacts:/vision/abc/1/artifacts/",
                                 "mlflow-artifacts:/vision/a b+c=d"])
def test_locations_under_the_team_root_are_accepted(uri):
    assert check_location(uri, "vision") == uri


@pytest.mark.parametrize("uri", [
    None, 7, "", "file:///etc", "/etc", "vision/x", "mlflow-artifacts:/", "mlflow-artifacts:vision/x",
    "mlflow-artifacts:/nlp/x", "mlflow-artifacts:/vision-extra/x", "mlflow-artifacts:/visionx",
    "mlflow-artifacts:/vision/../nlp", "mlflow-artifacts:/vision/./x", "mlflow-artifacts:/vision//x",
    "mlflow-artifacts:/vision/%2e%2e/nlp", "mlflow-artifacts:/vision/x#y", "mlflow-artifacts:/vision/x?y=1",
    "mlflow-artifacts:/vision\\..\\nlp", "mlflow-artifacts://host/vision/x", "mlflow-artifacts:///vision/x",
    "mlflow-artifacts:/vision/x\x00", "s3://other/vision", "http://169.254.169.254/latest",
    "mlflow-artifacts:/vision/" + "a" * 2000,
])
def test_anything_else_is_refused_with_the_accepted_form(uri):
    with pytest.raises(Refused) as refused:
        check_location(uri, "vision")
    assert refused.value.status == 400 and "mlflow-artifacts:/vision/<path>" in refused.value.message


def test_the_team_of_a_new_object():
    assert team_for_new(ALICE, "my-exp", None, TEAMS) == "vision"
    assert team_for_new(BOTH, "my-exp", None, TEAMS) == "nlp"  # first team in policy order
    assert team_for_new(BOTH, "vision/exp", None, TEAMS) == "vision"
    assert team_for_new(BOTH, "x", "vision", TEAMS) == "vision"
    assert team_for_new(ALICE, "vision", None, TEAMS) == "vision"
    for name, requested in [("nlp", None), ("nlp/x", None), ("x", "nlp"), ("x", "nowhere")]:
        with pytest.raises(Refused) as refused:
            team_for_new(ALICE, name, requested, TEAMS)
        assert refused.value.status == 403
    with pytest.raises(Refused, match="in no team"):
        team_for_new(Viewer("x", False, (), frozenset()), "x", None, TEAMS)
    assert team_for_new(ROOT, "nlp/x", None, TEAMS) == "nlp"


def test_a_registered_models_name_starts_with_its_team_and_a_dash():
    assert team_for_model(ALICE, "vision-classifier", None, TEAMS) == "vision"
    assert team_for_model(ALICE, "vision-classifier", "vision", TEAMS) == "vision"
    assert team_for_model(BOTH, "nlp-tagger", None, TEAMS) == "nlp"
    assert team_for_model(ROOT, "nlp-tagger", None, TEAMS) == "nlp"
    # The longest team name wins: "vision-extra-x" is vision-extra's, not vision's.
    assert model_name_team("vision-extra-x", TEAMS) == "vision-extra"
    assert model_name_team("vision-extrax", TEAMS) == "vision"
    for name in ("classifier", "vision", "vision-", "vision/classifier", "visionclassifier", "Vision-x", None, 7):
        with pytest.raises(Refused) as refused:
            team_for_model(ALICE, name, None, TEAMS)
        assert refused.value.status == 400, name
        assert "starts with its team's name and '-'" in refused.value.message
        assert "'vision-classifier'" in refused.value.message
    for name in ("nlp-tagger", "vision-extra-x"):  # another team's
        with pytest.raises(Refused) as refused:
            team_for_model(ALICE, name, None, TEAMS)
        assert refused.value.status == 403 and "belongs to team" in refused.value.message
    with pytest.raises(Refused) as refused:  # the name says vision, the tag says nlp
        team_for_model(BOTH, "vision-x", "nlp", TEAMS)
    assert refused.value.status == 400


def test_only_reviewers_touch_production():
    check_alias(ALICE, "vision", "candidate")
    check_alias(RITA, "vision", "production")
    check_alias(ROOT, "vision", "production")
    for viewer, alias in [(ALICE, "production"), (ALICE, "Production"), (RITA, None)]:
        with pytest.raises(Refused):
            check_alias(viewer, "vision", alias)
    # A reviewer of a team is not one of another team.
    with pytest.raises(Refused):
        check_alias(RITA, "nlp", "production")


def test_routes_are_an_allow_list():
    assert route_of("GET", "/api/2.0/mlflow/runs/get") == ("run:read", ())
    assert route_of("GET", "/ajax-api/2.0/mlflow/runs/get") == ("run:read", ())
    assert route_of("HEAD", "/static-files/js/main.js") == ("ui", ("js/main.js",))
    assert route_of("PATCH", "/api/2.0/mlflow/logged-models/m-1/tags") == ("logged-model:write", ("m-1",))
    for method, path in [("POST", "/api/2.0/mlflow/runs/get"), ("GET", "/api/2.0/mlflow/traces"),
                         ("POST", "/api/2.0/mlflow/gateway/routes"), ("GET", "/api/2.0/mlflow/runs/get/x"),
                         ("GET", "/admin"), ("POST", "/api/2.0/mlflow/users/create")]:
        with pytest.raises(Refused) as refused:
            route_of(method, path)
        assert refused.value.status == 404
    # Every MLflow route listed exists in this MLflow (a renamed route would silently stay closed).
    from mlflow.server.handlers import get_endpoints

    mlflow_routes = {(m, p.replace("<model_id>", "<id>").replace("<path:artifact_path>", "<path>")
                      .replace("<tag_key>", "<path>"))
                     for p, _, methods in get_endpoints() for m in methods}
    api = {(m, p) for (m, p), rule in ROUTES.items() if p.startswith("/api/") and "get-history-bulk" not in p
           and "search-datasets" not in p and not p.endswith("/artifacts/files") and not rule.startswith("answer:")
           and "ui-telemetry" not in p}  # (served at ajax-api/ only)
    assert api <= mlflow_routes, api - mlflow_routes


def test_the_ui_gets_gpupools_own_answers_for_login_and_the_assistant():
    assert route_of("GET", "/ajax-api/2.0/mlflow/users/current") == ("answer:current-user", ())
    assert answer("current-user", ALICE)["user"]["username"] == "alice"
    assert route_of("GET", "/ajax-api/3.0/mlflow/assistant/config") == ("answer:assistant-config", ())
    assert answer("assistant-config", ALICE)["remote_access_allowed"] is False
    assert answer("assistant-providers", ALICE)["providers"] == []
    # The runs page asks for AI gateway endpoints: none (the gateway is off); using one stays refused.
    assert route_of("GET", "/ajax-api/2.0/mlflow/gateway-proxy") == ("answer:gateway-endpoints", ())
    assert answer("gateway-endpoints", ALICE) == {"endpoints": []}
    with pytest.raises(Refused):
        route_of("POST", "/ajax-api/2.0/mlflow/gateway-proxy")
    # Everything else of the assistant (sessions, installing providers, running tools) stays closed.
    for method, path in [("POST", "/ajax-api/3.0/mlflow/assistant/message"),
                         ("PUT", "/ajax-api/3.0/mlflow/assistant/config")]:
        with pytest.raises(Refused):
            route_of(method, path)


def test_viewer_from_hub_model_and_policies():
    policy = load_policy_text("""
teams:
  vision: {members: [rita], reviewers: [rita]}
  nlp: {}
""")
    viewer = viewer_of({"name": "rita", "admin": False, "groups": ["nlp", "not-a-team"]}, policy)
    assert viewer == Viewer("rita", False, ("vision", "nlp"), frozenset({"vision"}))


def test_a_servers_own_token_names_its_server_and_a_personal_token_none():
    policy = load_policy_text("teams:\n  vision: {members: [alice]}\n")
    server = {"name": "alice", "groups": [], "scopes": ["access:servers!server=alice/", "users:activity!user=alice"]}
    named = {"name": "alice", "groups": [], "scopes": ["access:servers!server=alice/second"]}
    personal = {"name": "alice", "groups": [], "scopes": ["access:servers!user=alice", "read:users!user=alice"]}
    other = {"name": "alice", "groups": [], "scopes": ["access:servers!server=bob/"]}
    assert viewer_of(server, policy).servers == ("",)
    assert viewer_of(named, policy).servers == ("second",)
    assert viewer_of(personal, policy).servers == () and viewer_of(other, policy).servers == ()


def test_what_a_run_ran_on_is_the_platforms_and_a_client_cannot_choose_it():
    policy = load_policy_text("""teams:
  vision: {members: [alice]}
  nlp: {members: [nadia]}
""")
    facts = {"gpupool.team": "vision", "gpupool.profile": "q", "gpupool.gpu_model": "H200", "gpupool.share": "1/4"}
    # The plugin sends what the server was started with: the same, so accepted; nothing sent: the platform's.
    assert run_context(ALICE, dict(facts), facts, "server alice/", policy) == facts
    assert run_context(ALICE, {"gpupool.share": "0.25"}, facts, "server alice/", policy) == facts
    assert run_context(ALICE, {}, facts, "server alice/", policy) == facts
    assert run_context(ALICE, {}, None, "this token", policy) == {}
    forged = [({"gpupool.team": "nlp"}, facts), ({"gpupool.share": "8"}, facts), ({"gpupool.profile": "x"}, facts),
              ({"gpupool.gpu_model": "A100-80GB"}, facts), ({"gpupool.job": "j-1"}, facts),
              ({"gpupool.share": "a/b"}, facts), ({"gpupool.team": "vision"}, None), ({"gpupool.share": "0"}, None),
              # No exponent: "1e100000000" would be a 100-million-digit number to compare, minutes of MLflow's worker.
              ({"gpupool.share": "2.5e-1"}, facts), ({"gpupool.share": "1e100000000"}, facts),
              # A server holding no GPU: a team of the caller's and a profile without a GPU, nothing else.
              ({"gpupool.team": "nlp"}, {"gpupool.share": "0"}), ({"gpupool.profile": "q"}, {"gpupool.share": "0"}),
              ({"gpupool.share": "1/4"}, {"gpupool.share": "0"})]
    for sent, known in forged:
        with pytest.raises(Refused) as refused:
            run_context(ALICE, sent, known, "server alice/", policy)
        tag = next(iter(sent))
        assert refused.value.status == 403 and refused.value.message.startswith(f"{tag} is set by the platform")
    with pytest.raises(Refused) as refused:
        run_context(ALICE, {"gpupool.team": 7}, facts, "server alice/", policy)
    assert refused.value.status == 400
    assert run_context(ALICE, {"gpupool.team": "vision"}, {"gpupool.share": "0"}, "server alice/", policy) == {
        "gpupool.team": "vision", "gpupool.share": "0"}


def load_policy_text(teams: str):
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp())
    (folder / "policy.yaml").write_text("""
models:
  H200: {vendor: nvidia, memory_gib: 141, backends: [hami]}
  A100-80GB: {vendor: nvidia, memory_gib: 80, backends: [hami]}
inventory: [{model: H200, count: 2}, {model: A100-80GB, count: 1}]
profiles:
  q: {display_name: q, gpu: {model: H200, share: 0.25}, teams: [vision]}
billing: {prices: {H200: '3.20', A100-80GB: '1.10'}}
""" + teams)
    return load_policy(folder)


def test_run_cost_counts_only_the_runs_window_per_model_price():
    policy = load_policy_text("teams:\n  vision: {}\n")
    t0 = datetime(2026, 11, 30, 22, tzinfo=timezone.utc)

    def interval(key, model, share, start_h, end_h, profile="q"):
        end = None if end_h is None else t0 + timedelta(hours=end_h)
        return Interval(key, "alice", "vision", profile, model, Fraction(share), t0 + timedelta(hours=start_h),
                        end, None, t0, timedelta(0))

    intervals = [
        interval("a", "H200", "1/2", -1, 2),  # 2 h inside → 1 GPU-h
        interval("b", "A100-80GB", "1", 1, None),  # open: counts to the run's end → 2 GPU-h
        interval("c", "H200", "1", 5, 6),  # after the run
        interval("d", "H200", "1", 0, 1, profile="other"),  # another profile
    ]
    cost = run_cost(policy, intervals, t0, t0 + timedelta(hours=3), profile="q")
    assert cost.gpu_hours == 3
    assert cost.cost == Decimal("5.40") and cost.currency == "EUR"  # 1 × 3.20 + 2 × 1.10, across a month end
    tags = cost.tags()
    assert Fraction(tags["gpupool.gpu_hours"]) == 3 and Decimal(tags["gpupool.cost"]) == Decimal("5.40")
    everything = run_cost(policy, intervals, t0, t0 + timedelta(hours=3))
    assert everything.gpu_hours == 4
    assert run_cost(policy, [], t0, t0).cost == Decimal("0.00")


def test_a_run_of_seconds_costs_its_ledger_seconds_exactly():
    """Runs are timed in milliseconds, the ledger in whole seconds: a short run still shows what it used."""
    policy = load_policy_text("teams:\n  vision: {}\n")
    t0 = datetime(2026, 12, 3, 9, tzinfo=timezone.utc)
    server = Interval("s", "alice", "vision", "q", "H200", Fraction(1, 4), t0, None, None, t0, timedelta(0))
    ms = timedelta(milliseconds=1)
    # 5 s on a quarter H200 at 3.20 per GPU-hour: 5/4 GPU-seconds, 0.000347 GPU-h, 0.0011 EUR.
    five = run_cost(policy, [server], t0 + 300 * ms, t0 + 5300 * ms, profile="q")
    assert five.gpu_hours == Fraction(5, 4 * 3600)
    assert five.tags() == {"gpupool.gpu_hours": "0.000347", "gpupool.gpu_seconds": "5/4",
                           "gpupool.cost": "0.0011", "gpupool.currency": "EUR"}
    # Under a second, across a ledger second: that second (the ledger bills it), not nothing.
    assert run_cost(policy, [server], t0 + 900 * ms, t0 + 1200 * ms).gpu_hours == Fraction(1, 4 * 3600)
    # Runs one after another share out the server's seconds: together exactly what the ledger holds.
    bounds = [t0 + k * 700 * ms for k in range(12)]
    parts = [run_cost(policy, [server], a, b).gpu_hours for a, b in zip(bounds, bounds[1:])]
    whole = run_cost(policy, [server], bounds[0], bounds[-1]).gpu_hours
    assert sum(parts) == whole == Fraction(7, 4 * 3600)  # seconds 0..7 of the ledger
