"""The embedded pool: placement, the persistent allocator under concurrency, and the wait queue."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from dataclasses import replace
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from gpupool.policies import DEFAULT_POLICY_DIR, load_policy
from gpupool.policies.admission import Holdings, Reason
from gpupool.spawner.pool import (
    AllocationStore, Card, Denied, LocalPool, QueueTimeout, Request, Verdict, declared_cards,
    match_model, place,
)

H200 = [Card(f"GPU-{i}", "H200", i, 141) for i in range(2)]
QUARTER = Fraction(1, 4)


def request(n: int, share=QUARTER, team="vision", priority=0, model="H200") -> Request:
    return Request(f"user{n}/", f"user{n}", team, "h200-quarter", f"{share} × {model}", model, Fraction(share), priority)


@pytest.fixture
def store(tmp_path):
    return AllocationStore(tmp_path / "allocations.sqlite")


def test_declared_inventory_of_the_default_policy():
    cards = declared_cards(load_policy(DEFAULT_POLICY_DIR))
    assert [(c.uuid, c.model) for c in cards] == [("GPU-declared-H200-0", "H200"), ("GPU-declared-H200-1", "H200")]


def test_nvml_names_match_policy_models():
    policy = load_policy(DEFAULT_POLICY_DIR)
    assert match_model("NVIDIA H200", policy) == "H200"
    assert match_model("NVIDIA GeForce RTX 4090", policy) is None


def test_best_fit_keeps_whole_cards_free():
    used = {"GPU-0": Fraction(1, 2)}
    assert place(H200, used, "H200", QUARTER) == ("GPU-0",)
    assert place(H200, used, "H200", Fraction(1)) == ("GPU-1",)
    assert place(H200, used, "H200", Fraction(2)) is None
    assert place(H200, {}, "H200", Fraction(2)) == ("GPU-0", "GPU-1")
    assert place(H200, {}, "A100", QUARTER) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([Fraction(1, 7), Fraction(1, 4), Fraction(1, 2), Fraction(1), Fraction(2)]), max_size=30))
def test_placement_never_overcommits(shares):
    used: dict[str, Fraction] = {}
    for share in shares:
        chosen = place(H200, used, "H200", share)
        if chosen is None:
            continue
        for uuid in chosen:
            used[uuid] = used.get(uuid, Fraction(0)) + (share if share < 1 else 1)
        assert all(v <= 1 for v in used.values())


def test_concurrent_reservations_never_double_allocate(tmp_path):
    path = tmp_path / "allocations.sqlite"
    AllocationStore(path)
    results = []

    def worker(n):
        store = AllocationStore(path, owner="same")  # one store per thread: separate connections
        results.append(store.reserve(request(n), H200))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    placed = [r for r in results if r is not None]
    assert len(placed) == 8
    used = AllocationStore(path, owner="same").used()
    assert used == {"GPU-0": 1, "GPU-1": 1}


def test_reservations_from_separate_processes(tmp_path):
    path = tmp_path / "allocations.sqlite"
    AllocationStore(path)
    code = (
        "import sys; from fractions import Fraction; from gpupool.spawner.pool import *\n"
        f"cards = [Card(f'GPU-{{i}}', 'H200', i, 141) for i in range(2)]\n"
        f"s = AllocationStore({str(path)!r}, owner='x')\n"
        "n = sys.argv[1]\n"
        "print(s.reserve(Request(f'p{n}/', f'p{n}', 'vision', 'q', 'q', 'H200', Fraction(1, 2)), cards) is not None)\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(n)], stdout=subprocess.PIPE, text=True) for n in range(8)]
    outputs = [p.communicate()[0].strip() for p in procs]
    assert outputs.count("True") == 4
    assert AllocationStore(path, owner="x").used() == {"GPU-0": 1, "GPU-1": 1}


def test_sweep_frees_dead_and_reused_pids_and_foreign_reservations(tmp_path):
    path = tmp_path / "allocations.sqlite"
    first = AllocationStore(path, owner="hub-1")
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        for n, pid in ((1, alive.pid), (2, dead.pid), (3, alive.pid)):
            first.reserve(request(n), H200)
            first.mark_running(f"user{n}/", pid)
        # user3's record claims the live PID but with another start time: a reused PID.
        with first.engine.begin() as db:
            db.exec_driver_sql("UPDATE allocations SET pid_started = pid_started - 100 WHERE key = 'user3/'")
        first.reserve(request(4), H200)  # reserved, never started
        second = AllocationStore(path, owner="hub-2")
        freed = {a.key for a in second.sweep()}
        assert freed == {"user2/", "user3/", "user4/"}
        assert [a.key for a in second.all()] == ["user1/"]
    finally:
        alive.kill()


def run(coro):
    return asyncio.run(coro)


async def settle(pool: LocalPool) -> None:
    """The acquires just created reach the queue, and the passes of the queue asked for so far are applied.

    Passes run in a worker thread; this waits for them, not for a clock, so it holds on a loaded machine."""
    await asyncio.sleep(0)
    await pool.settled()


def test_twelve_quarter_requests_on_two_cards(store):
    async def scenario():
        pool = LocalPool(H200, store)
        tasks = [asyncio.create_task(pool.acquire(request(n))) for n in range(12)]
        await settle(pool)
        waiting = [t for t in map(pool.ticket, (f"user{n}/" for n in range(12))) if t and not t.future.done()]
        assert len(waiting) == 4, "8 quarters fit on two cards"
        assert sorted(t.position for t in waiting) == [1, 2, 3, 4]
        assert all(t.of == 4 for t in waiting)
        head = min(waiting, key=lambda t: t.position)
        assert head.message().startswith('Waiting for 1/4 × H200: position 1 of 4 in queue "vision" (no H200 has 0.25 free')
        assert store.used() == {"GPU-0": 1, "GPU-1": 1}
        # a freed share goes to the head of the queue at once
        freed_card = (await tasks[0]).cards[0]
        pool.release("user0/")
        await asyncio.sleep(0)
        allocation = await asyncio.wait_for(tasks[8], 30)
        assert allocation.key == "user8/" and allocation.cards == (freed_card,)
        assert sorted(pool.ticket(f"user{n}/").position for n in (9, 10, 11)) == [1, 2, 3]
        for t in tasks[9:]:
            t.cancel()
        await asyncio.gather(*tasks[9:], return_exceptions=True)
        assert not pool.waiting

    run(scenario())


def test_cancel_frees_the_place_in_the_queue(store):
    async def scenario():
        pool = LocalPool(H200, store)
        holders = [await pool.acquire(request(n, Fraction(1))) for n in range(2)]
        first = asyncio.create_task(pool.acquire(request(10)))
        second = asyncio.create_task(pool.acquire(request(11)))
        await settle(pool)
        assert pool.ticket("user11/").position == 2
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await pool.settled()
        assert pool.ticket("user11/").position == 1 and pool.ticket("user10/") is None
        pool.release(holders[0].key)
        assert (await asyncio.wait_for(second, 30)).key == "user11/"

    run(scenario())


def test_queue_timeout_says_so(store):
    async def scenario():
        pool = LocalPool(H200, store)
        for n in range(2):
            await pool.acquire(request(n, Fraction(1)))
        with pytest.raises(QueueTimeout, match='after 0 s in queue "vision"'):
            await pool.acquire(request(5), timeout=0.05)
        assert not pool.waiting and len(store.all()) == 2

    run(scenario())


def test_priority_then_arrival(store):
    async def scenario():
        pool = LocalPool(H200, store)
        holders = [await pool.acquire(request(n, Fraction(1))) for n in range(2)]
        low = asyncio.create_task(pool.acquire(request(10, Fraction(1), team="nlp", priority=50)))
        await settle(pool)
        high = asyncio.create_task(pool.acquire(request(11, Fraction(1), team="vision", priority=100)))
        await settle(pool)
        pool.release(holders[0].key)
        assert (await asyncio.wait_for(high, 30)).key == "user11/"
        assert not low.done()
        pool.release(holders[1].key)
        assert (await asyncio.wait_for(low, 30)).key == "user10/"

    run(scenario())


def test_a_waiting_whole_card_is_not_overtaken_by_smaller_requests(store):
    async def scenario():
        pool = LocalPool(H200, store)
        await pool.acquire(request(0, Fraction(1)))
        await pool.acquire(request(1, Fraction(1, 2)))
        whole = asyncio.create_task(pool.acquire(request(2, Fraction(1))))
        await settle(pool)
        quarter = asyncio.create_task(pool.acquire(request(3)))
        await settle(pool)
        assert not quarter.done(), "the quarter would fit, but the whole card asked first"
        assert pool.ticket("user3/").code is Reason.NO_CAPACITY
        pool.release("user1/")
        assert (await asyncio.wait_for(whole, 30)).cards == ("GPU-1",)
        whole.result()
        quarter.cancel()

    run(scenario())


def test_a_preview_says_what_the_queue_would_do_and_changes_nothing(store):
    def quota(req: Request, holdings: Holdings) -> Verdict:
        if req.team == "blocked":
            return Verdict("deny", "budget used up", code=Reason.BUDGET_DENY)
        if holdings.team.get(req.team, 0) + req.share > 1 and req.team == "small":
            return Verdict("wait", "team small holds its 1 GPU", code=Reason.QUOTA_FULL)
        return Verdict("admit", code=Reason.WITHIN_QUOTA)

    async def scenario():
        pool = LocalPool(H200, store, decide=quota)
        await pool.acquire(request(0, Fraction(1)))
        await pool.acquire(request(1, Fraction(1, 2)))
        asked = [request(10), request(11, Fraction(1)), request(12, Fraction(3)), request(13, team="blocked")]
        before = store.all()
        outcomes = await asyncio.to_thread(pool.preview, asked)
        assert {k: (o.action, o.code) for k, o in outcomes.items()} == {
            "user10/": ("place", Reason.WITHIN_QUOTA),  # a quarter fits beside the half
            "user11/": ("wait", Reason.NO_CAPACITY),  # no whole card is free
            "user12/": ("deny", Reason.NEVER_FITS_POOL),  # three cards, in a pool of two
            "user13/": ("deny", Reason.BUDGET_DENY),
        }
        assert outcomes["user11/"].reason.startswith("no H200 has 1 free")
        assert store.all() == before and pool.waiting == {}  # nothing placed, held or queued

        # A whole card waiting ahead: a quarter would now wait behind it, as a spawn then does.
        whole = asyncio.create_task(pool.acquire(request(2, Fraction(1))))
        await settle(pool)
        (previewed,) = (await asyncio.to_thread(pool.preview, [request(3)])).values()
        assert (previewed.action, previewed.code) == ("wait", Reason.NO_CAPACITY)
        quarter = asyncio.create_task(pool.acquire(request(3)))
        await settle(pool)
        assert not quarter.done() and pool.ticket("user3/").code is previewed.code
        pool.release("user1/")
        await asyncio.wait_for(whole, 30)
        (previewed,) = (await asyncio.to_thread(pool.preview, [request(4)])).values()
        assert previewed.action == "wait"  # both cards whole-held now, the quarter still waiting ahead
        quarter.cancel()
        # After a hub restart, until the requests that waited before it are back, every new one waits for them.
        pool.restoring = {"user9/": object()}
        (previewed,) = (await asyncio.to_thread(pool.preview, [request(5)])).values()
        assert (previewed.action, previewed.code) == ("wait", Reason.RESTART_ORDER)
        pool.restoring = {}

    run(scenario())


def decisions(action: str, reason: str) -> float:
    """`gpupool_admission_decisions_total{action, reason}` in this process's registry."""
    value = REGISTRY.get_sample_value("gpupool_admission_decisions_total", {"action": action, "reason": reason})
    return value or 0.0


