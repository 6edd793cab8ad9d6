"""The `gpupool` MLflow app (`mlflow server --app-name gpupool`): the hub login and team permissions in front of MLflow.

An ASGI layer around MLflow's own app: browsers log in through HubOAuth, API clients send their JupyterHub token
as `Authorization: Bearer`; every request is checked against `permissions.ROUTES` before MLflow sees it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from datetime import datetime, timedelta, timezone
from http.cookies import SimpleCookie
from urllib.parse import parse_qs, quote, urlencode

import anyio
import psutil

from gpupool.hub.accounting.ledger import JOB_RUN_PREFIX, run_server
from gpupool.mlflow.cost import COST_TAGS, run_cost
from gpupool.mlflow.permissions import (
    AUTHOR_TAG,
    RUN_CONTEXT_TAGS,
    SERVER_TAG_PREFIX,
    TEAM_TAG,
    Refused,
    Viewer,
    answer,
    check_alias,
    check_location,
    relative_segments,
    route_of,
    run_context,
    team_for_model,
    team_for_new,
    viewer_of,
)
from gpupool.policies import periods

log = logging.getLogger("gpupool.mlflow")

#: Largest request body accepted (artifact uploads included); larger ones get 413 before MLflow reads them.
MAX_BODY_BYTES = int(os.environ.get("GPUPOOL_MLFLOW_MAX_BODY_BYTES", str(512 * 1024 * 1024)))
#: JSON API bodies (everything but artifact uploads) are much smaller.
MAX_JSON_BYTES = 4 * 1024 * 1024
#: Requests up to this size are decided on the event loop when their owners are remembered (`HubGate.decide`).
LOOP_DECISION_BYTES = 64 * 1024
#: How soon an edit of the policy files reaches this service (hub group changes: `cache_max_age`, a minute).
POLICY_RECHECK_SECONDS = 1.0
TOKEN_COOKIE = "gpupool-mlflow-token"
STATE_COOKIE = "gpupool-mlflow-oauth-state"
TERMINAL_STATUSES = {"FINISHED", "FAILED", "KILLED"}
#: GraphQL root fields the UI uses, and the argument each is checked by.
GRAPHQL_FIELDS = {
    "mlflowGetExperiment": ("experimentId", "experiment"),
    "mlflowGetRun": ("runId", "run"),
    "mlflowListArtifacts": ("runId", "run"),
    "mlflowGetMetricHistoryBulkInterval": ("runIds", "runs"),
    "mlflowSearchRuns": ("experimentIds", "experiments"),
}


def _iso(moment: datetime) -> str:
    return moment.isoformat(timespec="seconds")


class _Remembered:
    """A small thread-safe LRU map whose entries expire after `max_age` seconds (None: never)."""

    def __init__(self, size: int, max_age: float | None):
        self._items: OrderedDict[str, tuple[float, object]] = OrderedDict()
        self._size, self._max_age, self._lock = size, max_age, threading.Lock()

    def get(self, key: str, default=None):
        with self._lock:
            item = self._items.get(key)
            if item is None or (self._max_age is not None and time.monotonic() - item[0] > self._max_age):
                return default
            self._items.move_to_end(key)
            return item[1]

    def put(self, key: str, value: object) -> None:
        with self._lock:
            self._items[key] = (time.monotonic(), value)
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def forget(self, key: str) -> None:
        with self._lock:
            self._items.pop(key, None)


#: Owner look-ups remembered: a run's experiment never changes; an experiment's team only when an admin re-tags
#: it through this service (forgotten then) — the minute is for other writers of the same database.
_MISSING = object()
TEAM_MEMORY_SECONDS = 60


class NeedsDatabase(Exception):
    """A look-up not remembered, asked where only remembered ones may be used (`Stores.remembered_only`)."""


class Stores:
    """Owner look-ups and the server's own writes, on MLflow's stores in this process."""

    def __init__(self):
        from mlflow.server import handlers

        self._handlers = handlers
        # Every call on a run is checked by its team: without these, each one read the whole run (its
        # metrics, params and tags) and its experiment from the database before MLflow read them again.
        self._run_experiments = _Remembered(100_000, None)
        self._experiment_teams = _Remembered(10_000, TEAM_MEMORY_SECONDS)
        self._here = threading.local()

    @contextlib.contextmanager
    def remembered_only(self):
        """Within it, on this thread, every use of MLflow's stores raises `NeedsDatabase` instead of reading."""
        self._here.remembered_only = True
        try:
            yield
        finally:
            self._here.remembered_only = False

    def may_read(self) -> None:
        """`NeedsDatabase` where only remembered look-ups may be used (the ledger's database too)."""
        if getattr(self._here, "remembered_only", False):
            raise NeedsDatabase()

    def _store(self, get):
        self.may_read()
        return get()

    @property
    def tracking(self):
        return self._store(self._handlers._get_tracking_store)

    @property
    def registry(self):
        return self._store(self._handlers._get_model_registry_store)

    def _or_404(self, what: str, call, *args):
        from mlflow.exceptions import MlflowException

        try:
            return call(*args)
        except MlflowException:
            raise Refused(404, f"no {what} that you may see") from None

    def experiment_team(self, experiment_id: object) -> str | None:
        if not isinstance(experiment_id, str | int) or not str(experiment_id).isdigit():
            raise Refused(400, f"experiment_id must be a number, not {experiment_id!r}")
        key = str(experiment_id)
        team = self._experiment_teams.get(key, _MISSING)
        if team is _MISSING:
            team = self._or_404("such experiment", self.tracking.get_experiment, key).tags.get(TEAM_TAG)
            self._experiment_teams.put(key, team)
        return team

    def forget_experiment(self, experiment_id: object) -> None:
        self._experiment_teams.forget(str(experiment_id))

    def run(self, run_id: object):
        if not isinstance(run_id, str) or not run_id.isalnum():
            raise Refused(400, f"run_id must be a run's id, not {run_id!r}")
        return self._or_404("such run", self.tracking.get_run, run_id)

    def run_team(self, run_id: object) -> str | None:
        experiment_id = self._run_experiments.get(run_id) if isinstance(run_id, str) else None
        if experiment_id is None:
            experiment_id = self.run(run_id).info.experiment_id
            self._run_experiments.put(run_id, experiment_id)
        return self.experiment_team(experiment_id)

    def logged_model_team(self, model_id: object) -> str | None:
        if not isinstance(model_id, str) or not model_id.replace("-", "").isalnum():
            raise Refused(400, f"model_id must be a logged model's id, not {model_id!r}")
        model = self._or_404("such logged model", self.tracking.get_logged_model, model_id)
        return self.experiment_team(model.experiment_id)

    def model_team(self, name: object) -> str | None:
        if not isinstance(name, str) or not name:
            raise Refused(400, "name must be a registered model's name")
        return self._or_404("such registered model", self.registry.get_registered_model, name).tags.get(TEAM_TAG)

    def alias_version(self, name: str, alias: str) -> str | None:
        from mlflow.exceptions import MlflowException

        try:
            return str(self.registry.get_model_version_by_alias(name, alias).version)
        except MlflowException:
            return None

    def set_version_tags(self, name: str, version: str, tags: dict[str, str]) -> None:
        from mlflow.entities.model_registry import ModelVersionTag

        for key, value in tags.items():
            self.registry.set_model_version_tag(name, version, ModelVersionTag(key, value))

    def set_run_tags(self, run_id: str, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        for key, value in tags.items():
            self.tracking.set_tag(run_id, RunTag(key, value))


class Request:
    """What the gate knows about one request: method, path under the prefix, parameters, body."""

    def __init__(self, scope: dict, prefix: str, body: bytes):
        self.scope = scope
        self.method = scope["method"]
        self.path = scope["path"][len(prefix):] or "/"
        self.raw_path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        self.query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        self.body = body
        self.json_body: dict | None = None
        # Whether MLflow, parsing `body` as it came, reads exactly `json_body` (see `rewrite`).
        self._body_is_params = False
        # MLflow reads GET parameters from the query string when there is one, else (as for every other
        # method) from the JSON body; the gate checks exactly what MLflow will read.
        self.uses_query = self.method == "GET" and bool(self.query)

    def params(self) -> dict:
        if self.uses_query:
            return {k: v[0] for k, v in self.query.items()}
        if self.json_body is None:
            if len(self.body) > MAX_JSON_BYTES:
                raise Refused(413, f"request body over {MAX_JSON_BYTES} bytes")
            try:
                value = json.loads(self.body) if self.body.strip() else {}
                # MLflow parses the body with the same `json.loads` (Flask's `get_json`): one JSON object as sent
                # reads the same there; anything else is forwarded re-encoded.
                self._body_is_params = isinstance(value, dict) and bool(self.body.strip())
                if isinstance(value, str):  # MLflow accepts double-encoded JSON from old clients
                    value = json.loads(value)
            except (ValueError, UnicodeDecodeError):
                raise Refused(400, "the request body must be a JSON object") from None
            if not isinstance(value, dict):
                raise Refused(400, "the request body must be a JSON object")
            self.json_body = value
        return self.json_body

    def set_param(self, name: str, value) -> None:
        """Change a JSON parameter; MLflow then gets the parameters re-encoded, with this one."""
        self.params()[name] = value
        self._body_is_params = False

    def drop_param(self, name: str) -> None:
        """Leave a JSON parameter out of what MLflow gets (re-encoded without it)."""
        if name in self.params():
            del self.params()[name]
            self._body_is_params = False

    def forget_params(self) -> None:
        """Parse the body again at the next `params()`: a decision started over begins from the request as sent."""
        self.json_body, self._body_is_params = None, False

    def list_param(self, name: str) -> list:
        if self.uses_query:
            return self.query.get(name, [])
        value = self.params().get(name, [])
        if not isinstance(value, list):
            raise Refused(400, f"{name} must be a list")
        return value

    def rewrite(self) -> None:
        """Forward exactly the parameters that were checked: the body as sent where MLflow reads the same object from
        it, else re-encoded as one JSON object (a parameter the gate set, a double-encoded or empty body)."""
        if not self.uses_query and self.json_body is not None and not self._body_is_params:
            self.body = json.dumps(self.json_body).encode()


class Decision:
    """What to do after the checks: forward, maybe filter the JSON answer, maybe act after success."""

    def __init__(self):
        self.filter = None  # callable(dict) -> dict
        self.after = None  # callable(dict) -> None, on a 200 answer
        self.answer = None  # dict: the gate answers itself, MLflow never sees the request
        self.page = None  # callable(bytes) -> bytes, for the UI's HTML page


def _now_ms() -> int:
    return int(periods.utcnow().timestamp() * 1000)


def _id_of(params: dict, *names: str):
    for name in names:
        if params.get(name) not in (None, ""):
            return params[name]
    raise Refused(400, f"missing parameter {' or '.join(names)}")


def _tags_param(params: dict, name: str = "tags") -> list[dict]:
    tags = params.get(name) or []
    if not isinstance(tags, list) or not all(isinstance(t, dict) for t in tags):
        raise Refused(400, f"{name} must be a list of {{key, value}} objects")
    return tags


class Gate:
    """The checks, given a viewer and the stores; `decide` raises `Refused` or returns a `Decision`."""

    def __init__(self, stores: Stores, policy_dir: str, ledger_url: str, hub_home: str = "/hub/home"):
        self.stores = stores
        self.policy_dir = policy_dir
        self.ledger_url = ledger_url
        self.page = ui_page(hub_home)
        self._ledger = None
        self._policy, self._policy_checked = None, 0.0

    @property
    def policy(self):
        from gpupool.policies.reload import current_policy

        # Looking at the files is a directory listing and stats; on the event loop each of those system calls let a
        # busy worker thread take the interpreter, which cost 0.4-0.5 ms a request in the running service (measured).
        now = time.monotonic()
        if self._policy is None or now - self._policy_checked >= POLICY_RECHECK_SECONDS:
            self._policy, self._policy_checked = current_policy(self.policy_dir, log), now
        return self._policy

    @property
    def ledger(self):
        if self._ledger is None:
            from gpupool.hub.accounting.ledger import Ledger

            self._ledger = Ledger(self.ledger_url, migrate=False)
        return self._ledger

    def need(self, viewer: Viewer, team: str | None, what: str) -> None:
        # Another team's object answers 404, as a missing one does: its existence does not leak either.
        if not viewer.member_of(team):
            raise Refused(404, f"no {what} that you may see")

    def decide(self, viewer: Viewer, request: Request) -> Decision:
        rule, args = route_of(request.method, request.path)
        decision = Decision()
        kind, _, action = rule.partition(":")
        if rule in ("ui", "any"):
            if request.path == "/":
                decision.page = self.page
            return decision
        if kind == "answer":
            decision.answer = answer(action, viewer)
            return decision
        if rule == "graphql":
            self.check_graphql(viewer, request)
            return decision
        if kind == "artifacts":
            self.check_artifact_path(viewer, request, args)
            return decision
        params = request.params()
        s = self.stores
        if rule == "experiment:create":
            self.create_owned(viewer, request, "experiment")
            team = next(t["value"] for t in params["tags"] if t.get("key") == TEAM_TAG)
            location = params.get("artifact_location") or f"mlflow-artifacts:/{team}/{uuid.uuid4().hex}"
            request.set_param("artifact_location", check_location(location, team))
        elif rule == "model:create":
            self.create_owned(viewer, request, "registered model")
        elif rule == "experiment:search":
            decision.filter = lambda body: self.filter_list(viewer, body, "experiments")
        elif rule == "model:search":
            decision.filter = lambda body: self.filter_list(viewer, body, "registered_models")
        elif rule == "version:search":
            decision.filter = lambda body: self.filter_versions(viewer, body)
        elif rule == "experiment:by-name":
            decision.filter = lambda body: self.filter_one(viewer, body)
        elif kind == "experiment":
            experiment_id = _id_of(params, "experiment_id")
            self.need(viewer, s.experiment_team(experiment_id), "such experiment")
            if params.get("new_name") is not None:  # a rename may not take another team's name either
                team_for_new(viewer, params["new_name"], None, list(self.policy.teams))
            if action == "write" and "tags" in params:  # a new logged model: tagged by the run-context plugin too
                request.set_param("tags", self.context_tags(viewer, _tags_param(params)))
            if action == "write-tag":
                self.reserved_key(viewer, params.get("key"))
                if params.get("key") == TEAM_TAG:  # an admin moved it to another team
                    decision.after = lambda body: s.forget_experiment(experiment_id)
        elif rule == "experiments:read":
            ids = request.list_param("experiment_ids")
            if not ids:
                raise Refused(400, "experiment_ids must name at least one experiment of your team")
            for experiment_id in ids:
                self.need(viewer, s.experiment_team(experiment_id), "such experiment")
        elif rule == "run:create":
            self.need(viewer, s.experiment_team(_id_of(params, "experiment_id")), "such experiment")
            # The run's author is the caller, whatever the client says (MLflow's client sends the local
            # login, which in a server may be anyone's): MLflow's user_id and its `mlflow.user` tag too.
            request.set_param("tags", self.context_tags(viewer, _tags_param(params)))
            request.set_param("user_id", viewer.name)
            # A run's window prices it (`tag_cost`): its start and end are the server's clock, not the client's.
            request.set_param("start_time", _now_ms())
        elif kind == "run":
            run_id = _id_of(params, "run_id", "run_uuid")
            self.need(viewer, s.run_team(run_id), "such run")
            if action == "write-tag":
                self.reserved_key(viewer, params.get("key"), admins=False)
            elif action == "write-batch":
                for tag in _tags_param(params):
                    self.reserved_key(viewer, tag.get("key"), admins=False)
            elif action == "update":
                if "user_id" in params:
                    raise Refused(400, "a run's user_id is its author, set by gpupool when the run is created; "
                                       "runs/update accepts run_id, status, end_time and run_name")
                # The end is the server's clock when the run ends (a client's end_time is left out: it would
                # choose the window its cost is priced over); a run that had ended keeps its end.
                request.drop_param("end_time")
                if params.get("status") in TERMINAL_STATUSES and s.run(run_id).info.status not in TERMINAL_STATUSES:
                    request.set_param("end_time", _now_ms())
                    decision.after = lambda body: self.tag_cost(str(run_id))
        elif rule == "runs:read":
            ids = request.list_param("run_ids")
            if not ids:
                raise Refused(400, "run_ids must name at least one run")
            for run_id in ids:
                self.need(viewer, s.run_team(run_id), "such run")
        elif kind == "logged-model":
            self.need(viewer, s.logged_model_team(args[0]), "such logged model")
            self.reserved_tags(viewer, request, args[1:])
        elif rule == "model:rename":
            team = s.model_team(params.get("name"))
            self.need(viewer, team, "such registered model")
            # The new name follows the same rule, with the model's own team: a rename does not move it.
            team_for_model(viewer, params.get("new_name"), team, list(self.policy.teams))
        elif kind == "model":
            self.need(viewer, s.model_team(params.get("name")), "such registered model")
            if action == "write-tag":
                self.reserved_key(viewer, params.get("key"))
        elif kind == "alias":
            name, alias = params.get("name"), params.get("alias")
            team = s.model_team(name)
            self.need(viewer, team, "such registered model")
            check_alias(viewer, team, alias)
            previous = s.alias_version(name, alias)
            if action == "set":
                decision.after = lambda body: self.record_alias(viewer, name, alias, str(params.get("version")),
                                                                previous)
            elif previous is not None:
                decision.after = lambda body: self.record_alias(viewer, name, alias, None, previous)
        elif rule == "version:create":
            self.check_new_version(viewer, params)
            decision.after = self.tag_version_cost
        else:  # a rule in ROUTES without a check here: closed, never open by accident
            raise Refused(403, f"{request.method} {request.path} is not allowed")
        request.rewrite()
        return decision

    # --- the checks -----------------------------------------------------------------------------------

    def reserved_key(self, viewer: Viewer, key: object, allowed=frozenset(), admins: bool = True) -> None:
        """Refuse a client's write of a tag gpupool writes; `admins`: whether admins may (they move an experiment
        or a model to another team by its tag; a run's tags are facts about it, for nobody to set)."""
        if not isinstance(key, str):
            raise Refused(400, "a tag needs a string key")
        if key == AUTHOR_TAG:  # for admins too: who ran a run is a fact, not a setting
            raise Refused(403, f"{AUTHOR_TAG!r} is the run's author, set by gpupool to the user who created the "
                               "run; it cannot be set or removed")
        if key.startswith(SERVER_TAG_PREFIX) and key not in allowed and not (admins and viewer.admin):
            raise Refused(403, f"{key} is set by the platform: tags starting with {SERVER_TAG_PREFIX!r} are "
                               "written by gpupool itself (ownership, what a run ran on, alias history, cost) and "
                               "cannot be set or removed")

    def context_tags(self, viewer: Viewer, tags: list[dict]) -> list[dict]:
        """The tags of a new run or logged model: the client's own, what it ran on (`run_context`: the platform's
        facts, checked against what the client sent), and who made it (the caller). Any other `gpupool.` tag: 403."""
        sent = {}
        kept = []
        for tag in tags:
            key = tag.get("key")
            if key in ("gpupool.user", AUTHOR_TAG):
                continue
            if key in RUN_CONTEXT_TAGS:
                if key in sent:
                    raise Refused(400, f"at most one {key} tag")
                sent[key] = tag.get("value")
            else:
                self.reserved_key(viewer, key, admins=False)
                kept.append(tag)
        facts, source = self.run_facts(viewer, sent.get("gpupool.job"))
        context = run_context(viewer, sent, facts, source, self.policy) if sent else dict(facts or {})
        return (kept + [{"key": key, "value": value} for key, value in context.items()]
                + [{"key": "gpupool.user", "value": viewer.name}, {"key": AUTHOR_TAG, "value": viewer.name}])

    def reserved_tags(self, viewer: Viewer, request: Request, keys: tuple[str, ...] = ()) -> None:
        """The `tags` of a request, and tag keys in its path, checked by `reserved_key`."""
        for key in keys:
            self.reserved_key(viewer, key)
        if request.method != "GET":
            for tag in _tags_param(request.params()):
                self.reserved_key(viewer, tag.get("key"))

    def run_facts(self, viewer: Viewer, job_id: object) -> tuple[dict[str, str] | None, str]:
        """What the ledger knows about where a new run of `viewer`'s comes from, and its name (`run_context`).

        A server's own token names its server (`Viewer.servers`): its open ledger interval says the team, profile,
        card model and share (none: it holds no GPU). Other tokens (a job's token is a plain token of its user)
        name nothing; a `gpupool.job` sent by the client is accepted when it is a job of the caller's that has not
        ended, whose record says the rest. A caller can so claim only a job of their own that runs now.
        """
        if len(viewer.servers) == 1:
            server = viewer.servers[0]
            source = f"server {viewer.name}/{server}"
            self.stores.may_read()
            now = periods.utcnow()
            for interval in self.ledger.intervals_overlapping(now, now + timedelta(seconds=1), user=viewer.name):
                if interval.is_open and interval.kind == "server" and run_server(interval.run or "") == server:
                    return {"gpupool.team": interval.team, "gpupool.profile": interval.profile,
                            "gpupool.gpu_model": interval.model, "gpupool.share": str(interval.share)}, source
            return {"gpupool.share": "0"}, source  # every share a server holds is in the ledger
        if job_id is None:
            return None, "this token"
        from gpupool.hub.accounting.jobs import JobStore
        from gpupool.policies.resources import profile_share

        self.stores.may_read()
        job = JobStore(self.ledger.engine).get(job_id) if isinstance(job_id, str) else None
        if job is None or job.user != viewer.name or job.ended:
            raise Refused(403, f"gpupool.job is set by the platform: {job_id!r} is no running training job of "
                               f"{viewer.name}'s")
        facts = {"gpupool.job": job.id, "gpupool.team": job.team, "gpupool.profile": job.profile}
        profile = self.policy.profiles.get(job.profile)
        if profile is not None:
            facts["gpupool.share"] = str(profile_share(profile, self.policy))
            if profile.gpu is not None:
                facts["gpupool.gpu_model"] = profile.gpu.model
        return facts, f"job {job.id}"

    def create_owned(self, viewer: Viewer, request: Request, what: str) -> None:
        params = request.params()
        tags = _tags_param(params)
        requested = [t.get("value") for t in tags if t.get("key") == TEAM_TAG]
        if len(requested) > 1 or (requested and not isinstance(requested[0], str)):
            raise Refused(400, f"at most one {TEAM_TAG} tag, naming one of your teams")
        for tag in tags:
            self.reserved_key(viewer, tag.get("key"), allowed={TEAM_TAG})
        pick = team_for_model if what == "registered model" else team_for_new
        team = pick(viewer, params.get("name"), requested[0] if requested else None, list(self.policy.teams))
        request.set_param("tags", [t for t in tags if t.get("key") != TEAM_TAG] + [{"key": TEAM_TAG, "value": team}])

    def check_new_version(self, viewer: Viewer, params: dict) -> None:
        s = self.stores
        team = s.model_team(params.get("name"))
        self.need(viewer, team, "such registered model")
        source = params.get("source")
        if isinstance(source, str) and source.startswith("runs:/"):
            run_id, _, path = source[len("runs:/"):].partition("/")
            relative_segments(path)
            if s.run_team(run_id) != team:
                raise Refused(400, f"source {source!r} is a run outside team {team!r}")
        elif isinstance(source, str) and source.startswith("models:/"):
            model_id = source[len("models:/"):]
            if s.logged_model_team(model_id) != team:
                raise Refused(400, f"source {source!r} is a logged model outside team {team!r}")
        else:
            try:
                check_location(source, team)
            except Refused as error:
                raise Refused(400, f"model version source refused: {error.message}; or runs:/<run id>/<path> or "
                                   f"models:/<model id> of team {team!r}") from None
        if params.get("run_id") and s.run_team(params["run_id"]) != team:
            raise Refused(400, f"run_id {params['run_id']!r} is not a run of team {team!r}")
        if params.get("model_id") and s.logged_model_team(params["model_id"]) != team:
            raise Refused(400, f"model_id {params['model_id']!r} is not a logged model of team {team!r}")
        for tag in _tags_param(params):  # the cost a version carries is its run's, never the client's
            self.reserved_key(viewer, tag.get("key"))

    def check_artifact_path(self, viewer: Viewer, request: Request, args: tuple[str, ...]) -> None:
        lowered = request.raw_path.lower()
        if any(code in lowered for code in ("%2f", "%5c", "%2e", "%25", "%00")):
            raise Refused(400, "artifact paths may not encode '/', '\\', '.', '%' or NUL")
        path = args[0] if args else request.query.get("path", [""])[0]
        segments = relative_segments(path) if path else []
        if not segments:
            if viewer.admin:
                return
            raise Refused(403, f"list artifacts under your team's folder (path=<team>/…; yours: "
                               f"{', '.join(viewer.teams) or 'none'})")
        if not viewer.member_of(segments[0]):
            raise Refused(403, f"artifacts under {segments[0]!r} belong to another team (yours: "
                               f"{', '.join(viewer.teams) or 'none'})")

    def check_graphql(self, viewer: Viewer, request: Request) -> None:
        from graphql import FieldNode, OperationDefinitionNode, OperationType, GraphQLError, parse
        from graphql.utilities import value_from_ast_untyped

        params = request.params()
        query, variables = params.get("query"), params.get("variables") or {}
        if isinstance(variables, str):
            try:
                variables = json.loads(variables)
            except ValueError:
                raise Refused(400, "GraphQL variables must be a JSON object") from None
        if not isinstance(query, str) or not isinstance(variables, dict):
            raise Refused(400, "a GraphQL request needs a query string and optional variables object")
        try:
            document = parse(query)
        except GraphQLError as error:
            raise Refused(400, f"GraphQL syntax error: {error.message}") from None
        for definition in document.definitions:
            if not isinstance(definition, OperationDefinitionNode) or definition.operation != OperationType.QUERY:
                raise Refused(403, "only GraphQL queries without fragments are accepted")
            for field in definition.selection_set.selections:
                if not isinstance(field, FieldNode):
                    raise Refused(403, "only GraphQL queries without fragments are accepted")
                name = field.name.value
                if name in ("__typename", "__schema", "__type"):  # the schema is no team's secret
                    continue
                if name not in GRAPHQL_FIELDS:
                    raise Refused(403, f"GraphQL field {name!r} is not available (accepted: "
                                       f"{', '.join(GRAPHQL_FIELDS)})")
                argument, kind = GRAPHQL_FIELDS[name]
                inputs = {a.name.value: value_from_ast_untyped(a.value, variables) for a in field.arguments}
                value = (inputs.get("input") or {}).get(argument) if isinstance(inputs.get("input"), dict) else None
                if name == "mlflowListArtifacts" and value is None:
                    value = (inputs.get("input") or {}).get("runUuid")
                values = value if isinstance(value, list) else [value]
                if not values or any(v is None for v in values):
                    raise Refused(400, f"GraphQL {name} needs input.{argument}")
                for v in values:
                    if kind.startswith("experiment"):
                        self.need(viewer, self.stores.experiment_team(v), "such experiment")
                    else:
                        self.need(viewer, self.stores.run_team(v), "such run")

    # --- answers filtered, actions after success ------------------------------------------------------

    def filter_list(self, viewer: Viewer, body: dict, key: str) -> dict:
        if not viewer.admin:
            body[key] = [o for o in body.get(key, []) if viewer.member_of(_tag(o, TEAM_TAG))]
        return body

    def filter_one(self, viewer: Viewer, body: dict) -> dict:
        if not viewer.member_of(_tag(body.get("experiment", {}), TEAM_TAG)):
            raise Refused(404, "no such experiment that you may see")
        return body

    def filter_versions(self, viewer: Viewer, body: dict) -> dict:
        if viewer.admin:
            return body
        teams: dict[str, str | None] = {}
        kept = []
        for version in body.get("model_versions", []):
            name = version.get("name")
            if name not in teams:
                try:
                    teams[name] = self.stores.model_team(name)
                except Refused:
                    teams[name] = None
            if viewer.member_of(teams[name]):
                kept.append(version)
        body["model_versions"] = kept
        return body

    def record_alias(self, viewer: Viewer, name: str, alias: str, version: str | None, previous: str | None):
        """Alias history as model-version tags, shown on the version's page in the MLflow UI."""
        now = _iso(periods.utcnow())
        if version is not None:
            self.stores.set_version_tags(name, version, {
                f"gpupool.alias.{alias}.set_by": viewer.name,
                f"gpupool.alias.{alias}.set_at": now,
                f"gpupool.alias.{alias}.previous_version": previous or "none",
            })
        if previous is not None and previous != version:
            self.stores.set_version_tags(name, previous, {
                f"gpupool.alias.{alias}.removed_by": viewer.name,
                f"gpupool.alias.{alias}.removed_at": now,
                f"gpupool.alias.{alias}.next_version": version or "none",
            })

    def tag_version_cost(self, body: dict) -> None:
        """A new model version made from a run carries what that run cost (its cost tags, once it has ended),
        so the registry says what each version took to train."""
        version = body.get("model_version") or {}
        run_id = version.get("run_id")
        if not run_id or not version.get("name") or not version.get("version"):
            return
        tags = self.stores.tracking.get_run(run_id).data.tags
        cost = {key: tags[key] for key in COST_TAGS if key in tags}
        if cost:
            self.stores.set_version_tags(version["name"], str(version["version"]), cost)

    def tag_cost(self, run_id: str) -> None:
        """The GPU-hours and cost of a run that ended, from the ledger over the run's time window."""
        run = self.stores.tracking.get_run(run_id)
        tags = run.data.tags
        user = tags.get("gpupool.user") or run.info.user_id
        team = tags.get("gpupool.team") or self.stores.experiment_team(run.info.experiment_id)
        start = datetime.fromtimestamp(run.info.start_time / 1000, timezone.utc)
        end = datetime.fromtimestamp((run.info.end_time or int(periods.utcnow().timestamp() * 1000)) / 1000, timezone.utc)
        if not user or not team:
            return
        intervals = self.ledger.intervals_overlapping(start, end, user=user, team=team)
        job = tags.get("gpupool.job")
        if job:  # made inside a training job: that job's runs only, not a server its user had open meanwhile
            intervals = [i for i in intervals if i.kind == "job" and i.key.startswith(f"{JOB_RUN_PREFIX}{job}@")]
        cost = run_cost(self.policy, intervals, start, end, tags.get("gpupool.profile"))
        self.stores.set_run_tags(run_id, cost.tags())


#: The UI's own first-visit flags (its localStorage keys), set on the first page unless the user has them: MLflow's
#: assistant panel opens by itself on a first visit from localhost (where a one-machine hub is often opened) but
#: runs a coding agent on the server's host, which gpupool leaves without providers; the UI's telemetry notice
#: and switch concern telemetry that is off on a private platform; the model registry's first visit opens a
#: promotion of its own new page over the list.
_UI_FLAGS = (("mlflow.assistant.fab.autoOpenedOnFirstLoad_v1", "true"),
             ("mlflow.telemetry.info.alert.dismissed_v1", "true"),
             ("mlflow.settings.telemetry.enabled_v1", "false"),
             ("_mlflow_model_registry_promo_modal_dismissed_v1", "true"))
#: MLflow 3's UI opens in its GenAI mode (traces, prompts, the MCP registry, the AI gateway), all routes gpupool
#: refuses; its "Model training" mode shows what gpupool serves: experiments, runs and the model registry. The mode
#: is the UI's own setting (this localStorage key; MLflow has no server setting for it), set on every visit.
_UI_MODE = ("mlflow.workflowType_v1", json.dumps("machine_learning"))
#: What stays hidden: the mode switch, Home (MLflow's GenAI landing page: its "Start Demo" generates traces and
#: prompts), Settings (LLM connections, webhooks), an experiment's traces and the assistant (its button and
#: panel). The logo, which leads Home, leads nowhere.
_UI_HIDDEN = ('aside>div[tooltip-data-state]:has(>div[role="button"]),aside li:has(>a[href="#/"]),'
              'aside li:has(>a[href^="#/settings"]),aside li:has(>a[href*="/traces"]),aside a[href*="/traces"],'
              '[data-assistant-ui],[data-component-id^="mlflow.assistant."],[data-component-id^="mlflow.home."]'
              '{display:none!important}aside a[href="#/"]{pointer-events:none}')
#: Home, opened by its address or the back button, shows the experiments instead. An address that asks for the
#: GenAI mode (`?workflowType=genai`: the UI reads it from the route's query, stores it as its mode and opens an
#: experiment on its traces' overview; a shared link may carry it) opens without it, in the "Model training"
#: mode: before the UI starts, the address is rewritten; once it runs (the same page, another address), the
#: change is kept from the UI's router (this listener is the first, in the capture phase) and the page loaded
#: again, so that the mode set above is the one it reads.
_UI_HOME_SCRIPT = ('(function(){function go(e){var h=location.hash;'
                   'if(h===""||h==="#"||h==="#/"||h.slice(0,3)==="#/?"){location.replace("#/experiments");return}'
                   'if(!/[?&]workflowType=genai(&|$)/i.test(h))return;'
                   'var to=h.replace(/([?&])workflowType=genai(&|$)/i,function(m,a,b){return b?a:""});'
                   'if(!e){location.replace(to);return}'
                   'e.stopImmediatePropagation();history.replaceState(null,"",to);location.reload()}'
                   'go();addEventListener("popstate",go,true);addEventListener("hashchange",go,true)})();')
#: The way back to the hub: a link after the sidebar's Model registry, styled as its neighbours (put back whenever
#: the UI redraws its sidebar).
_UI_HUB_LINK_SCRIPT = (
    'addEventListener("DOMContentLoaded",function(){function add(){var ul=document.querySelector("aside nav ul");'
    'if(!ul||document.getElementById("gpupool-hub-link"))return;var like=ul.querySelector("a:not([aria-current])"),'
    'icon=like&&like.querySelector("span[role=img]"),li=document.createElement("li"),a=document.createElement("a");'
    'a.id="gpupool-hub-link";a.href=GPUPOOL_HUB_HOME;a.title="Back to the hub: servers, jobs, usage";'
    'if(like)a.className=like.className;'
    'a.innerHTML=\'<span role="img" aria-hidden="true"><svg width="1em" height="1em" viewBox="0 0 16 16" '
    'fill="currentColor"><path d="M7.78 3.22 8.84 4.28 5.87 7.25H14v1.5H5.87l2.97 2.97-1.06 1.06L2.94 8z"/></svg>'
    '</span>Hub home\';if(icon)a.firstChild.className=icon.className;li.appendChild(a);ul.appendChild(li)}'
    'new MutationObserver(add).observe(document.body,{childList:true,subtree:true});add()});')


def ui_page(hub_home: str):
    """What the gpupool app does to MLflow's index.html: the snippets above, at the start of its head (before
    MLflow's scripts read the flags), with `hub_home` the hub's home page."""
    snippet = ("<style>" + _UI_HIDDEN + "</style><script>try{"
               + json.dumps([list(f) for f in _UI_FLAGS]) + ".forEach(function(f){"
               "localStorage.getItem(f[0])===null&&localStorage.setItem(f[0],f[1])});"
               f"localStorage.setItem({json.dumps(_UI_MODE[0])},{json.dumps(_UI_MODE[1])})}}catch(e){{}}"
               + _UI_HOME_SCRIPT + "var GPUPOOL_HUB_HOME=" + json.dumps(hub_home).replace("<", "\\u003c") + ";"
               + _UI_HUB_LINK_SCRIPT + "</script>").encode()

    def page(html: bytes) -> bytes:
        return html.replace(b"<head>", b"<head>" + snippet, 1)

    return page


def _tag(obj: dict, key: str) -> str | None:
    tags = obj.get("tags") or []
    if isinstance(tags, dict):
        return tags.get(key)
    return next((t.get("value") for t in tags if isinstance(t, dict) and t.get("key") == key), None)


class HubGate:
    """The ASGI app: authentication (HubOAuth cookie or bearer token), body limit, then `Gate`, then MLflow."""

    def __init__(self, app, gate: Gate, auth, prefix: str):
        self.app, self.gate, self.auth, self.prefix = app, gate, auth, prefix.rstrip("/")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path == self.prefix:
            return await _redirect(send, self.prefix + "/")
        if not path.startswith(self.prefix + "/"):
            return await _refuse(send, Refused(404, f"MLflow is served under {self.prefix}/"))
        relative = path[len(self.prefix):]
        if relative == "/health":
            return await _health(send)
        if relative == "/oauth_callback":
            return await self.oauth_callback(scope, send)
        try:
            body = await _read_body(scope, receive)
            request = Request(scope, self.prefix, body)
            user = await self.identify(request)
            if user is None:
                if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
                    return await self.login_redirect(scope, send)
                raise Refused(401, "log in through JupyterHub: send `Authorization: Bearer <JupyterHub token>` "
                                   "(MLFLOW_TRACKING_TOKEN in a gpupool server) or open the page in a browser")
            viewer = viewer_of(user, self.gate.policy)
            decision = await self.decide(viewer, request)
        except Refused as refused:
            return await _refuse(send, refused)
        await self.forward(scope, request, decision, send)

    async def decide(self, viewer: Viewer, request: Request) -> Decision:
        # Most calls are decided from remembered owners in microseconds: here, on the event loop, where handing each
        # to a worker thread cost more than the checks (0.2-0.4 ms a request, measured in the running service). One
        # that must read the database is decided again, from the start and the request as sent, in a worker thread.
        # A large body (its JSON or GraphQL parsed) goes to the thread too: it would hold up every other request.
        if len(request.body) <= LOOP_DECISION_BYTES:
            try:
                with self.gate.stores.remembered_only():
                    return self.gate.decide(viewer, request)
            except NeedsDatabase:
                request.forget_params()
        return await anyio.to_thread.run_sync(self.gate.decide, viewer, request)

    async def identify(self, request: Request) -> dict | None:
        header = request.headers.get("authorization", "")
        match = self.auth.auth_header_pat.match(header)
        token = match.group(1) if match else _cookies(request.headers).get(TOKEN_COOKIE)
        if not token:
            return None
        # On this event loop: a cached token (HubAuth remembers each for `cache_max_age`) costs nothing, where
        # the blocking form hands every call to HubAuth's own thread and waits for it.
        user = await self.auth.user_for_token(token, sync=False)
        if user is None:
            return None
        if not self.auth.check_scopes(self.auth.access_scopes, user):
            raise Refused(403, f"this token may not use the MLflow service (it needs "
                               f"{', '.join(sorted(self.auth.access_scopes))})")
        return user

    async def forward(self, scope, request: Request, decision: Decision, send) -> None:
        if decision.answer is not None:
            return await _json(send, 200, decision.answer)
        body = request.body
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        if request.json_body is not None and not request.uses_query:
            headers = [(k, v) for k, v in headers if k.lower() != b"content-type"]
            headers.append((b"content-type", b"application/json"))
        inner_scope = dict(scope, headers=headers)
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        if decision.filter is None and decision.after is None and decision.page is None:
            return await self.app(inner_scope, replay, send)
        start, chunks = {}, []

        async def capture(message):
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(inner_scope, replay, capture)
        answer = b"".join(chunks)
        if decision.page is not None:
            if start.get("status") == 200 and not dict(start.get("headers", [])).get(b"content-encoding"):
                answer = decision.page(answer)
        elif start.get("status") == 200:
            try:
                data = json.loads(answer) if answer else {}
                if decision.filter is not None:
                    data = await anyio.to_thread.run_sync(decision.filter, data)
                    answer = json.dumps(data).encode()
                if decision.after is not None:
                    await anyio.to_thread.run_sync(decision.after, data)
            except Refused as refused:
                return await _refuse(send, refused)
            except Exception:  # the MLflow write happened; a failed follow-up must not turn it into an error
                log.exception("after %s %s", request.method, request.path)
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(answer)).encode()))
        await send({"type": "http.response.start", "status": start.get("status", 500), "headers": headers})
        await send({"type": "http.response.body", "body": answer})

    async def login_redirect(self, scope, send) -> None:
        state = secrets.token_urlsafe(16)
        query = scope.get("query_string", b"").decode("latin-1")
        next_url = scope["path"] + ("?" + query if query else "")
        value = base64.urlsafe_b64encode(json.dumps({"state": state, "next": next_url}).encode()).decode()
        cookie = f"{STATE_COOKIE}={value}; Path={self.prefix}/; HttpOnly; SameSite=Lax; Max-Age=600"
        await _redirect(send, self.auth.login_url + "&" + urlencode({"state": state}), [cookie])

    async def oauth_callback(self, scope, send) -> None:
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        try:
            saved = json.loads(base64.urlsafe_b64decode(_cookies(headers).get(STATE_COOKIE, "").encode()))
        except ValueError:
            saved = {}
        code, state = query.get("code", [None])[0], query.get("state", [None])[0]
        if not code or not state or not isinstance(saved, dict) or saved.get("state") != state:
            return await _refuse(send, Refused(400, "OAuth state does not match this browser's login; open "
                                                    f"{self.prefix}/ again"))
        try:
            token = await anyio.to_thread.run_sync(self.auth.token_for_code, code)
        except Exception:
            log.exception("OAuth code exchange failed")
            return await _refuse(send, Refused(403, f"the hub refused the login; open {self.prefix}/ again"))
        next_url = saved.get("next") or self.prefix + "/"
        if not isinstance(next_url, str) or not next_url.startswith(self.prefix + "/") or "//" in next_url:
            next_url = self.prefix + "/"
        secure = "; Secure" if headers.get("x-forwarded-proto") == "https" else ""
        cookies = [f"{TOKEN_COOKIE}={token}; Path={self.prefix}/; HttpOnly; SameSite=Lax{secure}",
                   f"{STATE_COOKIE}=; Path={self.prefix}/; Max-Age=0"]
        await _redirect(send, next_url, cookies)


