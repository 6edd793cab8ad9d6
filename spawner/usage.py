"""The ledger hooks every gpupool spawner calls: a server's usage opens at start, is seen on each poll, closes at stop.

Mixed into `GPUPoolSpawnerMixin`, so `LocalGPUSpawner` and `GPUKubeSpawner` write the same intervals under
the same run keys (`ledger.run_key`) as the accounting service's reconciliation. A failed ledger write is
counted and logged; it never takes a user's server down (reconciliation repairs the ledger later).
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta

from traitlets import Unicode, default
from traitlets.config import LoggingConfigurable

from gpupool.hub.accounting.ledger import HowEnded, Ledger, run_key
from gpupool.policies import periods
from gpupool.policies.resources import profile_share
from gpupool.spawner.metrics import LEDGER_WRITE_ERRORS

_ledgers: dict[str, Ledger] = {}


def get_ledger(url: str) -> Ledger:
    """The usage ledger at `url`, one per process."""
    ledger = _ledgers.get(url)
    if ledger is None:
        ledger = _ledgers[url] = Ledger(url)
    return ledger


class UsageLedgerMixin(LoggingConfigurable):
    """A server's usage in the ledger. Needs `gpupool_choice`, `policy`, `user`, `name` and `orm_spawner`.

    Spawners admit the run under its key (`usage_run`, held as `reserved` in the ledger: not billed), call
    `open_usage()` once the server runs (the holding is `running`, billed from then on), `see_usage()` from
    `poll()` while it runs, and `close_usage(how)` when it ends (a holding that never ran ends unbilled); the
    run's key is kept in the spawner's state.
    """

    ledger_url = Unicode(
        help="""
        The usage ledger's database: SQLite in the state folder by default (embedded mode), PostgreSQL in
        production. Also read from `GPUPOOL_LEDGER_URL`. Empty: usage is not recorded.

            c.LocalGPUSpawner.ledger_url = "postgresql+psycopg://gpupool@db.example.org/gpupool"
        """,
    ).tag(config=True)

    @default("ledger_url")
    def _default_ledger_url(self):
        return os.environ.get("GPUPOOL_LEDGER_URL", "")

    #: The ledger run of the server, from its admission on (None: nothing is being recorded).
    usage_run: str | None = None
    #: Whether the run runs (`open_usage` was called): until then a look at it only says it is still there.
    usage_running: bool = False

    @property
    def ledger(self) -> Ledger:
        return get_ledger(self.ledger_url)

    def _ledger(self, operation: str, method: str, *args, **kwargs):
        """`Ledger.<method>(...)`; a failure (reaching the ledger too) is counted and logged, never raised."""
        try:
            return getattr(self.ledger, method)(*args, **kwargs)
        except Exception:
            LEDGER_WRITE_ERRORS.labels(operation).inc()
            self.log.exception("gpupool ledger %s failed for %s", operation, getattr(self, "_log_name", self))
            return None

    def run_started(self) -> datetime:
        """When the hub started this run (`orm_spawner.started`, set before `start()`), as aware UTC."""
        started = getattr(getattr(self, "orm_spawner", None), "started", None)
        if started is None:  # a spawner outside a hub (tests): no hub view to agree with
            return periods.utcnow()
        return started.replace(tzinfo=UTC) if started.tzinfo is None else started.astimezone(UTC)

    def _usage_facts(self):
        choice = self.gpupool_choice
        if choice is None or choice.profile.gpu is None or not self.ledger_url:
            return None
        return (self.user.name, choice.team, choice.slug, choice.profile.gpu.model,
                profile_share(choice.profile, self.policy))

    def new_usage_run(self, holds_gpu: bool) -> str:
        """This start's run key (`ledger.run_key`: new for every start), the key its holding is admitted under.

        Known before admission is asked for, and `usage_run` from then on when the start holds a GPU share: were
        the spawn cancelled while the door admits it, `close_usage` still ends the holding (closing one that was
        never admitted changes nothing).
        """
        run = run_key(self.user.name, self.name, self.run_started())
        self.usage_run, self.usage_running = (run if holds_gpu and self.ledger_url else None), False
        return run

    def open_usage(self, queue_wait: timedelta | None = None) -> None:
        """The server holds its share from now on; `queue_wait`: how long its request waited in the queue."""
        facts = self._usage_facts()
        if facts is None:
            return
        # The key it was admitted under, if it was (a spawner outside a hub has no fixed start to recompute it).
        self.usage_run = self.usage_run or run_key(self.user.name, self.name, self.run_started())
        self.usage_running = True
        now = periods.utcnow()
        self._ledger("open", "keep_run", self.usage_run, *facts, now, now, queue_wait=queue_wait)

    def see_usage(self) -> None:
        """The server is running now: a heartbeat, or a continuation when reconciliation closed it meanwhile."""
        facts = self._usage_facts()
        if self.usage_run is None or facts is None:
            return
        if not self.usage_running:  # admitted, not running yet (a stop while it waits): held, still not billed
            self._ledger("heartbeat", "heartbeat_run", self.usage_run, periods.utcnow())
            return
        # Were its interval lost (a failed first write), it would be opened at the hub's start, as the
        # accounting service's reconciliation does.
        self._ledger("heartbeat", "keep_run", self.usage_run, *facts, self.run_started(), periods.utcnow())

    def close_usage(self, how: HowEnded, at_last_seen: bool = False, end: datetime | None = None) -> None:
        """The server ended (`how`): at `end` when known, else now, or when it was last seen alive (it died
        unseen)."""
        if self.usage_run is None:
            return
        if end is None:
            end = None if at_last_seen else periods.utcnow()
        self._ledger("close", "close_run", self.usage_run, end, how)
        self.usage_run, self.usage_running = None, False

    def get_state(self):
        state = super().get_state()
        if self.usage_run:
            state["usage_run"] = self.usage_run
        return state

    def load_state(self, state):
        super().load_state(state)
        self.usage_run = state.get("usage_run")
        # A server the hub kept across a restart ran (a spawn in progress does not outlive its hub).
        self.usage_running = self.usage_run is not None
