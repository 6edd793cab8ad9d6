"""`GET /hub/spawn/USER/NAME` shows the spawn form of a new named server without making the server.

JupyterHub's `SpawnHandler` makes the named server (its database row) as soon as the page is opened, to render
the form with its spawner; that stopped server then counts against `named_server_limit_per_user` until someone
deletes it, so a person who only looked at the form of a few names could start none. `gpupool-hub` routes the
spawn pages here: the page is JupyterHub's, and a server the view made and that did not start is removed again
before the answer ends, as `DELETE /hub/api/users/USER/servers/NAME` with `remove` would. Posting the form
makes the server as JupyterHub always does.
"""

from __future__ import annotations

from jupyterhub.handlers.pages import SpawnHandler
from jupyterhub.utils import maybe_future


class SpawnPageHandler(SpawnHandler):
    async def get(self, user_name=None, server_name=""):
        owner = None
        if server_name and self.current_user is not None:
            owner = self.find_user(user_name) if user_name else self.current_user
        made_here = owner is not None and server_name not in owner.orm_spawners
        try:
            # JupyterHub's get is not a coroutine function: it returns its handler's coroutine, or None after
            # redirecting to the login page.
            page = super().get(user_name, server_name)
            if page is not None:
                await page
        finally:
            if made_here:
                await self._forget_unstarted(owner, server_name)

    async def _forget_unstarted(self, owner, server_name: str) -> None:
        """Remove `owner`'s server `server_name` if it is there and nothing started it (a spawn from the page's
        query arguments, or the form posted meanwhile in another tab, keeps it)."""
        if server_name not in owner.orm_spawners:
            return
        spawner = owner.spawners.get(server_name)
        if spawner is None:
            return
        if spawner.active or spawner.pending or spawner._spawn_future is not None:
            return
        self.log.debug("The spawn page of %s made it: removing it again", spawner._log_name)
        await maybe_future(owner._delete_spawner(spawner))
        if spawner.active or spawner.pending or spawner._spawn_future is not None:
            return  # started while its resources were cleaned up
        self.db.delete(spawner.orm_spawner)
        owner.spawners.pop(server_name, None)
        self.db.commit()


def spawn_page_handlers(handlers: list[tuple]) -> list[tuple]:
    """`handlers` (the hub's routes) with JupyterHub's spawn page replaced by `SpawnPageHandler`."""
    return [(route[0], SpawnPageHandler, *route[2:]) if route[1] is SpawnHandler else route for route in handlers]
