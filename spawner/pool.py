"""The embedded GPU pool: cards, a persistent allocator that never over-commits a card, and the wait queue.

Nothing here knows about JupyterHub: the local spawner (and later training jobs) ask the pool for a share
with `acquire()`, which waits in the team's queue until the share fits and the admission decision says
`admit`, and give it back with `release()`. Allocations live in SQLite, written in `BEGIN IMMEDIATE`
transactions, so a hub restart keeps the allocations of running servers and two writers can never place
more than a card holds.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path
from typing import Literal

import psutil
import sqlalchemy as sa
from gpupool.hub.accounting.db import create_engine, writer
from gpupool.policies.admission import Holdings, Reason, format_share
from gpupool.policies.model import Policy
from gpupool.policies.placement import Placement, choose_cards
from gpupool.spawner.metrics import QUEUE_LENGTH, QUEUE_WAIT, count_decision

log = logging.getLogger("gpupool.pool")
#: Seconds between tries of a pass of the queue that failed (the ledger unreachable).
PASS_RETRY_S = 1.0
BEST_FIT = Placement("best-fit")


# --- cards ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Card:
    uuid: str
    model: str
    index: int
    memory_gib: int


def declared_cards(policy: Policy) -> list[Card]:
    """The cards of the policy's `inventory`, with stable made-up UUIDs when none are declared."""
    cards: list[Card] = []
    for declared in policy.inventory:
        memory = policy.models[declared.model].memory_gib
        for i in range(declared.count):
            uuid = declared.uuids[i] if declared.uuids else f"GPU-declared-{declared.model}-{i}"
            cards.append(Card(uuid, declared.model, len(cards), memory))
    return cards


def nvml_cards(policy: Policy) -> list[Card] | None:
    """The cards NVML reports, matched to policy models by name; None when there is no NVIDIA driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        cards = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            memory_gib = pynvml.nvmlDeviceGetMemoryInfo(handle).total // 2**30
            model = match_model(name, policy)
            if model is None:
                log.warning("GPU %d (%s) matches no model in the policy; it is not part of the pool", index, name)
                continue
            cards.append(Card(uuid, model, index, int(memory_gib)))
        return cards
    finally:
        pynvml.nvmlShutdown()


def match_model(nvml_name: str, policy: Policy) -> str | None:
    """The policy model an NVML device name such as `NVIDIA H200` or `NVIDIA A100-SXM4-80GB` stands for."""
    normalized = nvml_name.replace(" ", "-").upper()
    for name, model in policy.models.items():
        if model.product and model.product.upper() == normalized:
            return name
    for name in sorted(policy.models, key=len, reverse=True):
        parts = name.upper().split("-")
        if all(part in normalized for part in parts):
            return name
    return None


def discover_cards(policy: Policy) -> tuple[list[Card], Literal["nvml", "declared"]]:
    """The pool's cards: NVML's when a driver is present, else the policy's declared inventory."""
    found = nvml_cards(policy)
    if found:
        return found, "nvml"
    return declared_cards(policy), "declared"


# --- placement (pure) -------------------------------------------------------------------------------


def place(cards: Iterable[Card], used: dict[str, Fraction], model: str, share: Fraction,
          placement: Placement = BEST_FIT) -> tuple[str, ...] | None:
    """Cards for `share` of `model` as `placement` chooses them (`policies.placement`); None if it does not fit.

    Best fit (the fullest card that still has room) keeps whole cards free for whole-card requests; whole
    cards go on the first free cards.
    """
    candidates = sorted((c for c in cards if c.model == model), key=lambda c: c.index)
    chosen = choose_cards([1 - used.get(c.uuid, Fraction(0)) for c in candidates], share, placement)
    return None if chosen is None else tuple(candidates[i].uuid for i in chosen)


# --- the persistent allocation store ---------------------------------------------------------------

