"""Group commit at the door (`Ledger.admit`), on SQLite and PostgreSQL: requests that arrive together are decided in
one transaction, and each is answered exactly as deciding them one at a time, in commit order, would answer it —
so no share is admitted beyond a quota, a retried key gets the same answer, and a bad request fails alone."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpupool.hub.accounting import ledger as ledger_module
from gpupool.hub.accounting.ledger import ALERTS, INTERVALS, LOCKS, AdmissionResult, Ledger
from gpupool.policies.admission import AdmissionRequest

AT = datetime(2026, 11, 15, 12, tzinfo=UTC)
#: When requests are made: the same second, the next one, an hour on, the month's last half hour, the next month.
TIMES = (AT, AT + timedelta(microseconds=400_000), AT + timedelta(seconds=1), AT + timedelta(hours=1),
         datetime(2026, 11, 30, 23, 30, tzinfo=UTC), datetime(2026, 12, 1, 0, 30, tzinfo=UTC))
PROFILES = ("h200-quarter", "h200-half", "h200-whole", "h200-mig", "a100-whole", "cpu")
QUOTA = {"vision": 3, "nlp": 1}
PER_USER = {"vision": 1}


class RecordingLedger(Ledger):
    """The ledger, noting the order in which its door decides requests (the order their transactions commit)."""

    def __init__(self, url: str):
        super().__init__(url)
        self.order: list[AdmissionRequest] = []
        self.batches: list[int] = []
        self.commits = 0
        sa.event.listen(self.engine, "commit", self._committed)

    def _committed(self, _connection: Any) -> None:
        self.commits += 1

    def _decide_batch(self, batch):
        # Called by one leader at a time: the batches follow each other in commit order.
        self.order.extend(asked.request for asked in batch)
        self.batches.append(len(batch))
        super()._decide_batch(batch)


@pytest.fixture
def ledger(database_url: str):
    ledger = RecordingLedger(database_url)
    yield ledger
    ledger.dispose()


def seed(ledger: Ledger) -> None:
    """An empty ledger, then: bob used a whole H200 for 9 hours this month and holds an A100 (running since an hour
    before AT, so the month's usage grows with the request's time); a key that names an ended interval."""
    with ledger.engine.begin() as connection:
        for table in (INTERVALS, ALERTS, LOCKS):
            connection.execute(table.delete())
    start = datetime(2026, 11, 2, tzinfo=UTC)
    ledger.open_interval("bob/:0", "bob", "vision", "h200-whole", "H200", Fraction(1), start)
    ledger.close_interval("bob/:0", start + timedelta(hours=9), "stopped")
    ledger.open_interval("bob/:1", "bob", "vision", "a100-whole", "A100-80GB", Fraction(1), AT - timedelta(hours=1))
    ledger.open_interval("ended/:1", "eve", "nlp", "h200-quarter", "H200", Fraction(1, 4), start)
    ledger.close_interval("ended/:1", start + timedelta(hours=1), "stopped")


def outcome(ledger: Ledger, policy, asked: tuple[AdmissionRequest, str]) -> AdmissionResult | str:
    try:
        return ledger.admit(policy, *asked)
    except ValueError as error:
        return f"ValueError: {error}"


def ask_together(ledger: Ledger, policy, asks: list[tuple[AdmissionRequest, str]]) -> list[Any]:
    """Each request from its own thread, all released at once; each thread's answers (a list: it must hold one)."""
    start_line = threading.Barrier(len(asks))
    answers: list[list[Any]] = [[] for _ in asks]

    def ask(i: int) -> None:
        start_line.wait()
        answers[i].append(outcome(ledger, policy, asks[i]))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads)
    return answers


def held(ledger: Ledger) -> dict[tuple[str, str], Fraction]:
    """Open shares per team (user ""), and per team and user."""
    sums: dict[tuple[str, str], Fraction] = {}
    for interval in ledger.open_intervals():
        for name in ((interval.team, ""), (interval.team, interval.user)):
            sums[name] = sums.get(name, Fraction(0)) + interval.share
    return sums


asks_strategy = st.lists(
    st.tuples(st.sampled_from(("alice", "bob", "carol", "dan")), st.sampled_from(("vision", "nlp")),
              st.sampled_from(PROFILES), st.sampled_from((0, 1, 2)), st.sampled_from(range(len(TIMES))),
              st.integers(min_value=1, max_value=12)),
    min_size=2, max_size=40,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=asks_strategy, on_exhausted=st.sampled_from(("deny", "alert")), queue=st.sampled_from((False, True)),
       batch_limit=st.sampled_from((3, 256)))
