"""What JupyterHub is told about gpupool in both modes: teams as groups, the accounting service's roles.

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


def team_groups(policy: Policy) -> dict[str, dict[str, Any]]:
    """`JupyterHub.load_groups`: one group per team, with the members the policies list."""
    return {
        name: {"users": list(team.members), "properties": {"gpupool.team": "true"}}
        for name, team in sorted(policy.teams.items())
    }


def accounting_roles() -> dict[str, dict[str, Any]]:
    """The service gets exactly its scopes; every user may open its pages (the service decides what they see)."""
    return {
        ACCOUNTING_ROLE: {
            "description": "gpupool-accounting reads team membership and which servers run",
            "scopes": list(ACCOUNTING_SCOPES),
            "services": [ACCOUNTING_SERVICE],
        },
        "user": {"scopes": ["self", f"access:services!service={ACCOUNTING_SERVICE}"]},
    }