metadata = sa.MetaData()
allocations_table = sa.Table(
    "allocations",
    metadata,
    sa.Column("key", sa.String, primary_key=True),  # "user/server"
    sa.Column("card", sa.String, primary_key=True),
    sa.Column("user", sa.String, nullable=False),
    sa.Column("team", sa.String, nullable=False),
    sa.Column("profile", sa.String, nullable=False),
    sa.Column("model", sa.String, nullable=False),
    sa.Column("share_num", sa.Integer, nullable=False),  # share of this card, exactly
    sa.Column("share_den", sa.Integer, nullable=False),
    sa.Column("state", sa.String, nullable=False),  # reserved | running
    sa.Column("owner", sa.String, nullable=False),  # the pool instance that reserved it
    sa.Column("pid", sa.Integer),
    sa.Column("pid_started", sa.Float),  # process start time, so a reused PID is not taken for the server
    sa.Column("created", sa.Float, nullable=False),
)


#: Requests waiting in the queue, so that a hub restart (a crash included) brings them back in the same order.
queue_table = sa.Table(
    "queue",
    metadata,
    sa.Column("key", sa.String, primary_key=True),  # "user/server"
    sa.Column("seq", sa.Integer, nullable=False),  # arrival order, kept across restarts
    sa.Column("user", sa.String, nullable=False),
    sa.Column("team", sa.String, nullable=False),
    sa.Column("profile", sa.String, nullable=False),
    sa.Column("display_name", sa.String, nullable=False),
    sa.Column("model", sa.String, nullable=False),
    sa.Column("share_num", sa.Integer, nullable=False),
    sa.Column("share_den", sa.Integer, nullable=False),
    sa.Column("priority", sa.Integer, nullable=False),
    sa.Column("options", sa.JSON, nullable=False),  # the checked user_options, to ask the hub for it again
    sa.Column("owner", sa.String, nullable=False),  # the pool instance it waits in
    sa.Column("queued_at", sa.Float, nullable=False),
    sa.Column("lost", sa.String),  # why it could not come back after a restart (shown to its user)
)


@dataclass(frozen=True)
class Queued:
    """A persisted queue entry: the request, its arrival order and what to ask the hub for again."""

    request: Request
    seq: int
    options: dict
    owner: str
    queued_at: float
    lost: str | None = None


@dataclass(frozen=True)
class Allocation:
    key: str
    user: str
    team: str
    profile: str
    model: str
    share: Fraction
    cards: tuple[str, ...]
    state: str = "reserved"
    pid: int | None = None
    pid_started: float | None = None


def process_alive(pid: int | None, started: float | None) -> bool:
    """Whether `pid` is still the process that was started at `started` (not a reused PID)."""
    if pid is None:
        return False
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return started is None or abs(process.create_time() - started) < 0.01
    except psutil.Error:
        return False


def process_start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