def test_admission_wait_and_deny(store):
    def quota(req: Request, holdings: Holdings) -> Verdict:
        if req.team == "blocked":
            return Verdict("deny", "budget used up", code=Reason.BUDGET_DENY)
        held = holdings.team.get(req.team, 0)
        if held + req.share > Fraction(1, 2):
            return Verdict("wait", f"team holds {float(held)} of 0.5 GPUs", code=Reason.QUOTA_FULL)
        return Verdict("admit", code=Reason.WITHIN_QUOTA)

    async def scenario():
        pool = LocalPool(H200, store, decide=quota)
        await pool.acquire(request(0))
        await pool.acquire(request(1))
        third = asyncio.create_task(pool.acquire(request(2)))
        await settle(pool)
        assert pool.ticket("user2/").message().endswith("(team holds 0.5 of 0.5 GPUs)")
        assert pool.ticket("user2/").code is Reason.QUOTA_FULL
        waits_before = decisions("wait", "quota-full")
        for _ in range(2):
            pool.schedule()
            await pool.settled()
        assert decisions("wait", "quota-full") == waits_before, "a wait that goes on is counted once"
        with pytest.raises(Denied, match="budget used up") as refused:
            await pool.acquire(request(3, team="blocked"))
        assert refused.value.code is Reason.BUDGET_DENY
        pool.release("user0/")
        assert (await asyncio.wait_for(third, 30)).key == "user2/"

    run(scenario())


