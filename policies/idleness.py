"""Whether a server is idle, and when the culler warns and stops it: pure decisions on what the culler saw.

The culler (`gpupool.hub.culler`) gathers the signals of one server at each pass (its processes' GPU and CPU use,
Jupyter's own activity), keeps one `IdleRecord` per server run in the ledger's database, and acts on the
`Decision` made here: nothing here reads a clock, a process or a database.

A server is *active* at a look when any signal is over its threshold: its processes' GPU utilisation, their CPU
use, a kernel executing; and when no signal at all can be read (no evidence is never a reason to stop it). Jupyter's own last kernel or terminal activity moves the last active moment too (an
open browser tab does not: JupyterLab's polling is not activity of a kernel). Idle for the rule's
`after_minutes` since the last active moment (or past `max_age_hours` since its start), it is stopped, never
without a warning at least `warn_minutes` before; "keep it" postpones the stop, up to `keep_max_hours` in all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from decimal import Decimal
from enum import StrEnum

from gpupool.policies.model import Idle


class Action(StrEnum):
    """What the culler does with a server after a look."""

    ACTIVE = "active"  # something ran since the last look
    IDLE = "idle"  # nothing ran; not near its stop yet
    WARN = "warn"  # warn its user now: the stop is near (sent once per stop time)
    WARNED = "warned"  # warned already; waiting for the stop time
    CULL = "cull"  # stop it now
    EXEMPT = "exempt"  # its rule culls nothing


@dataclass(frozen=True)
class Signals:
    """One look at one server. `None`: the signal is unavailable (and `gpu_note` / `cpu_note` say why)."""

    gpu_percent: float | None = None
    gpu_note: str = ""
    cpu_percent: float | None = None
    cpu_note: str = ""
    #: Kernels executing at this look (Jupyter's `execution_state: busy`).
    busy_kernels: int | None = None
    #: The latest kernel or terminal activity Jupyter reports.
    jupyter_activity: datetime | None = None
    jupyter_note: str = ""


@dataclass(frozen=True)
class IdleRecord:
    """What the culler keeps about one server run between looks (persisted: a restart of the culler forgets
    nothing)."""

    started: datetime
    last_active: datetime
    warned_at: datetime | None = None
    #: The stop time the last warning announced.
    warned_for: datetime | None = None
    keep_until: datetime | None = None
    #: How long its user has postponed the stop so far, all "keep it" together.
    kept: timedelta = timedelta(0)


@dataclass(frozen=True)
class Decision:
    action: Action
    record: IdleRecord
    #: When the server will be stopped if nothing runs meanwhile (None: never, its rule culls nothing).
    cull_at: datetime | None
    #: Why, in words: `idle` or `max-age`, then the sentence users see.
    cause: str = ""
    message: str = ""


def minutes(value: Decimal) -> timedelta:
    return timedelta(seconds=float(value * 60))


def hours(value: Decimal) -> timedelta:
    return timedelta(seconds=float(value * 3600))


def active(rule: Idle, signals: Signals) -> list[str]:
    """The signals over their thresholds at this look, in words (empty: nothing ran)."""
    seen = []
    if signals.gpu_percent is not None and signals.gpu_percent >= rule.gpu_below_percent:
        seen.append(f"GPU {signals.gpu_percent:.0f}%")
    if signals.cpu_percent is not None and signals.cpu_percent >= rule.cpu_below_percent:
        seen.append(f"CPU {signals.cpu_percent:.0f}%")
    if signals.busy_kernels:
        seen.append(f"{signals.busy_kernels} kernel{'s' if signals.busy_kernels > 1 else ''} busy")
    return seen


def known(signals: Signals) -> bool:
    """Whether anything at all could be read at this look."""
    return any(v is not None for v in (signals.gpu_percent, signals.cpu_percent, signals.busy_kernels))


def _say(delta: timedelta) -> str:
    total = int(delta.total_seconds() // 60)
    if total < 1:
        return "less than a minute"
    return f"{total // 60} h {total % 60} min" if total >= 60 else f"{total} min"


def decide(rule: Idle, signals: Signals, record: IdleRecord, now: datetime, server: str = "your server") -> Decision:
    """What to do with a server after a look at `now`, and the record to keep."""
    last = record.last_active
    if signals.jupyter_activity is not None and signals.jupyter_activity > last:
        last = min(signals.jupyter_activity, now)
    if active(rule, signals) or not known(signals):
        last = now  # something ran; or nothing could be read, and a server is never stopped on no evidence
    if last > record.last_active:
        record = replace(record, last_active=last)
    if not rule.enabled:
        # A warning given before the rule was turned off is over: turned on again, it warns anew.
        return Decision(Action.EXEMPT, replace(record, warned_at=None, warned_for=None), None)

    cull_at, cause = last + minutes(rule.after_minutes), "idle"
    if rule.max_age_hours is not None and record.started + hours(rule.max_age_hours) < cull_at:
        cull_at, cause = record.started + hours(rule.max_age_hours), "max-age"
    if record.keep_until is not None and record.keep_until > cull_at:
        cull_at = record.keep_until
    if record.warned_for is not None and record.warned_for < cull_at:
        # Postponed since the warning (active again, or kept): that warning is over; a new one comes if due.
        record = replace(record, warned_at=None, warned_for=None)
    warn_at = cull_at - minutes(rule.warn_minutes)

    if now < warn_at:
        action = Action.ACTIVE if last == now else Action.IDLE
        return Decision(action, record, cull_at, cause)
    warned = record.warned_for is not None
    if not warned:
        # Never stopped unwarned: a culler that was down past the stop time warns first, and stops later.
        cull_at = max(cull_at, now + minutes(rule.warn_minutes))
        record = replace(record, warned_at=now, warned_for=cull_at)
        return Decision(Action.WARN, record, cull_at, cause, _warning(rule, cause, server, now, record, cull_at))
    cull_at = record.warned_for
    if now >= cull_at:
        message = (f"{server} was stopped: idle for {_say(now - last)}, which is more than the {rule.after_minutes} "
                   "minutes its policy allows" if cause == "idle" else
                   f"{server} was stopped: it ran {_say(now - record.started)}, the most its policy allows "
                   f"({rule.max_age_hours} h)")
        return Decision(Action.CULL, record, cull_at, cause, message)
    return Decision(Action.WARNED, record, cull_at, cause, _warning(rule, cause, server, now, record, cull_at))


def _warning(rule: Idle, cause: str, server: str, now: datetime, record: IdleRecord, cull_at: datetime) -> str:
    why = (f"has been idle for {_say(now - record.last_active)}" if cause == "idle"
           else f"has run for {_say(now - record.started)} (the most is {rule.max_age_hours} h)")
    return f"{server} {why} and will be stopped at {cull_at:%H:%M} UTC to give its GPU back to the pool."


class KeepRefused(Exception):
    """A "keep it" the rule does not allow; the message says why and what is left."""


def keep(rule: Idle, record: IdleRecord, now: datetime, wanted: timedelta) -> IdleRecord:
    """Postpone the stop of a server by `wanted` (from now, or from the end of a keep still running), within what
    its rule still allows."""
    if wanted <= timedelta(0):
        raise KeepRefused("keep it for a positive time, e.g. 1 hour")
    left = hours(rule.keep_max_hours) - record.kept
    if not rule.enabled:
        raise KeepRefused("this server is never culled: nothing to postpone")
    if left <= timedelta(0):
        raise KeepRefused(f"this server has been kept {_say(record.kept)} already, the most its policy allows "
                          f"(keep_max_hours: {rule.keep_max_hours})")
    granted = min(wanted, left)
    # Kept again while a keep runs: the new time adds to it.
    until = max(now, record.keep_until or now) + granted
    return replace(record, keep_until=until, kept=record.kept + granted, warned_at=None, warned_for=None)