class AllocationStore:
    """Allocations in SQLite; every placement is decided and written inside one `BEGIN IMMEDIATE`."""

    def __init__(self, path: str | Path, owner: str | None = None):
        # The ledger's SQLite set-up (WAL, busy timeout), with every transaction BEGIN IMMEDIATE: a placement
        # reads the cards' use and writes the allocation under one write lock.
        self.engine = writer(create_engine(f"sqlite:///{path}"))
        self.owner = owner or f"{os.getpid()}-{time.time_ns()}"
        metadata.create_all(self.engine)

    def all(self) -> list[Allocation]:
        with self.engine.begin() as db:
            rows = db.execute(sa.select(allocations_table).order_by(allocations_table.c.created)).all()
        return _group(rows)

    def used(self) -> dict[str, Fraction]:
        used: dict[str, Fraction] = {}
        for a in self.all():
            for card in a.cards:
                used[card] = used.get(card, Fraction(0)) + (a.share if a.share < 1 else 1)
        return used

    def reserve(self, request: Request, cards: list[Card], placement: Placement = BEST_FIT) -> Allocation | None:
        """Place and record `request` atomically; None when it does not fit (nothing written)."""
        with self.engine.begin() as db:
            rows = db.execute(sa.select(allocations_table)).all()
            if any(row.key == request.key for row in rows):
                raise ValueError(f"{request.key} already holds an allocation")
            used: dict[str, Fraction] = {}
            for row in rows:
                used[row.card] = used.get(row.card, Fraction(0)) + Fraction(row.share_num, row.share_den)
            chosen = place(cards, used, request.model, request.share, placement)
            if chosen is None:
                return None
            per_card = request.share if request.share < 1 else Fraction(1)
            now = time.time()
            db.execute(
                allocations_table.insert(),
                [
                    {
                        "key": request.key, "card": uuid, "user": request.user, "team": request.team,
                        "profile": request.profile, "model": request.model,
                        "share_num": per_card.numerator, "share_den": per_card.denominator,
                        "state": "reserved", "owner": self.owner, "created": now,
                    }
                    for uuid in chosen
                ],
            )
        return Allocation(request.key, request.user, request.team, request.profile, request.model,
                          request.share, chosen)

    def mark_running(self, key: str, pid: int) -> None:
        with self.engine.begin() as db:
            db.execute(
                allocations_table.update()
                .where(allocations_table.c.key == key)
                .values(state="running", pid=pid, pid_started=process_start_time(pid))
            )

    def release(self, key: str) -> bool:
        with self.engine.begin() as db:
            return db.execute(allocations_table.delete().where(allocations_table.c.key == key)).rowcount > 0

    def get(self, key: str) -> Allocation | None:
        return next((a for a in self.all() if a.key == key), None)

    def sweep(self) -> list[Allocation]:
        """Free what no live server holds: reservations of an earlier pool process, dead or reused PIDs."""
        freed = []
        with self.engine.begin() as db:
            for allocation in _group(db.execute(sa.select(allocations_table)).all()):
                stale_reservation = allocation.state == "reserved" and self._owner_of(db, allocation.key) != self.owner
                dead = allocation.state == "running" and not process_alive(allocation.pid, allocation.pid_started)
                if stale_reservation or dead:
                    db.execute(allocations_table.delete().where(allocations_table.c.key == allocation.key))
                    freed.append(allocation)
        return freed

    # --- the persistent queue -------------------------------------------------------------------------

    def enqueue(self, request: Request, options: dict, first: bool = False) -> Queued:
        """Record that `request` waits; a request already recorded (back after a restart) keeps its place.

        `first`: at the head of the queue (before every request recorded now), for work that was preempted:
        it goes back ahead of the others of its priority (the queue orders by priority first)."""
        with self.engine.begin() as db:
            row = db.execute(sa.select(queue_table).where(queue_table.c.key == request.key)).first()
            if row is not None and row.lost is None:
                db.execute(queue_table.update().where(queue_table.c.key == request.key).values(owner=self.owner))
                return replace(_queued(row), request=request, owner=self.owner)
            db.execute(queue_table.delete().where(queue_table.c.key == request.key))
            if first:
                seq = (db.execute(sa.select(sa.func.min(queue_table.c.seq))).scalar() or 1) - 1
            else:
                seq = (db.execute(sa.select(sa.func.max(queue_table.c.seq))).scalar() or 0) + 1
            entry = Queued(request, seq, dict(options), self.owner, time.time())
            db.execute(queue_table.insert().values(
                key=request.key, seq=seq, user=request.user, team=request.team, profile=request.profile,
                display_name=request.display_name, model=request.model, share_num=request.share.numerator,
                share_den=request.share.denominator, priority=request.priority, options=entry.options,
                owner=self.owner, queued_at=entry.queued_at,
            ))
        return entry

    def dequeue(self, key: str, only_mine: bool = False) -> bool:
        """The request `key` no longer waits (placed, refused, timed out, cancelled by its user)."""
        query = queue_table.delete().where(queue_table.c.key == key, queue_table.c.lost.is_(None))
        if only_mine:
            query = query.where(queue_table.c.owner == self.owner)
        with self.engine.begin() as db:
            return db.execute(query).rowcount > 0

    def queued(self) -> list[Queued]:
        """Every waiting request, in arrival order (lost ones left out)."""
        with self.engine.begin() as db:
            rows = db.execute(sa.select(queue_table).where(queue_table.c.lost.is_(None))
                              .order_by(queue_table.c.seq)).all()
        return [_queued(row) for row in rows]

    def mark_lost(self, key: str, reason: str) -> None:
        with self.engine.begin() as db:
            db.execute(queue_table.update().where(queue_table.c.key == key).values(lost=reason[:500]))

    def lost(self, user: str) -> list[Queued]:
        """`user`'s requests that could not come back after a restart, and why."""
        with self.engine.begin() as db:
            rows = db.execute(sa.select(queue_table).where(queue_table.c.user == user,
                                                           queue_table.c.lost.is_not(None))
                              .order_by(queue_table.c.seq)).all()
        return [_queued(row) for row in rows]

    @staticmethod
    def _owner_of(db: sa.Connection, key: str) -> str:
        return db.execute(
            sa.select(allocations_table.c.owner).where(allocations_table.c.key == key).limit(1)
        ).scalar_one()


