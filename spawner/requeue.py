"""After a hub restart, the requests that waited in the embedded pool's queue are asked for again, in order.

The queue is persisted by the pool (`AllocationStore.enqueue`); what JupyterHub knew of those spawns died with
the hub. Once the restarted hub answers, each waiting request is started again through the hub's REST API with
the options it was checked with, under a token of gpupool's own (`queue_service_token`, scope `servers`); it
keeps its place in the queue. A request the hub refuses now (its user left the team, its profile is gone) is
kept as lost with the hub's reason, which its user sees on their home page.

The hub holds each such request for its `slow_spawn_timeout` (a queued spawn is pending: 202 after ~10 s), so
they are asked for `ASKING_AT_ONCE` at a time, in queue order, over connections of their own: none waits in
an HTTP client's queue, where it would time out ("Timeout in request queue") however many wait.
"""

from __future__ import annotations

import asyncio
import html
import json
import time
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from gpupool.spawner.pool import AllocationStore, LocalPool, Queued

#: How long to wait for the restarted hub's API to answer before giving the requests up.
HUB_WAIT_S = 300
#: Requests asked for again at the same time (each held by the hub ~10 s): 100 waiting are back in ~50 s.
ASKING_AT_ONCE = 20

_stores: dict[str, AllocationStore] = {}


def server_path(key: str) -> str:
    user, _, server = key.partition("/")
    return f"users/{quote(user, safe='')}/" + (f"servers/{quote(server, safe='')}" if server else "server")


async def _hub_answers(client: AsyncHTTPClient, api_url: str, deadline: float) -> bool:
    while time.monotonic() < deadline:
        try:
            await client.fetch(api_url, request_timeout=10)
            return True
        except (HTTPClientError, OSError):
            await asyncio.sleep(0.5)
    return False


def _retry_after(error: HTTPClientError) -> float:
    """The seconds a 429 asks to wait (JupyterHub sends a whole number), 5 if it does not say, 30 at most."""
    try:
        return min(float(error.response.headers.get("Retry-After", 5)) if error.response else 5.0, 30.0)
    except ValueError:
        return 5.0


async def _ask_again(client: AsyncHTTPClient, pool: LocalPool, api_url: str, token: str, entry: Queued, log) -> None:
    key = entry.request.key
    request = HTTPRequest(api_url + server_path(key), method="POST", body=json.dumps(entry.options),
                          headers={"Authorization": f"token {token}", "Content-Type": "application/json"},
                          request_timeout=120)
    deadline = time.monotonic() + HUB_WAIT_S
    try:
        while True:
            try:
                await client.fetch(request)
                break
            except HTTPClientError as error:
                # JupyterHub's concurrent_spawn_limit (users starting servers meanwhile): it says when to ask again
                if error.code != 429 or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(_retry_after(error))
        log.info("%s is back in the queue after the restart", key)
    except HTTPClientError as error:
        try:
            reason = json.loads(error.response.body).get("message") if error.response else None
        except ValueError:
            reason = None
        reason = reason or str(error)
        if key in pool.waiting:  # its user asked again first: it is back anyway
            return
        log.warning("%s could not come back to the queue after the restart: %s", key, reason)
        pool.store.mark_lost(key, reason)
    except OSError as error:
        log.warning("%s could not come back to the queue after the restart: %s", key, error)
        pool.store.mark_lost(key, f"the hub did not answer ({error})")


async def requeue(pool: LocalPool, api_url: str, token: str, log) -> None:
    """Ask the hub at `api_url` for every request in `pool.restoring` again; then let the queue move on."""
    # Training jobs (keys `job:ID`) are asked for again by the job runner, not through the hub's API.
    entries = sorted((q for q in pool.restoring.values() if not q.request.key.startswith("job:")),
                     key=lambda q: q.seq)
    # A client of its own, never the hub's shared one (its proxy calls would wait behind these), with a
    # connection for each request in flight: tornado's queue wait counts against `connect_timeout`.
    client = AsyncHTTPClient(force_instance=True, max_clients=ASKING_AT_ONCE)
    api_url = api_url.rstrip("/") + "/"
    try:
        if not await _hub_answers(client, api_url, time.monotonic() + HUB_WAIT_S):
            for entry in entries:
                pool.store.mark_lost(entry.request.key, "the hub did not come back in time after its restart")
            return
        # In queue order, so the head is back (and may start) first; each keeps its place whatever order they
        # arrive in (the pool holds later ones until these are back).
        ahead = iter(entries)

        async def asker() -> None:
            for entry in ahead:
                if entry.request.key not in pool.waiting:  # its user asked again first: it is back anyway
                    await _ask_again(client, pool, api_url, token, entry, log)

        await asyncio.gather(*(asker() for _ in range(ASKING_AT_ONCE)))
    finally:
        client.close()
        pool.restored()


def queue_notices(state_dir: str, user: str) -> str:
    """HTML for `user`'s home page: their queued requests that could not come back after a restart, and why."""
    store = _stores.get(state_dir)
    if store is None:
        store = _stores[state_dir] = AllocationStore(f"{state_dir}/allocations.sqlite", owner="pages")
    lost = store.lost(user)
    if not lost:
        return ""
    items = "".join(
        f"<li>{html.escape(q.request.display_name)} ({html.escape(q.request.key.partition('/')[2] or 'default')} "
        f"server), queued {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(q.queued_at))}: "
        f"{html.escape(q.lost or '')}</li>"
        for q in lost
    )
    return ("<div class='alert alert-warning'>The hub restarted while these requests waited in the queue, and "
            f"they could not be queued again; start them again when you can:<ul>{items}</ul></div>")