def test_a_request_larger_than_the_pool_fails_fast(store):
    async def scenario():
        pool = LocalPool(H200, store)
        before = decisions("deny", "never-fits-pool")
        with pytest.raises(Denied, match="can never fit") as refused:
            await pool.acquire(request(0, Fraction(3)))
        assert refused.value.code is Reason.NEVER_FITS_POOL
        assert decisions("deny", "never-fits-pool") == before + 1

    run(scenario())


class NVMLDouble:
    """A test double of `pynvml` (no NVIDIA driver here): two H200s and a card the policy does not know."""

    class NVMLError(Exception):
        pass

    devices = [("NVIDIA H200", "GPU-aaaa", 141), ("NVIDIA H200", "GPU-bbbb", 141), ("Tesla T4", "GPU-cccc", 16)]

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, i):
        return self.devices[i][0].encode()

    def nvmlDeviceGetUUID(self, i):
        return self.devices[i][1]

    def nvmlDeviceGetMemoryInfo(self, i):
        return type("Memory", (), {"total": self.devices[i][2] * 2**30})()


def test_nvml_inventory_through_a_double(monkeypatch):
    from gpupool.spawner.pool import discover_cards

    monkeypatch.setitem(sys.modules, "pynvml", NVMLDouble())
    cards, source = discover_cards(load_policy(DEFAULT_POLICY_DIR))
    assert source == "nvml"
    assert [(c.uuid, c.model, c.index) for c in cards] == [("GPU-aaaa", "H200", 0), ("GPU-bbbb", "H200", 1)]