def _queued(row: sa.Row) -> Queued:
    request = Request(row.key, row.user, row.team, row.profile, row.display_name, row.model,
                      Fraction(row.share_num, row.share_den), row.priority)
    return Queued(request, row.seq, dict(row.options or {}), row.owner, row.queued_at, row.lost)


def _group(rows: Iterable[sa.Row]) -> list[Allocation]:
    by_key: dict[str, Allocation] = {}
    for row in rows:
        per_card = Fraction(row.share_num, row.share_den)
        if row.key in by_key:
            a = by_key[row.key]
            by_key[row.key] = replace(a, share=a.share + per_card, cards=a.cards + (row.card,))
        else:
            by_key[row.key] = Allocation(row.key, row.user, row.team, row.profile, row.model, per_card,
                                         (row.card,), row.state, row.pid, row.pid_started)
    return list(by_key.values())


# --- requests, holdings and the queue ------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    key: str
    user: str
    team: str
    profile: str
    display_name: str
    model: str
    share: Fraction
    priority: int = 0
    #: The ledger key the door holds its share under once admitted, new for every start (a server's run key);
    #: required when the pool has a door, "" when it has none.
    holding: str = ""


@dataclass(frozen=True)
class Verdict:
    """The admission decision for one request given the current holdings."""

    action: Literal["admit", "wait", "deny"]
    reason: str = ""
    priority: int | None = None  # overrides the request's priority (deprioritized work)
    code: Reason = field(kw_only=True)  # the decision's reason code (admission.Reason)


#: Admission: given a request and what is held, may it start now? (The accounting plugs in here.) Pure: the
#: queue asks it to order and explain what waits.
Decide = Callable[[Request, Holdings], Verdict]
#: The door: decide `request` again and hold its share, in one transaction (`Ledger.admit`), as it is placed.
Hold = Callable[[Request], Verdict]


def admit_all(request: Request, holdings: Holdings) -> Verdict:
    return Verdict("admit", code=Reason.WITHIN_QUOTA)


class Refused(Exception):
    """The queue gave up on a request: `code` says why (a `Reason`), the message says it for people."""

    def __init__(self, message: str, code: Reason):
        super().__init__(message)
        self.code = code


class QueueTimeout(Refused):
    def __init__(self, message: str):
        super().__init__(message, Reason.QUEUE_TIMEOUT)


class Denied(Refused):
    pass


@dataclass
class Ticket:
    request: Request
    seq: int
    arrived: float
    future: asyncio.Future[Allocation]
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    position: int = 0
    of: int = 0
    reason: str = ""
    code: Reason | None = None  # why it waits, once a pass of the queue has looked at it
    last_message: str = ""

    def message(self) -> str:
        r = self.request
        where = f"position {self.position} of {self.of} in " if self.of else "in "  # 0: no pass has looked at it
        return f'Waiting for {r.display_name}: {where}queue "{r.team}"' + (f" ({self.reason})" if self.reason else "")

    @property
    def news(self) -> bool:
        """Whether there is anything to tell its user: a pass gave it a place in the queue, or a reason."""
        return bool(self.of or self.reason)


