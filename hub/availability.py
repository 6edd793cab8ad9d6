"""`GET /hub/api/users/NAME/availability`: what a spawn of each profile NAME may pick would do now (start, wait
and why, or be refused) and the queue's length, as the spawn page shows it, for pickers other than that page.

A JupyterHub API route of `gpupool-hub` (JupyterHub's own authentication and scopes: `read:servers` on the user,
which every user's own token has); the answer comes from the user's spawner (`profile_availability`).
"""

from __future__ import annotations

import json

from jupyterhub.apihandlers.base import APIHandler
from jupyterhub.scopes import needs_scope
from tornado import web


class AvailabilityAPIHandler(APIHandler):
    @needs_scope("read:servers")
    async def get(self, user_name: str):
        user = self.find_user(user_name)
        if user is None:
            raise web.HTTPError(404, f"No such user: {user_name}")
        spawner = user.spawner  # the default server's: the same teams, profiles and pool as any of theirs
        if not hasattr(spawner, "profile_availability"):
            raise web.HTTPError(404, "availability comes from gpupool's spawners; this hub runs another one")
        availability = await spawner.profile_availability()
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(availability.as_json()))


def availability_handlers() -> list[tuple]:
    """The routes (without the hub's prefix)."""
    return [(r"/api/users/([^/]+)/availability", AvailabilityAPIHandler)]