def test_without_a_driver_the_declared_inventory_is_used():
    from gpupool.spawner.pool import discover_cards

    cards, source = discover_cards(load_policy(DEFAULT_POLICY_DIR))
    assert source == "declared" and len(cards) == 2


def test_queue_metrics(store):
    from prometheus_client import REGISTRY

    def length(team):
        return REGISTRY.get_sample_value("gpupool_queue_length", {"team": team})

    async def scenario():
        pool = LocalPool(H200, store)
        for n in range(2):
            await pool.acquire(request(n, Fraction(1), team="metrics"))
        waiting = [asyncio.create_task(pool.acquire(request(10 + n, team="metrics"))) for n in range(3)]
        await settle(pool)
        assert length("metrics") == 3
        before = REGISTRY.get_sample_value("gpupool_queue_wait_seconds_count", {"team": "metrics"})
        pool.release("user0/")
        await asyncio.wait_for(asyncio.gather(*waiting), 30)
        assert length("metrics") == 0
        assert REGISTRY.get_sample_value("gpupool_queue_wait_seconds_count", {"team": "metrics"}) == before + 3

    run(scenario())


def test_waiting_requests_come_back_in_their_order_after_a_restart(tmp_path):
    path = tmp_path / "allocations.sqlite"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # the running servers

    async def before_the_crash():
        pool = LocalPool(H200, AllocationStore(path, owner="hub-1"))
        for n in range(2):
            await pool.acquire(request(n, Fraction(1)))
            pool.store.mark_running(f"user{n}/", holder.pid)
        waiting = [asyncio.create_task(pool.acquire(request(n, Fraction(1)), options={"profile": f"p{n}"}))
                   for n in (10, 11, 12)]
        await settle(pool)
        assert [pool.ticket(f"user{n}/").position for n in (10, 11, 12)] == [1, 2, 3]
        # The hub goes down: its tasks are cancelled (or it is killed and nothing runs at all).
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)

    async def after_the_restart():
        pool = LocalPool(H200, AllocationStore(path, owner="hub-2"))
        assert [q.request.key for q in sorted(pool.restoring.values(), key=lambda q: q.seq)] == [
            "user10/", "user11/", "user12/"]
        assert pool.restoring["user11/"].options == {"profile": "p11"}
        # asked for again in another order: each keeps its place
        later = [asyncio.create_task(pool.acquire(request(n, Fraction(1)), options={"profile": f"p{n}"})) for n in (12, 11)]
        await settle(pool)
        pool.release("user0/")  # a card frees up before user10 is back: it is kept for user10
        await settle(pool)
        assert not any(t.done() for t in later)
        assert pool.ticket("user12/").reason == "requests queued before the hub restarted come first"
        first = asyncio.create_task(pool.acquire(request(10, Fraction(1)), options={"profile": "p10"}))
        assert (await asyncio.wait_for(first, 30)).key == "user10/"
        assert [pool.ticket(f"user{n}/").position for n in (11, 12)] == [1, 2]
        pool.release("user1/")
        assert (await asyncio.wait_for(later[1], 30)).key == "user11/"
        assert [q.request.key for q in pool.store.queued()] == ["user12/"]
        later[0].cancel()
        await asyncio.gather(later[0], return_exceptions=True)
        pool.forget("user12/")  # its user cancelled it: it does not come back
        assert pool.store.queued() == []

    try:
        asyncio.run(before_the_crash())
        asyncio.run(after_the_restart())
    finally:
        holder.kill()