class LocalPool:
    """One machine's cards, the allocation store and the wait queue, shared by all spawns of a hub."""

    def __init__(self, cards: list[Card], store: AllocationStore, decide: Decide = admit_all,
                 placement: Callable[[str], Placement] = lambda model: BEST_FIT, *,
                 holdings: Callable[[], Holdings] | None = None, hold: Hold | None = None,
                 unhold: Callable[[Request], None] | None = None):
        """`decide` orders and explains the queue against `holdings()` (what is held against the quotas: the
        ledger's holdings in a hub; the store's allocations by default); `hold`, when given, is the door each
        placement goes through: a refusal there gives the cards back and the request waits (or is denied).
        `unhold` ends, unbilled, the holding the door made for a request that left the queue while the pass
        placing it ran."""
        self.cards = cards
        self.store = store
        self.decide = decide
        self.holdings = holdings or (lambda: Holdings.of(self.store.all()))
        self.hold = hold
        self.unhold = unhold
        self._wanted = False  # a pass of the queue was asked for since the last one began
        self._passes: asyncio.Task | None = None  # the task running passes, one at a time
        self.placement = placement  # per model, read at each placement (policies reload)
        self.waiting: dict[str, Ticket] = {}
        self.devices_are_real = False  # True when the cards came from NVML
        self._queued_teams: set[str] = set()
        freed = store.sweep()
        for allocation in freed:
            log.warning("freed %s's share of %s: its server is gone", allocation.key, allocation.model)
        #: Requests that waited in an earlier pool (before a hub restart), until they are asked for again: none
        #: queued after them is placed before they are back, so the queue keeps its order.
        self.restoring: dict[str, Queued] = {q.request.key: q for q in store.queued() if q.owner != store.owner}
        if self.restoring:
            log.warning("%d request(s) waited in the queue before the restart: %s", len(self.restoring),
                        ", ".join(self.restoring))

    def capacity(self, model: str) -> int:
        return sum(1 for c in self.cards if c.model == model)

    def preview(self, asked: list[Request]) -> dict[str, Outcome]:
        """What the queue would do now with each request of `asked` if it alone arrived now, behind everything
        waiting: `place` (it would start at once), `wait` (with the code and reason a spawn would then show) or
        `deny`. Nothing is placed, held or written: the same pass (`admit_in_order`) on a copy of the cards'
        use, through the same decisions, without the door's write. The spawn page's availability.

        Blocking (reads the allocation store and the ledger): call it from a thread, not the event loop.
        """
        if self.restoring:  # requests from before a hub restart come first, and some are not back yet
            return {request.key: Outcome(request.key, "wait", Reason.RESTART_ORDER,
                                         "requests queued before the hub restarted come first") for request in asked}
        used = self.store.used()
        holdings = self.holdings()
        pending = [(t.request, t.seq) for t in list(self.waiting.values()) if not t.future.done()]
        after = max((seq for _, seq in pending), default=0) + 1
        outcomes: dict[str, Outcome] = {}
        for request in asked:
            if request.share > self.capacity(request.model):
                outcomes[request.key] = Outcome(request.key, "deny", Reason.NEVER_FITS_POOL, (
                    f"{request.display_name} can never fit: the pool has {self.capacity(request.model)} "
                    f"{request.model} card(s)"))
                continue
            trial = dict(used)

            def reserve(candidate: Request, trial=trial) -> Allocation | None:
                chosen = place(self.cards, trial, candidate.model, candidate.share, self.placement(candidate.model))
                if chosen is None:
                    return None
                for card in chosen:
                    trial[card] = trial.get(card, Fraction(0)) + min(candidate.share, Fraction(1))
                return Allocation(candidate.key, candidate.user, candidate.team, candidate.profile, candidate.model,
                                  candidate.share, chosen)

            done, _ = admit_in_order([*pending, (request, after)], holdings, self.decide, reserve, self.capacity)
            outcomes[request.key] = next(o for o in done if o.key == request.key)
        return outcomes

    async def acquire(self, request: Request, timeout: float | None = None, options: dict | None = None,
                      first: bool = False) -> Allocation:
        """Wait in the team's queue until `request` is admitted and placed; the allocation is recorded.

        While it waits the request is persisted with `options` (what to ask the hub for again after a
        restart). It leaves the persisted queue when placed, refused or timed out, and when its user cancels
        (`forget`); a cancellation by a hub that is going down leaves it there, to come back. `first`: it
        goes back to the head of its priority (preempted work).
        """
        if request.share > self.capacity(request.model):
            count_decision(Reason.NEVER_FITS_POOL)
            raise Denied(
                f"{request.display_name} can never fit: the pool has {self.capacity(request.model)} "
                f"{request.model} card(s)", Reason.NEVER_FITS_POOL,
            )
        if request.key in self.waiting:
            raise ValueError(f"{request.key} is already waiting")
        if self.hold is not None and not request.holding:
            raise ValueError(f"{request.key} has no holding key: the door holds its share under one, new per start")
        # A new spawn of the same server: whatever that server held before is no longer in use.
        if self.store.release(request.key):
            log.warning("%s held an allocation from an earlier start; freed it", request.key)
        loop = asyncio.get_running_loop()
        entry = self.store.enqueue(request, options or {}, first=first)
        self.restoring.pop(request.key, None)
        waited = max(0.0, time.time() - entry.queued_at)  # back after a restart: it has waited since then
        ticket = Ticket(request, entry.seq, time.monotonic() - waited, loop.create_future())
        self.waiting[request.key] = ticket
        left = True  # whether the request leaves the persisted queue when this call ends

        def placed() -> bool:
            future = ticket.future
            return future.done() and not future.cancelled() and future.exception() is None

        try:
            self.schedule()
            allocation = await asyncio.wait_for(asyncio.shield(ticket.future), timeout)
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # Cancelled in the instant it was placed: Python 3.11's `wait_for` then returns the result and
                # drops the cancel. Its user stopped it (the server would start anyway): the share goes back.
                raise asyncio.CancelledError
            return allocation
        except TimeoutError:
            if placed():  # placed in the same instant the timeout fired
                return ticket.future.result()
            count_decision(Reason.QUEUE_TIMEOUT)
            raise QueueTimeout(
                f"Gave up waiting for {request.display_name} after {timeout:.0f} s in queue "
                f'"{request.team}" (the queue timeout of the policy); {ticket.reason or "the pool stayed full"}'
            ) from None
        except asyncio.CancelledError:
            if placed():  # cancelled just as it was placed: give the share (and the door's holding) back
                self._give_back([request])
            else:
                left = False  # its user's cancel is `forget`; a hub going down keeps it for the restart
            raise
        finally:
            if not ticket.future.done():
                ticket.future.cancel()
            self.waiting.pop(request.key, None)
            if left:
                self.store.dequeue(request.key)
            self.schedule()

    def forget(self, key: str) -> None:
        """The request `key` of this pool was cancelled by its user: it does not come back after a restart."""
        if key not in self.waiting:
            self.store.dequeue(key, only_mine=True)

    def restored(self) -> None:
        """Every request from before the restart was asked for again (or given up): the queue moves on."""
        self.restoring.clear()
        self.schedule()

    def release(self, key: str) -> bool:
        freed = self.store.release(key)
        self.schedule()
        return freed

    def ticket(self, key: str) -> Ticket | None:
        return self.waiting.get(key)

    def schedule(self) -> None:
        """Ask for a pass of the queue: admit and place what can start, in order of priority then arrival.

        It returns at once. Passes run one at a time in a task of the event loop; each reads and writes the
        allocation store and the ledger (holdings, the door) in a worker thread, so the hub's event loop never
        waits on SQL, and applies what it decided to the tickets back on the loop. Asked again while one runs,
        one more pass follows it. `settled()` waits for them.
        """
        self._wanted = True
        self._count_queue_lengths()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a script giving a share back): nothing of this process waits
            return
        if self._passes is None or self._passes.done() or self._passes.get_loop() is not loop:
            self._passes = loop.create_task(self._run_passes())

    async def settled(self) -> None:
        """Wait until the passes asked for so far have run and their outcomes are applied."""
        while self._passes is not None and not self._passes.done():
            await asyncio.shield(self._passes)

    async def _run_passes(self) -> None:
        failing = False
        while self._wanted:
            self._wanted = False
            pending = [t for t in self.waiting.values() if not t.future.done()]
            try:
                if pending:
                    await self._pass(pending)
                failing = False
            except Exception as error:  # the ledger or the store unreachable: the queue waits, saying why
                if not failing:
                    log.exception("a pass of the queue failed; trying again every %s s", PASS_RETRY_S)
                failing = True
                for ticket in pending:
                    if not ticket.future.done():
                        ticket.reason = f"the queue cannot be decided now ({type(error).__name__}); retrying"
                        ticket.changed.set()
                await asyncio.sleep(PASS_RETRY_S)
                self._wanted = True
            self._count_queue_lengths()

    def _count_queue_lengths(self) -> None:
        waiting = [t.request.team for t in self.waiting.values() if not t.future.done()]
        self._queued_teams.update(waiting)
        for team in self._queued_teams:
            QUEUE_LENGTH.labels(team).set(waiting.count(team))

    def _place(self, request: Request) -> Allocation | Verdict | None:
        """Cards for `request` (None: none free), through the door when there is one (its refusal, if it refuses)."""
        allocation = self.store.reserve(request, self.cards, self.placement(request.model))
        if allocation is None or self.hold is None:
            return allocation
        try:
            verdict = self.hold(request)
        except Exception:
            self.store.release(request.key)
            raise
        if verdict.action != "admit":  # another process took the last of the quota, or the budget ran out
            self.store.release(request.key)
            return verdict
        return allocation

    def _give_back(self, requests: list[Request]) -> None:
        """Requests placed by a pass after they left the queue (timed out, cancelled): their cards and holdings."""
        for request in requests:
            self.store.release(request.key)
            if self.hold is not None and self.unhold is not None:
                self.unhold(request)
            log.info("%s left the queue while it was being placed; its share is given back", request.key)

    @staticmethod
    def _waits(ticket: Ticket, code: Reason) -> None:
        """`ticket` waits for reason `code`: counted when the reason is new for it, not at every pass."""
        if ticket.code != code:
            ticket.code = code
            count_decision(code)

    async def _pass(self, pending: list[Ticket]) -> None:
        # Requests queued before the hub restarted, and not yet back, come first: later ones wait for them.
        first_restoring = min((q.seq for q in self.restoring.values()), default=None)
        held_back = [t for t in pending if first_restoring is not None and t.seq > first_restoring]
        for ticket in held_back:
            ticket.reason = "requests queued before the hub restarted come first"
            self._waits(ticket, Reason.RESTART_ORDER)
        pending = [t for t in pending if t not in held_back]
        by_key = {t.request.key: t for t in pending}  # the tickets themselves: one that leaves meanwhile is not found
        asked = [(t.request, t.seq) for t in pending]
        outcomes, still_keys = await asyncio.to_thread(
            lambda: admit_in_order(asked, self.holdings(), self.decide, self._place, self.capacity))
        left: list[Request] = []
        for outcome in outcomes:
            ticket = by_key[outcome.key]
            if ticket.future.done():  # it left the queue (timed out, cancelled) while this pass ran
                if outcome.action == "place":
                    left.append(ticket.request)
                continue
            if outcome.action == "deny":
                count_decision(outcome.code)
                ticket.future.set_exception(Denied(outcome.reason, outcome.code))
            elif outcome.action == "wait":
                ticket.reason = outcome.reason
                self._waits(ticket, outcome.code)
            else:
                count_decision(outcome.code)
                QUEUE_WAIT.labels(ticket.request.team).observe(time.monotonic() - ticket.arrived)
                ticket.future.set_result(outcome.allocation)
        if left:
            await asyncio.to_thread(self._give_back, left)
            self._wanted = True  # what they would have held is free again
        still = [t for t in (by_key[key] for key in still_keys) if not t.future.done()] + held_back
        queue_lengths = Counter(t.request.team for t in still)
        positions: Counter[str] = Counter()
        for ticket in still:
            positions[ticket.request.team] += 1
            ticket.position, ticket.of = positions[ticket.request.team], queue_lengths[ticket.request.team]
            if ticket.message() != ticket.last_message:
                ticket.last_message = ticket.message()
                ticket.changed.set()


