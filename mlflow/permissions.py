"""Team permissions of the MLflow service, pure: who a caller is, which routes exist, where artifacts may live.

No I/O here: `mlflow/auth.py` looks objects up and applies these decisions. Every MLflow route that is not in
`ROUTES` is refused, so a route a new MLflow release adds stays closed until someone decides about it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

#: The tag that says which team an experiment or a registered model belongs to.
TEAM_TAG = "gpupool.team"
#: MLflow's tag for who ran a run (its UI's "User" column); gpupool sets it, with `user_id`, to the caller.
AUTHOR_TAG = "mlflow.user"
#: Tags only gpupool writes (ownership, alias history, run context and cost); clients setting them are refused.
SERVER_TAG_PREFIX = "gpupool."
#: What a run ran on: the platform's facts about the server or training job a run comes from, written by the server
#: when the run is created (the run-context plugin sends the same values, which are checked, never trusted).
RUN_CONTEXT_TAGS = ("gpupool.team", "gpupool.profile", "gpupool.gpu_model", "gpupool.share", "gpupool.job")
#: A server's own token carries this scope for its server only (`Spawner.server_token_scopes`: `!server`).
SERVER_SCOPE = "access:servers!server="
#: Aliases only a team's reviewers (policy `teams.<t>.reviewers`) and admins may set or remove.
REVIEWED_ALIASES = frozenset({"production"})
#: Every artifact of team T lives under this URI prefix + T.
ARTIFACT_SCHEME = "mlflow-artifacts:"
_SEGMENT = re.compile(r"[^\x00-\x1f\x7f/\\?#%]+")


class Refused(Exception):
    """A request refused: an HTTP status, MLflow's error code and a message naming what is accepted."""

    CODES = {400: "INVALID_PARAMETER_VALUE", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
             404: "RESOURCE_DOES_NOT_EXIST", 413: "REQUEST_LIMIT_EXCEEDED"}

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message

    @property
    def error_code(self) -> str:
        return self.CODES.get(self.status, "PERMISSION_DENIED")


@dataclass(frozen=True)
class Viewer:
    """The caller: a hub user, with their teams in policy order and the teams they review for."""

    name: str
    admin: bool
    teams: tuple[str, ...]
    reviews: frozenset[str]
    #: The caller's servers this token belongs to: one for a server's own token, none for a personal token.
    servers: tuple[str, ...] = ()

    def member_of(self, team: str | None) -> bool:
        return self.admin or (team is not None and team in self.teams)

    def may_review(self, team: str | None) -> bool:
        return self.admin or (team is not None and team in self.reviews and team in self.teams)


def viewer_of(user: dict, policy) -> Viewer:
    """A `Viewer` from a hub user model (name, admin, groups) and the policies (members, reviewers)."""
    name = user["name"]
    teams = tuple(policy.teams_of(name, user.get("groups") or []))
    reviews = frozenset(t for t, team in policy.teams.items() if name in team.reviewers)
    servers = tuple(sorted(scope[len(SERVER_SCOPE) + len(name) + 1:] for scope in user.get("scopes") or []
                           if scope.startswith(f"{SERVER_SCOPE}{name}/")))
    return Viewer(name, bool(user.get("admin")), teams, reviews, servers)


#: A share as the run-context plugin sends it (`1/4`, `0.25`, `1`): no exponent, whose `1e100000000` would have
#: Fraction build a 100-million-digit number, holding MLflow's one worker for minutes.
_SHARE_TEXT = re.compile(r"\d{1,12}(?:\.\d{1,12})?(?:/\d{1,12})?")


def _same(tag: str, sent: str, platform: str) -> bool:
    if tag != "gpupool.share":
        return sent == platform
    if not _SHARE_TEXT.fullmatch(sent):
        return False
    try:
        return Fraction(sent) == Fraction(platform)
    except (ValueError, ZeroDivisionError):
        return False


def run_context(viewer: Viewer, sent: dict[str, object], facts: dict[str, str] | None, source: str,
                policy) -> dict[str, str]:
    """The run-context tags of a new run: the platform's `facts` about where it runs, and `sent`, what the client
    sent of `RUN_CONTEXT_TAGS` (MLflow's run-context plugin sends the values its server or job was started with).

    `facts` are the ledger's record of the caller's server or job (`source` names it); None where the platform
    cannot tell where the run comes from (a personal token, no job named). A sent value must be the platform's;
    where a server holds no GPU (the ledger records only GPU shares: `facts` without a team), a sent team must be
    one of the caller's and a sent profile one without a GPU. Anything else is refused, naming the tag: the run's
    cost is priced from these tags, so they are never the client's choice.
    """
    context = dict(facts or {})
    for tag, value in sent.items():
        if not isinstance(value, str):
            raise Refused(400, f"the tag {tag!r} needs a string value")
        why = None
        if facts is None:
            why = ("this token is neither a server's nor a job's, so there is nothing to set it from (in a gpupool "
                   "server or job, use its own token: $MLFLOW_TRACKING_TOKEN)")
        elif tag in facts:
            if not _same(tag, value, facts[tag]):
                why = f"this run comes from {source}, whose {tag} is {facts[tag]!r}, not {value!r}"
        elif tag == "gpupool.team" and value in policy.teams and value in viewer.teams:
            context[tag] = value
        elif (tag == "gpupool.profile" and "gpupool.team" not in facts and value in policy.profiles
              and policy.profiles[value].gpu is None):
            context[tag] = value
        else:
            why = f"{source} has no {tag} {value!r}"
        if why is not None:
            raise Refused(403, f"{tag} is set by the platform (tags starting with {SERVER_TAG_PREFIX!r} are "
                               f"gpupool's, never the client's): {why}")
    return context