def test_concurrent_requests_are_answered_as_if_decided_one_by_one_in_commit_order(ledger, make_policy, drawn,
                                                                                    on_exhausted, queue, batch_limit):
    """Released at once (the door batches whoever arrives while a batch is decided), or all queued first (batches
    of `batch_limit`, the door passed from one requester to the next)."""
    policy = make_policy(teams={
        # bob's use puts vision at 10 GPU-hours at AT: the first few reservations reach the budgets.
        "vision": {"quota": {"gpus": QUOTA["vision"], "per_user_gpus": PER_USER["vision"], "per_model": {"H200": 2}},
                   "budget": {"gpu_hours": 12, "per_model": {"H200": 10.5}, "on_exhausted": on_exhausted}},
        "nlp": {"quota": {"gpus": QUOTA["nlp"]}, "budget": {"gpu_hours": 1, "on_exhausted": on_exhausted}},
    })
    asks = []
    for user, team, profile, reserve_h, when, key in drawn:
        if team == "nlp" and profile not in ("h200-quarter", "h200-mig", "a100-whole", "cpu"):
            profile = "h200-quarter"
        # Key 12 names an ended interval (its requester gets a ValueError, its batch is decided again one by one);
        # equal keys are retries of one request.
        name = "ended/:1" if key == 12 else f"{user}/:{key}"
        asks.append((AdmissionRequest(user=user, team=team, at=TIMES[when], profile=profile,
                                      reserve=timedelta(hours=reserve_h)), name))
    seed(ledger)
    ledger.group_commit, ledger.order, ledger.batches = True, [], []
    limit, ledger_module.MAX_BATCH = ledger_module.MAX_BATCH, batch_limit
    try:
        answers = [[answer] for answer in hold_the_door(ledger, policy, asks)] if queue else ask_together(
            ledger, policy, asks)
    finally:
        ledger_module.MAX_BATCH = limit
    if queue:
        assert len(ledger.batches) == -(-len(asks) // batch_limit)

    # Each request answered once, and decided once.
    assert all(len(answer) == 1 for answer in answers)
    index = {id(request): i for i, (request, _key) in enumerate(asks)}
    order = [index[id(request)] for request in ledger.order]
    assert sorted(order) == list(range(len(asks)))
    # No over-admission: each team and member within its concurrent quota (bob's A100 counts).
    for (team, user), share in held(ledger).items():
        assert share <= (QUOTA[team] if not user else PER_USER.get(team, QUOTA[team])), (team, user, share)
    together = [answer[0] for answer in answers]
    after = sorted((i.key, i.state, i.start, i.share) for i in ledger.open_intervals())

    # The same requests, one transaction each, one after another in the order the door committed them.
    seed(ledger)
    ledger.group_commit = False
    alone = {i: outcome(ledger, policy, asks[i]) for i in order}
    assert [together[i] for i in order] == [alone[i] for i in order]
    assert sorted((i.key, i.state, i.start, i.share) for i in ledger.open_intervals()) == after


def hold_the_door(ledger: RecordingLedger, policy, asks: list[tuple[AdmissionRequest, str]]):
    """Start one thread per request while the door is held, wait until all of them queue, then lead: one batch."""
    with ledger._door:
        ledger._leading = True  # as if a leader were deciding: arrivals queue
    answers: list[Any] = [None] * len(asks)

    def ask(i: int) -> None:
        answers[i] = outcome(ledger, policy, asks[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
    for n, thread in enumerate(threads, 1):
        thread.start()
        queued = threading.Event()
        while not queued.wait(0.002):  # waiting for a condition, not for time: it has queued (so: in order)
            with ledger._door:
                if len(ledger._waiting) == n:
                    queued.set()
    with ledger._door:
        assert [asked.request for asked in ledger._waiting] == [request for request, _key in asks]
    ledger.commits = 0
    ledger._lead()  # this thread leads the first batch; the door passes on while requests are left
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads)
    return answers


def test_requests_that_arrive_together_share_one_transaction(ledger, make_policy):
    policy = make_policy(teams={"vision": {"quota": {"gpus": 2, "per_user_gpus": None, "per_model": {}}}})
    seed(ledger)  # bob holds an A100: one card of the quota is left, four quarters
    asks = [(AdmissionRequest(user=f"user{i}", team="vision", at=AT, profile="h200-quarter"), f"user{i}/:1")
            for i in range(30)]
    answers = hold_the_door(ledger, policy, asks)

    assert ledger.batches == [30] and ledger.commits == 1  # 30 decisions, one commit
    # The first four fill the quota; the rest wait, told so.
    assert [answer.decision.action for answer in answers] == ["admit"] * 4 + ["wait"] * 26
    assert [answer.opened for answer in answers] == [True] * 4 + [False] * 26
    assert answers[4].decision.reason.startswith('team "vision" holds 2 of 2 GPUs (quota)')
    assert held(ledger)["vision", ""] == 2


def test_a_long_queue_is_decided_in_batches_of_at_most_max_batch(ledger, make_policy, monkeypatch):
    monkeypatch.setattr(ledger_module, "MAX_BATCH", 8)
    policy = make_policy(teams={"vision": {"quota": {"gpus": 100, "per_user_gpus": None, "per_model": {}}}})
    seed(ledger)
    asks = [(AdmissionRequest(user=f"user{i}", team="vision", at=AT, profile="h200-quarter"), f"user{i}/:1")
            for i in range(30)]
    answers = hold_the_door(ledger, policy, asks)

    assert ledger.batches == [8, 8, 8, 6] and ledger.commits == 4
    assert all(answer.opened for answer in answers)
    assert not ledger._leading and not ledger._waiting  # the door is free again


def test_a_bad_request_in_a_batch_fails_alone(ledger, make_policy):
    policy = make_policy(teams={"vision": {"quota": {"gpus": 100, "per_user_gpus": None, "per_model": {}}}})
    seed(ledger)
    asks = [(AdmissionRequest(user=f"user{i}", team="vision", at=AT, profile="h200-quarter"), f"user{i}/:1")
            for i in range(6)]
    asks.insert(3, (AdmissionRequest(user="eve", team="nlp", at=AT, profile="h200-quarter"), "ended/:1"))
    asks.append((AdmissionRequest(user="user0", team="vision", at=AT, profile="h200-quarter"), "user0/:1"))  # a retry
    answers = hold_the_door(ledger, policy, asks)

    assert answers[3] == "ValueError: key 'ended/:1' names an interval that has ended; use a new key"
    assert ledger.batches == [8]
    assert [answer.opened for i, answer in enumerate(answers) if i != 3] == [True] * 6 + [False]
    assert answers[-1].decision.reason == "already admitted: interval 'user0/:1' is open"
    assert {a.decision.action for i, a in enumerate(answers) if i != 3} == {"admit"}
    assert len(ledger.open_intervals("vision")) == 1 + 6  # bob's A100 and one per key: nothing twice