# --- the queue's pass (pure) -----------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What one pass of the queue did with one waiting request."""

    key: str
    action: Literal["place", "wait", "deny"]
    code: Reason
    reason: str = ""
    allocation: Allocation | None = None


def queue_order(request: Request, seq: int, verdict: Verdict | None) -> tuple[int, int]:
    """Priority first (a verdict's priority overrides the request's), then arrival."""
    priority = verdict.priority if verdict and verdict.priority is not None else request.priority
    return (-priority, seq)


def capacity_reason(request: Request, holdings: Holdings, capacity: int) -> str:
    held = sum((s for (_, model), s in holdings.team_model.items() if model == request.model), Fraction(0))
    return (f"no {request.model} has {format_share(request.share)} free: "
            f"{format_share(held)} of {capacity} allocated")


def holding_more(holdings: Holdings, allocation: Allocation) -> Holdings:
    """`holdings` and `allocation` (what `Holdings.of` would give for both, without recounting the rest)."""
    a, share = allocation, allocation.share
    team, team_model, team_user = dict(holdings.team), dict(holdings.team_model), dict(holdings.team_user)
    team[a.team] = team.get(a.team, Fraction(0)) + share
    team_model[a.team, a.model] = team_model.get((a.team, a.model), Fraction(0)) + share
    team_user[a.team, a.user] = team_user.get((a.team, a.user), Fraction(0)) + share
    return Holdings(team, team_model, team_user)