def team_for_new(viewer: Viewer, name: object, requested: str | None, all_teams) -> str:
    """The team a new experiment or registered model called `name` belongs to.

    A `gpupool.team` tag in the request picks one of the caller's teams; otherwise a name that is a team's
    name or starts with "<team>/" belongs to that team (so nobody can take another team's names); otherwise
    the caller's first team in policy order.
    """
    if requested is not None:
        if requested not in all_teams or not viewer.member_of(requested):
            raise Refused(403, f"you cannot create objects for team {requested!r} "
                               f"(your teams: {', '.join(viewer.teams) or 'none'})")
        return requested
    if isinstance(name, str):
        for team in all_teams:
            if name == team or name.startswith(team + "/"):
                if not viewer.member_of(team):
                    raise Refused(403, f"the name {name!r} belongs to team {team!r}; choose a name that is not "
                                       f"another team's (your teams: {', '.join(viewer.teams) or 'none'})")
                return team
    if not viewer.teams:
        raise Refused(403, f"{viewer.name} is in no team, so cannot create experiments or models; an "
                           "administrator adds people with `gpupool team add-member TEAM USER`")
    return viewer.teams[0]


#: A registered model's name starts with its team's name and this separator: `vision-classifier`. ("/" would
#: read as a version in `models:/NAME/VERSION` URIs.)
MODEL_NAME_SEPARATOR = "-"


def model_name_team(name: object, all_teams) -> str | None:
    """The team a registered model's name belongs to: the longest team name that, with "-", starts it."""
    if not isinstance(name, str):
        return None
    owners = [t for t in all_teams if name.startswith(t + MODEL_NAME_SEPARATOR) and len(name) > len(t) + 1]
    return max(owners, key=len, default=None)


def team_for_model(viewer: Viewer, name: object, requested: str | None, all_teams) -> str:
    """The team of a new registered model called `name`, which must start with one of the caller's teams + "-".

    Registered-model names are global in MLflow: without the rule, any team could take the name another team
    documents (and that team would then get "already exists").
    """
    yours = ", ".join(viewer.teams) or "none"
    example = f"{viewer.teams[0] if viewer.teams else 'TEAM'}{MODEL_NAME_SEPARATOR}classifier"
    team = model_name_team(name, all_teams)
    if team is None:
        raise Refused(400, f"registered model name {name!r} refused: a model's name starts with its team's name "
                           f"and {MODEL_NAME_SEPARATOR!r}, e.g. {example!r} (your teams: {yours})")
    if not viewer.member_of(team):
        raise Refused(403, f"the name {name!r} belongs to team {team!r} (a model's name starts with its team's "
                           f"name and {MODEL_NAME_SEPARATOR!r}); choose one such as {example!r} (your teams: {yours})")
    if requested is not None and requested != team:
        raise Refused(400, f"registered model {name!r} belongs to team {team!r} by its name, not to {requested!r}")
    return team


def artifact_root(team: str) -> str:
    return f"{ARTIFACT_SCHEME}/{team}/"


def relative_segments(path: str) -> list[str]:
    """The segments of a relative artifact path, or `Refused` for anything that could leave its folder."""
    if not isinstance(path, str) or len(path) > 1024:
        raise Refused(400, "an artifact path must be a string of at most 1024 characters")
    parts = path.split("/")
    if parts and parts[-1] == "":
        parts = parts[:-1]
    for part in parts:
        if part in (".", "..") or not _SEGMENT.fullmatch(part):
            raise Refused(400, f"artifact path {path!r} refused: segments may not be empty, '.', '..', or contain "
                               "'\\', '?', '#', '%' or control characters")
    return parts


