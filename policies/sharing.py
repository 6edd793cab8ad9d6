"""Who may share a server with whom: members of the team the server runs for, in teams whose policy allows it.

JupyterHub's shares (`POST /hub/api/shares/USER/SERVER`) know nothing of teams; gpupool's hub asks
`share_refusal` before JupyterHub grants anything (`gpupool.hub.sharing`).
"""

from __future__ import annotations

from collections.abc import Iterable

from gpupool.policies.model import Policy

#: Why share codes are refused whatever the policy says: whoever holds a code may accept it, teammate or not.
SHARE_CODES_REFUSED = (
    "share codes are off on this platform: whoever holds a code could accept it, inside the team or not; "
    "share with a teammate by name instead (POST /hub/api/shares/USER/SERVER with {\"user\": NAME})"
)


def share_refusal(policy: Policy, owner: str, server: str, team: str | None, *, user: str | None = None,
                  user_teams: Iterable[str] = (), group: str | None = None) -> str | None:
    """Why `owner`'s server `server`, run for `team`, may not be shared with `user` (in `user_teams`) or with
    `group`; None when it may.

    A server is shared within the team it runs for (the one charged for it), never beyond, and only when that
    team's policy says `sharing: true`.
    """
    where = f"{owner}/{server}" if server else f"{owner}'s default server"
    if team is None:
        return (f"{where} has not run for a team yet, and a server is shared only within the team it runs for; "
                "start it first")
    if team not in policy.teams:
        return f"{where} ran for team {team!r}, which the policies no longer have; start it again for a team"
    if not policy.teams[team].sharing:
        return (f"sharing is off for team {team!r}, which {where} runs for: servers are shared only in teams "
                f"whose policy says `sharing: true` (teams.{team}.sharing)")
    if group is not None and group != team:
        return (f"{where} runs for team {team!r} and is shared within that team only: with its members or its "
                f"group {team!r}, not with group {group!r} (teams.{team}.sharing)")
    if user is not None and team not in set(user_teams):
        return (f"{user} is not a member of team {team!r}, which {where} runs for: servers are shared within "
                f"their team only (teams.{team}.sharing)")
    return None