def admit_in_order(
    pending: list[tuple[Request, int]],
    holdings: Holdings,
    decide: Decide,
    reserve: Callable[[Request], Allocation | Verdict | None],
    capacity: Callable[[str], int],
) -> tuple[list[Outcome], list[str]]:
    """One pass of the queue: admit and place what can start, in order of priority then arrival.

    `pending` are the waiting requests with their arrival numbers, `holdings` what is held now, and
    `reserve` places a request (None when it does not fit; a verdict when the door refused it as it was
    placed, which then stands for this pass). The pool calls this with its allocation store and the ledger's door;
    `gpupool replay` with an in-memory one, so that both make the same decisions. Returns what happened to
    each request, and the keys still waiting in queue order.
    """
    # Verdicts first, because a deprioritized request queues behind everyone else.
    verdicts = {request.key: decide(request, holdings) for request, _ in pending}
    blocked_models: set[str] = set()
    placed = False
    outcomes: list[Outcome] = []
    reasons: dict[tuple[int, str, Fraction], str] = {}  # a long queue asks the same question many times
    version = 0  # of the holdings: a placement changes them

    def full(request: Request) -> str:
        asked = (version, request.model, request.share)
        if asked not in reasons:
            reasons[asked] = capacity_reason(request, holdings, capacity(request.model))
        return reasons[asked]

    for request, seq in sorted(pending, key=lambda p: queue_order(p[0], p[1], verdicts[p[0].key])):
        if placed:  # holdings changed since the first pass: decide again
            verdicts[request.key] = decide(request, holdings)
        verdict = verdicts[request.key]
        if verdict.action == "deny":
            outcomes.append(Outcome(request.key, "deny", verdict.code, verdict.reason))
            continue
        if verdict.action == "wait":
            outcomes.append(Outcome(request.key, "wait", verdict.code, verdict.reason))
            continue
        if request.model in blocked_models:
            outcomes.append(Outcome(request.key, "wait", Reason.NO_CAPACITY, full(request)))
            continue
        allocation = reserve(request)
        if isinstance(allocation, Verdict):
            verdicts[request.key] = allocation
            outcomes.append(Outcome(request.key, "deny" if allocation.action == "deny" else "wait", allocation.code,
                                    allocation.reason))
            continue
        if allocation is None:
            # An earlier request that does not fit keeps later ones of the same model from overtaking it.
            blocked_models.add(request.model)
            outcomes.append(Outcome(request.key, "wait", Reason.NO_CAPACITY, full(request)))
            continue
        holdings = holding_more(holdings, allocation)
        version += 1
        placed = True
        outcomes.append(Outcome(request.key, "place", verdict.code, allocation=allocation))
    done = {o.key for o in outcomes if o.action != "wait"}
    still = sorted((p for p in pending if p[0].key not in done),
                   key=lambda p: queue_order(p[0], p[1], verdicts[p[0].key]))
    return outcomes, [request.key for request, _ in still]
