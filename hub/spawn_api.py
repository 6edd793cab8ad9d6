"""`POST /hub/api/users/USER/server[s/NAME]` answers 202 as soon as the spawn waits in gpupool's queue.

JupyterHub's REST handler holds a spawn's request until the server is up or `slow_spawn_timeout` (10 s) has passed,
then answers 201 or 202 with an empty body. A request the pool queues can wait for minutes: its client learnt
nothing in those 10 s that it cannot know the moment the queue's pass gives the request its place. gpupool's hub
routes the server API here: the spawn goes on exactly as JupyterHub starts it, and once the spawner says it waits
(`waits_in_queue`, the embedded pool's) the answer is 202 with the queue's words as its text ("Waiting for
0.25 × H200: position 1 of 1 in queue …", the progress stream's message). A spawner without that hook (the
Kubernetes mode's: Volcano's queue is not the hub's to see) gets JupyterHub's behaviour unchanged.
"""

from __future__ import annotations

import asyncio
import logging

from jupyterhub.apihandlers.users import UserServerAPIHandler

log = logging.getLogger(__name__)


def _forget(spawning: asyncio.Future) -> None:
    """The rest of JupyterHub's wait, once the answer has gone: a failure shows in the progress stream, and here."""
    if not spawning.cancelled() and spawning.exception() is not None:
        log.info("gpupool: a spawn answered 202 from the queue ended with: %s", spawning.exception())


class ServerAPIHandler(UserServerAPIHandler):
    #: The queue's message of a spawn answered while it waits.
    waiting = ""

    async def post(self, user_name, server_name=""):
        await super().post(user_name, server_name)
        if self.waiting and self.get_status() == 202:
            self.set_header("Content-Type", "text/plain; charset=utf-8")
            self.write(self.waiting + "\n")

    async def spawn_single_user(self, user, server_name="", *args, **kwargs):
        spawning = asyncio.ensure_future(super().spawn_single_user(user, server_name, *args, **kwargs))
        waits = getattr(user.spawners[server_name], "waits_in_queue", None)
        if waits is None:
            return await spawning
        queued = asyncio.ensure_future(waits())
        try:
            await asyncio.wait({spawning, queued}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            said = queued.done()
            if not said:
                queued.cancel()
        problem = queued.exception() if said else None
        if spawning.done():
            return spawning.result()  # started, refused or failed meanwhile: JupyterHub's own answer
        if problem is not None:  # the spawner could not say: JupyterHub's wait, as without the hook
            log.warning("gpupool: whether %s/%s waits in the queue is unknown (%s)", user.name, server_name, problem)
            return await spawning
        spawning.add_done_callback(_forget)
        self.waiting = queued.result()
        # JupyterHub's post() answers 202: the spawn is pending.


def spawn_api_handlers(handlers: list[tuple]) -> list[tuple]:
    """`handlers` (the hub's routes) with JupyterHub's server API replaced by `ServerAPIHandler`."""
    return [(route[0], ServerAPIHandler, *route[2:]) if route[1] is UserServerAPIHandler else route
            for route in handlers]