def test_a_request_that_cannot_come_back_is_kept_with_its_reason(store):
    async def scenario():
        pool = LocalPool(H200, store)
        for n in range(2):
            await pool.acquire(request(n, Fraction(1)))
        task = asyncio.create_task(pool.acquire(request(5)))
        await settle(pool)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    run(scenario())
    store.mark_lost("user5/", "No such profile: 'gone'")
    (lost,) = store.lost("user5")
    assert lost.lost == "No such profile: 'gone'" and store.queued() == []
    assert LocalPool(H200, AllocationStore(store.engine.url.database, owner="other")).restoring == {}


def test_a_pass_runs_off_the_event_loop_and_gives_back_a_placement_whose_request_left(store):
    """The door (the ledger's transaction in a hub) runs in the pass's worker thread: the event loop goes on
    meanwhile, and a request cancelled while the pass places it gets neither its cards nor its holding."""
    in_the_door, go_on = threading.Event(), threading.Event()
    given_back: list[Request] = []

    def hold(req: Request) -> Verdict:
        in_the_door.set()
        assert go_on.wait(30), "the test never let the door go on"
        return Verdict("admit", code=Reason.WITHIN_QUOTA)

    async def scenario():
        pool = LocalPool(H200, store, hold=hold, unhold=given_back.append)
        task = asyncio.create_task(pool.acquire(replace(request(0), holding="user0/@1")))
        assert await asyncio.to_thread(in_the_door.wait, 30)
        # The pass is inside the door, in its thread; this coroutine runs (a blocked loop could not get here).
        assert pool.ticket("user0/").future.done() is False
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert store.get("user0/") is not None, "the pass has reserved the cards and is still in the door"
        go_on.set()
        await pool.settled()
        assert store.get("user0/") is None
        assert [r.holding for r in given_back] == ["user0/@1"]
        assert not pool.waiting

    run(scenario())