def check_location(uri: object, team: str) -> str:
    """`uri` if it lies under `team`'s artifact root, else `Refused` (400) saying what is accepted."""
    accepted = f"accepted: {artifact_root(team)}<path> (the server stores and serves it)"
    if not isinstance(uri, str) or not uri.startswith(ARTIFACT_SCHEME + "/") or uri.startswith(ARTIFACT_SCHEME + "//"):
        raise Refused(400, f"artifact location {uri!r} is outside team {team!r}'s artifact root; {accepted}")
    try:
        segments = relative_segments(uri[len(ARTIFACT_SCHEME) + 1:])
    except Refused as error:
        raise Refused(400, f"artifact location {uri!r} refused ({error.message}); {accepted}") from None
    if not segments or segments[0] != team:
        raise Refused(400, f"artifact location {uri!r} is outside team {team!r}'s artifact root; {accepted}")
    return uri


def check_alias(viewer: Viewer, team: str | None, alias: object) -> None:
    if not isinstance(alias, str) or not alias:
        raise Refused(400, "alias must be a non-empty string")
    if alias.lower() in REVIEWED_ALIASES and not viewer.may_review(team):
        raise Refused(403, f"only team {team}'s reviewers may set or remove the alias {alias!r} "
                           "(policy teams.<team>.reviewers); members may set e.g. 'candidate'")


# --- the routes --------------------------------------------------------------------------------------------

#: (method, path under the service prefix with ajax-api written as api) → what is checked ("answer:…": the gate
#: answers it, see `answer`). `<id>` is one path
#: segment, `<path>` the rest of the path.
_API = "/api/2.0/mlflow/"
ROUTES: dict[tuple[str, str], str] = {
    ("GET", "/"): "ui",
    ("GET", "/static-files/<path>"): "ui",
    ("GET", "/version"): "any",
    ("GET", "/api/3.0/mlflow/server-info"): "any",
    # The UI asks whether to send usage telemetry; MLflow runs with it off, so the answer is "no".
    ("GET", "/api/3.0/mlflow/ui-telemetry"): "any",
    # Answered by the gpupool app itself (`answer` below), never by MLflow: who is logged in (the hub user, for
    # the UI's user menu), and MLflow's assistant, which runs a coding-agent CLI on the server's host: off.
    ("GET", "/api/2.0/mlflow/users/current"): "answer:current-user",
    ("GET", "/api/3.0/mlflow/assistant/config"): "answer:assistant-config",
    ("GET", "/api/3.0/mlflow/assistant/providers"): "answer:assistant-providers",
    # The runs page asks which AI gateway endpoints exist (for its "New run" from a prompt): none, the gateway
    # is off (its calls through the proxy stay refused).
    ("GET", _API + "gateway-proxy"): "answer:gateway-endpoints",
    ("GET", "/get-artifact"): "run:read",
    ("GET", "/model-versions/get-artifact"): "model:read",
    ("POST", "/graphql"): "graphql",
    ("GET", "/graphql"): "graphql",
    # experiments
    ("POST", _API + "experiments/create"): "experiment:create",
    ("GET", _API + "experiments/search"): "experiment:search",
    ("POST", _API + "experiments/search"): "experiment:search",
    ("GET", _API + "experiments/get"): "experiment:read",
    ("GET", _API + "experiments/get-by-name"): "experiment:by-name",
    ("POST", _API + "experiments/delete"): "experiment:write",
    ("POST", _API + "experiments/restore"): "experiment:write",
    ("POST", _API + "experiments/update"): "experiment:write",
    ("POST", _API + "experiments/set-experiment-tag"): "experiment:write-tag",
    ("POST", _API + "experiments/delete-experiment-tag"): "experiment:write-tag",
    ("POST", _API + "experiments/search-datasets"): "experiments:read",
    # runs
    ("POST", _API + "runs/create"): "run:create",
    ("GET", _API + "runs/get"): "run:read",
    ("POST", _API + "runs/search"): "experiments:read",
    # The experiment page's charts (trace counts, latencies) in its default view.
    ("POST", "/api/3.0/mlflow/traces/metrics"): "experiments:read",
    ("POST", _API + "runs/update"): "run:update",
    ("POST", _API + "runs/delete"): "run:write",
    ("POST", _API + "runs/restore"): "run:write",
    ("POST", _API + "runs/log-metric"): "run:write",
    ("POST", _API + "runs/log-parameter"): "run:write",
    ("POST", _API + "runs/set-tag"): "run:write-tag",
    ("POST", _API + "runs/delete-tag"): "run:write-tag",
    ("POST", _API + "runs/log-batch"): "run:write-batch",
    ("POST", _API + "runs/log-model"): "run:write",
    ("POST", _API + "runs/log-inputs"): "run:write",
    ("POST", _API + "runs/outputs"): "run:write",
    ("GET", _API + "metrics/get-history"): "run:read",
    ("GET", _API + "metrics/get-history-bulk"): "runs:read",
    ("GET", _API + "metrics/get-history-bulk-interval"): "runs:read",
    ("GET", _API + "artifacts/list"): "run:read",
    # logged models (MLflow 3)
    ("POST", _API + "logged-models"): "experiment:write",
    ("POST", _API + "logged-models/search"): "experiments:read",
    ("GET", _API + "logged-models/<id>"): "logged-model:read",
    ("PATCH", _API + "logged-models/<id>"): "logged-model:write",
    ("DELETE", _API + "logged-models/<id>"): "logged-model:write",
    ("GET", _API + "logged-models/<id>/artifacts/directories"): "logged-model:read",
    ("GET", _API + "logged-models/<id>/artifacts/files"): "logged-model:read",
    ("POST", _API + "logged-models/<id>/params"): "logged-model:write",
    ("PATCH", _API + "logged-models/<id>/tags"): "logged-model:write",
    ("DELETE", _API + "logged-models/<id>/tags/<path>"): "logged-model:write",
    # the model registry
    ("POST", _API + "registered-models/create"): "model:create",
    ("GET", _API + "registered-models/search"): "model:search",
    ("GET", _API + "registered-models/get"): "model:read",
    ("GET", _API + "registered-models/get-latest-versions"): "model:read",
    ("POST", _API + "registered-models/get-latest-versions"): "model:read",
    ("POST", _API + "registered-models/rename"): "model:rename",
    ("PATCH", _API + "registered-models/update"): "model:write",
    ("DELETE", _API + "registered-models/delete"): "model:write",
    ("POST", _API + "registered-models/set-tag"): "model:write-tag",
    ("DELETE", _API + "registered-models/delete-tag"): "model:write-tag",
    ("GET", _API + "registered-models/alias"): "model:read",
    ("POST", _API + "registered-models/alias"): "alias:set",
    ("DELETE", _API + "registered-models/alias"): "alias:delete",
    ("POST", _API + "model-versions/create"): "version:create",
    ("GET", _API + "model-versions/get"): "model:read",
    ("GET", _API + "model-versions/get-download-uri"): "model:read",
    ("GET", _API + "model-versions/search"): "version:search",
    ("PATCH", _API + "model-versions/update"): "model:write",
    ("DELETE", _API + "model-versions/delete"): "model:write",
    ("POST", _API + "model-versions/transition-stage"): "model:write",
    ("POST", _API + "model-versions/set-tag"): "model:write-tag",
    ("DELETE", _API + "model-versions/delete-tag"): "model:write-tag",
    # the artifact proxy (--serve-artifacts): paths under the artifacts destination, "<team>/..."
    ("GET", "/api/2.0/mlflow-artifacts/artifacts"): "artifacts:list",
    ("GET", "/api/2.0/mlflow-artifacts/artifacts/<path>"): "artifacts:path",
    ("PUT", "/api/2.0/mlflow-artifacts/artifacts/<path>"): "artifacts:path",
    ("DELETE", "/api/2.0/mlflow-artifacts/artifacts/<path>"): "artifacts:path",
    ("POST", "/api/2.0/mlflow-artifacts/mpu/create/<path>"): "artifacts:path",
    ("POST", "/api/2.0/mlflow-artifacts/mpu/complete/<path>"): "artifacts:path",
    ("POST", "/api/2.0/mlflow-artifacts/mpu/abort/<path>"): "artifacts:path",
}

