"""What JupyterHub is told about gpupool in both modes: teams as groups, the roles of the hub services.

`hub/config.py` (embedded) and `spawner/volcano.py` (the Zero-to-JupyterHub values) both take these, so the
two modes cannot drift apart.
"""

from __future__ import annotations

from typing import Any

from gpupool.policies.model import Policy

ACCOUNTING_SERVICE = "accounting"
ACCOUNTING_ROLE = "gpupool-accounting"
#: The scopes of the accounting service's role: team membership (groups) and, for reconciliation, which
#: servers run with which options (`read:servers` shows `started` and `user_options`, never their state).
ACCOUNTING_SCOPES = ("list:groups", "read:groups", "list:users", "read:servers")
MLFLOW_SERVICE = "mlflow"
#: Where the hub's proxy serves the MLflow service (behind the hub login), in both modes.
MLFLOW_PREFIX = f"/services/{MLFLOW_SERVICE}/"
MLFLOW_ROLE = "gpupool-mlflow"
JOBS_SERVICE = "jobs"
JOBS_ROLE = "gpupool-jobs"
#: The jobs service needs no hub scope: who calls comes with their token, teams from the policies.
JOBS_SCOPES: tuple[str, ...] = ()
#: The MLflow service needs no hub scope: the identity of each caller's token (name, admin, groups) comes with
#: the token itself, and teams and reviewers come from the policies.
MLFLOW_SCOPES: tuple[str, ...] = ()
CULLER_SERVICE = "culler"
CULLER_ROLE = "gpupool-culler"
#: The idle culler's scopes: which servers run (`read:servers`), with their state (`admin:server_state`: PID,
#: cards, ledger run), and the stop (`delete:servers`). It never calls a server: each server reports its kernels
#: to it (gpupool.hub.lab_idle, with the server's own token).
CULLER_SCOPES = ("list:users", "read:users:name", "read:servers", "admin:server_state", "delete:servers")
#: What a user server's own API token ($JUPYTERHUB_API_TOKEN, also $MLFLOW_TRACKING_TOKEN) may do: JupyterHub's
#: default `server` role, plus calling the MLflow service, the jobs service and the idle culler (JupyterLab's
#: warning before a stop, and its "keep it": gpupool.hub.lab_idle).
SERVER_TOKEN_SCOPES = ("users:activity!user", "access:servers!server", f"access:services!service={MLFLOW_SERVICE}",
                       f"access:services!service={JOBS_SERVICE}", f"access:services!service={CULLER_SERVICE}")
#: What a training job's run's own token may do: call the MLflow service and the jobs service, nothing else.
JOB_TOKEN_SCOPES = (f"access:services!service={MLFLOW_SERVICE}", f"access:services!service={JOBS_SERVICE}")


def mlflow_url(public_url: str) -> str:
    """The MLflow service as user servers reach it: through the hub's public proxy at `public_url`."""
    return public_url.rstrip("/") + MLFLOW_PREFIX


def team_groups(policy: Policy) -> dict[str, dict[str, Any]]:
    """`JupyterHub.load_groups`: one group per team, with the members the policies list."""
    return {
        name: {"users": list(team.members), "properties": {"gpupool.team": "true"}}
        for name, team in sorted(policy.teams.items())
    }


def sharing_roles(policy: Policy) -> list[dict[str, Any]]:
    """Roles that let the members of teams with `sharing: true` share their servers (JupyterHub's `shares`).

    JupyterHub's `user` role has no `shares`; these add it for the team's group only, with the names of the
    team's members and of its group, which JupyterHub asks of a share by name: so a share to anyone else is
    refused by the scopes already, and gpupool's hub (`gpupool.hub.sharing`) refuses it with the rule and
    keeps every share within the team the server runs for.
    """
    return [
        {"name": f"gpupool-sharing-{name}",
         "description": f"members of team {name} may share their servers with the team",
         "scopes": ["shares!user", f"read:users:name!group={name}", f"read:groups:name!group={name}"],
         "groups": [name]}
        for name, team in sorted(policy.teams.items()) if team.sharing
    ]


def service_roles(jobs: bool = True, culler: bool = True) -> dict[str, dict[str, Any]]:
    """Each service gets exactly its scopes; every user may open their pages (the services decide what they see).

    `jobs`, `culler`: with the jobs service and the idle culler (both modes;
    `gpupool render --no-culler` leaves it out of the chart's hub)."""
    roles = {
        ACCOUNTING_ROLE: {
            "description": "gpupool-accounting reads team membership and which servers run",
            "scopes": list(ACCOUNTING_SCOPES),
            "services": [ACCOUNTING_SERVICE],
        },
        MLFLOW_ROLE: {
            "description": "the MLflow tracking server and model registry: no hub scopes",
            "scopes": list(MLFLOW_SCOPES),
            "services": [MLFLOW_SERVICE],
        },
        JOBS_ROLE: {
            "description": "gpupool-jobs: training jobs' API and page; no hub scopes",
            "scopes": list(JOBS_SCOPES),
            "services": [JOBS_SERVICE],
        },
        CULLER_ROLE: {
            "description": "gpupool-culler warns, then stops, servers whose GPU share sits idle",
            "scopes": list(CULLER_SCOPES),
            "services": [CULLER_SERVICE],
        },
        "user": {"scopes": ["self", f"access:services!service={ACCOUNTING_SERVICE}",
                            f"access:services!service={MLFLOW_SERVICE}"]
                 + ([f"access:services!service={JOBS_SERVICE}"] if jobs else [])
                 + ([f"access:services!service={CULLER_SERVICE}"] if culler else [])},
    }
    if not jobs:
        del roles[JOBS_ROLE]
    if not culler:
        del roles[CULLER_ROLE]
    return roles
