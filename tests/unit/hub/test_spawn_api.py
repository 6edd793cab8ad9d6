"""`gpupool.hub.spawn_api`: when the REST answer to a spawn comes, against JupyterHub's own wait (replaced here by
a coroutine the test controls: no hub runs). The person's path, a real hub answering 202 with the queue's line, is
`tests/e2e/test_embedded.py::test_team_quota_makes_the_next_spawn_wait`."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from jupyterhub.apihandlers.users import UserServerAPIHandler

from gpupool.hub.spawn_api import ServerAPIHandler, spawn_api_handlers

WAITING = 'Waiting for 0.25 × H200: position 1 of 1 in queue "nlp"'


class Spawner:
    """A spawner whose queue verdict the test gives: `queued` set → it waits; `broken` → its hook fails."""

    def __init__(self, hook: bool = True, broken: bool = False):
        self.queued = asyncio.Event()
        self.broken = broken
        if hook:
            self.waits_in_queue = self._waits

    async def _waits(self) -> str:
        if self.broken:
            raise RuntimeError("no pool")
        await self.queued.wait()
        return WAITING


@pytest.fixture
def jupyterhubs_wait(monkeypatch):
    """JupyterHub's `spawn_single_user`, as the parent class has it: ends when the test sets `done`."""
    state = SimpleNamespace(done=asyncio.Event(), ended=False, result="started")

    async def spawn_single_user(self, user, server_name="", *args, **kwargs):
        await state.done.wait()
        state.ended = True
        return state.result

    monkeypatch.setattr(UserServerAPIHandler, "spawn_single_user", spawn_single_user)
    return state


def handler() -> ServerAPIHandler:
    return ServerAPIHandler.__new__(ServerAPIHandler)  # no request: only spawn_single_user is called


def user(spawner: Spawner) -> SimpleNamespace:
    return SimpleNamespace(name="carol", spawners={"": spawner})


@pytest.mark.asyncio
async def test_a_spawn_that_waits_in_the_queue_is_answered_then_goes_on(jupyterhubs_wait):
    spawner, h = Spawner(), handler()
    answer = asyncio.ensure_future(h.spawn_single_user(user(spawner), ""))
    await asyncio.sleep(0)
    assert not answer.done()  # neither started nor queued yet: the answer waits
    spawner.queued.set()
    # (a bound only so that a handler that waits for the spawn fails here instead of hanging the suite)
    assert await asyncio.wait_for(answer, 60) is None and h.waiting == WAITING
    assert not jupyterhubs_wait.ended  # the spawn itself goes on after the answer
    jupyterhubs_wait.done.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert jupyterhubs_wait.ended


@pytest.mark.asyncio
async def test_a_spawn_that_starts_gets_jupyterhubs_own_answer(jupyterhubs_wait):
    spawner, h = Spawner(), handler()
    answer = asyncio.ensure_future(h.spawn_single_user(user(spawner), ""))
    jupyterhubs_wait.done.set()
    assert await answer == "started" and h.waiting == ""


@pytest.mark.asyncio
@pytest.mark.parametrize("spawner", [Spawner(hook=False), Spawner(broken=True)], ids=["no-hook", "hook-fails"])
async def test_without_a_verdict_from_the_spawner_jupyterhubs_wait_decides(jupyterhubs_wait, spawner):
    h = handler()
    answer = asyncio.ensure_future(h.spawn_single_user(user(spawner), ""))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not answer.done()  # waiting for the spawn, as JupyterHub does
    jupyterhubs_wait.done.set()
    assert await answer == "started" and h.waiting == ""


def test_only_jupyterhubs_server_api_routes_are_replaced():
    other = object()
    routes = [(r"/api/users/([^/]+)/server", UserServerAPIHandler, {}), (r"/api/users", other)]
    assert spawn_api_handlers(routes) == [(r"/api/users/([^/]+)/server", ServerAPIHandler, {}),
                                          (r"/api/users", other)]