_PATTERNS = [
    (method, re.compile("^" + re.escape(pattern).replace(re.escape("<id>"), "([^/]+)")
                        .replace(re.escape("<path>"), "(.+)") + "$"), rule)
    for (method, pattern), rule in ROUTES.items()
]


def route_of(method: str, path: str) -> tuple[str, tuple[str, ...]]:
    """The rule of `method path` (path under the service prefix) and its path arguments; `Refused` if none."""
    if path.startswith("/ajax-api/"):
        path = "/api/" + path[len("/ajax-api/"):]
    method = "GET" if method == "HEAD" else method
    for m, pattern, rule in _PATTERNS:
        if m == method:
            match = pattern.match(path)
            if match:
                return rule, match.groups()
    raise Refused(404, f"{method} {path} is not available through gpupool's MLflow service")


def answer(what: str, viewer: Viewer) -> dict:
    """The gate's own answer to an `answer:` route, in the form MLflow's UI expects."""
    if what == "current-user":
        # is_basic_auth false: the UI offers no MLflow password change or logout (the hub owns both).
        return {"user": {"id": viewer.name, "username": viewer.name, "is_admin": viewer.admin},
                "is_basic_auth": False}
    if what == "assistant-config":
        return {"providers": {}, "projects": {}, "remote_access_allowed": False}
    if what == "assistant-providers":
        return {"providers": [], "resolved": None, "gateway_vendor_options": {}}
    if what == "gateway-endpoints":
        return {"endpoints": []}
    raise Refused(404, f"no answer {what!r}")
