"""The hub's share routes with gpupool's rule in front: a server is shared within the team it runs for only.

JupyterHub grants a share to whoever the owner names and offers no hook to refuse one, so `GPUPoolHub`
(`gpupool.hub.app`) routes `POST /hub/api/shares/USER/SERVER` and `POST /hub/api/share-codes/USER/SERVER` to
these subclasses of JupyterHub's own handlers first. After JupyterHub's own scope check (`shares`), a share
that `gpupool.policies.sharing.share_refusal` refuses is answered 403 with the rule; everything else (listing,
revoking, the request's validation) is JupyterHub's.
"""

from __future__ import annotations

from jupyterhub.apihandlers.shares import ServerShareAPIHandler, ServerShareCodeAPIHandler, ShareGrantRequest
from jupyterhub.scopes import needs_scope
from pydantic import ValidationError
from tornado import web

from gpupool.policies.sharing import SHARE_CODES_REFUSED, share_refusal
from gpupool.policies.reload import current_policy


class TeamShareAPIHandler(ServerShareAPIHandler):
    """JupyterHub's `POST /hub/api/shares/USER/SERVER`, refusing shares outside the server's team."""

    def initialize(self, policy_dir: str) -> None:
        self.policy_dir = policy_dir

    @needs_scope("shares")
    async def post(self, user_name, server_name=None):
        if server_name is not None:
            self.check_team(user_name, server_name)
        return await super().post(user_name, server_name)

    def check_team(self, user_name: str, server_name: str) -> None:
        body = self.get_json_body() or {}
        if not isinstance(body, dict):  # JupyterHub's own handler would fail on it with a 500
            raise web.HTTPError(400, 'the body must be a JSON object: {"user": NAME} or {"group": NAME}')
        try:
            request = ShareGrantRequest(**body)
        except ValidationError:
            return  # JupyterHub's own handler answers the malformed request with its 400
        spawner = self._lookup_spawner(user_name, server_name)
        team = (spawner.user_options or {}).get("team")
        policy = current_policy(self.policy_dir, self.log)
        user_teams: list[str] = []
        if request.user is not None:
            found = self.find_user(request.user)
            if found is not None:
                user_teams = policy.teams_of(found.name, [g.name for g in found.groups])
        problem = share_refusal(policy, user_name, server_name, team if isinstance(team, str) else None,
                                user=request.user, user_teams=user_teams, group=request.group)
        if problem:
            self.log.warning("share of %s/%s refused: %s", user_name, server_name, problem)
            raise web.HTTPError(403, problem)


class NoShareCodesAPIHandler(ServerShareCodeAPIHandler):
    """JupyterHub's share codes, refused: a code can be accepted by anyone who has it, teammate or not."""

    def initialize(self, policy_dir: str) -> None:
        self.policy_dir = policy_dir

    @needs_scope("shares")
    async def post(self, user_name, server_name=None):
        if server_name is None:
            raise web.HTTPError(405)
        raise web.HTTPError(403, SHARE_CODES_REFUSED)


def share_handlers(policy_dir: str) -> list[tuple]:
    """The routes (without the hub's prefix) that go before JupyterHub's own, with the same patterns."""
    kwargs = {"policy_dir": policy_dir}
    return [
        (r"/api/shares/([^/]+)/([^/]*)", TeamShareAPIHandler, kwargs),
        (r"/api/share-codes/([^/]+)/([^/]*)", NoShareCodesAPIHandler, kwargs),
    ]