def _cookies(headers: dict) -> dict[str, str]:
    jar = SimpleCookie()
    try:
        jar.load(headers.get("cookie", ""))
    except Exception:
        return {}
    return {k: m.value for k, m in jar.items()}


async def _read_body(scope, receive) -> bytes:
    length = dict(scope.get("headers", [])).get(b"content-length")
    if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise Refused(413, f"request body over {MAX_BODY_BYTES} bytes")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise Refused(413, f"request body over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
        if not message.get("more_body"):
            break
    return b"".join(chunks)


#: When this process started: the health answer tells a service that a restarted hub started from a stale one.
STARTED = datetime.fromtimestamp(psutil.Process().create_time(), timezone.utc).isoformat()


async def _health(send) -> None:
    from mlflow.version import VERSION

    from gpupool.hub import __version__

    body = json.dumps({"status": "ok", "version": __version__, "mlflow": VERSION, "started": STARTED}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _refuse(send, refused: Refused) -> None:
    await _json(send, refused.status, {"error_code": refused.error_code, "message": refused.message})


async def _json(send, status: int, value: dict) -> None:
    body = json.dumps(value).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _redirect(send, location: str, cookies: list[str] = ()) -> None:
    headers = [(b"location", quote(location, safe=":/?&=%#@+,;~").encode()), (b"content-length", b"0")]
    headers += [(b"set-cookie", c.encode()) for c in cookies]
    await send({"type": "http.response.start", "status": 302, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


def create_app():
    """The `mlflow.app` entry point `gpupool`: MLflow's own ASGI app behind the hub login and team checks."""
    # MLflow's own switch for its AI gateway (routes gpupool refuses): off, so that its UI leaves it out too.
    os.environ["MLFLOW_ENABLE_AI_GATEWAY"] = "false"
    from jupyterhub.services.auth import HubOAuth
    from mlflow.server.fastapi_app import app as mlflow_app

    from gpupool.policies import DEFAULT_POLICY_DIR, defaults
    from gpupool.spawner.wiring import MLFLOW_PREFIX

    prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", MLFLOW_PREFIX)
    # Group changes reach MLflow within a minute.
    auth = HubOAuth(api_token=os.environ["JUPYTERHUB_API_TOKEN"], cache_max_age=60)
    gate = Gate(Stores(), os.environ.get("GPUPOOL_POLICIES", str(DEFAULT_POLICY_DIR)),
                os.environ.get("GPUPOOL_LEDGER_URL") or defaults.ledger_url(defaults.state_dir()),
                auth.hub_prefix + "home")
    return HubGate(mlflow_app, gate, auth, prefix)