def test_a_request_cancelled_as_it_is_placed_is_cancelled_and_gives_its_share_back(store):
    """Python 3.11's `asyncio.wait_for` returns what it waited for when a cancel comes in the same instant, and
    drops the cancel: the spawn its user stopped would start anyway (and JupyterHub's stop answer a 500)."""
    given_back: list[Request] = []

    async def scenario():
        pool = LocalPool(H200, store, hold=lambda req: Verdict("admit", code=Reason.WITHIN_QUOTA),
                         unhold=given_back.append)
        holders = [await pool.acquire(replace(request(n, Fraction(1)), holding=f"user{n}/@1")) for n in range(2)]
        # With a queue timeout, as a hub's spawn waits (without one `wait_for` awaits directly and keeps the cancel).
        task = asyncio.create_task(pool.acquire(replace(request(5), holding="user5/@1"), timeout=3600))
        await settle(pool)
        # Cancelled by the first callback after its placement, before the acquire runs again.
        pool.ticket("user5/").future.add_done_callback(lambda _: task.cancel())
        pool.release(holders[0].key)
        (outcome,) = await asyncio.gather(task, return_exceptions=True)
        assert isinstance(outcome, asyncio.CancelledError), outcome
        await pool.settled()
        assert [a.key for a in store.all()] == ["user1/"]
        assert [r.holding for r in given_back] == ["user5/@1"]
        assert not pool.waiting and store.queued() == []

    run(scenario())


def test_a_request_through_the_door_needs_its_holding_key(store):
    async def scenario():
        pool = LocalPool(H200, store, hold=lambda req: Verdict("admit", code=Reason.WITHIN_QUOTA))
        with pytest.raises(ValueError, match="no holding key"):
            await pool.acquire(request(0))
        assert store.all() == [] and store.queued() == []

    run(scenario())


def test_a_failing_pass_keeps_the_queue_waiting_with_the_reason_then_goes_on(store, monkeypatch):
    import gpupool.spawner.pool as pool_module

    monkeypatch.setattr(pool_module, "PASS_RETRY_S", 0.01)
    tries: list[str] = []
    seen = threading.Event()  # the test has seen the failure on the ticket

    def hold(req: Request) -> Verdict:
        tries.append(req.key)
        if len(tries) == 1:
            raise ConnectionError("the ledger is unreachable")  # e.g. PostgreSQL restarting
        assert seen.wait(30)
        return Verdict("admit", code=Reason.WITHIN_QUOTA)

    async def scenario():
        pool = LocalPool(H200, store, hold=hold)
        task = asyncio.create_task(pool.acquire(replace(request(0), holding="user0/@1")))
        await asyncio.sleep(0)
        ticket = pool.ticket("user0/")
        await asyncio.wait_for(ticket.changed.wait(), 30)  # the first news of it is the failed pass
        assert ticket.message() == ('Waiting for 1/4 × H200: in queue "vision" '
                                    "(the queue cannot be decided now (ConnectionError); retrying)")
        assert not task.done()
        seen.set()
        allocation = await asyncio.wait_for(task, 30)
        assert allocation.key == "user0/" and tries == ["user0/", "user0/"]
        assert [a.key for a in store.all()] == ["user0/"], "the failed try left no reservation behind"

    run(scenario())
