"""Admission: may this request for a GPU share start now? A pure function of the policy and the numbers.

`decide()` does no I/O. Both spawners are admitted through `Ledger.admit` (via `notify.admit`, which delivers
the alerts), which calls it against the team's holdings and the period's usage read under the team's lock
and holds the share in the same transaction; the embedded queue also calls it, without writing, to order and
explain what waits. Two limits, never confused:

- the **concurrent quota** (`quota.gpus`, `quota.per_user_gpus`, `quota.per_model`: shares held at once)
  is full → `wait` in the queue; a request larger than the quota itself could never start → `deny`;
- the **period budget** (`budget.gpu_hours`, `budget.per_model`: GPU-hours per UTC month) is exhausted
  when the period's usage has reached it (or the GPU-hours the request reserves no longer fit) → the
  team's `on_exhausted`: `alert` admits, `deprioritize` admits as lowest-priority preemptible work,
  `deny` refuses, saying budget, usage and when it resets.

`per_user_gpus` limits what one member holds *under this team*; what the same person holds for
another team counts against that team. CPU-only requests hold no GPU and are always admitted.

Alerts: the decision lists every alert threshold the team's usage has reached this period; which of
them are *new* is decided by the ledger's alert log (`Ledger.claim_alerts`), so that each is sent once
per team, scope and period however many hubs ask.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from enum import StrEnum
from fractions import Fraction
from typing import Literal, Protocol

from gpupool.policies.model import Policy, Team
from gpupool.policies.periods import (
    SECONDS_PER_HOUR,
    ensure_utc,
    period_of,
    period_reset,
)
from gpupool.policies.resources import profile_share

#: The priority of deprioritized work: below every team (team priorities are 0 or more).
LOWEST_PRIORITY = -1
#: Recorded as the profile of requests that name a model and share instead of a profile (training jobs).
DIRECT_PROFILE = "direct"

Action = Literal["admit", "wait", "deny"]


class Reason(StrEnum):
    """Why a request is admitted, waits or is refused: a stable code beside the message written for people.

    In the style of Kueue's condition reasons: scripts, metrics (`gpupool_admission_decisions_total`,
    JupyterHub's `jupyterhub_server_spawn_duration_seconds{reason}`), progress events and REST errors carry
    the code; the message may change its wording, the code does not. `reason_reference()` lists them for
    docs/admission.md.
    """

    action: Action | Literal["end"]  # what a decision with this code does; "end": a wait that ended
    meaning: str

    def __new__(cls, value: str, action: str, meaning: str):
        member = str.__new__(cls, value)
        member._value_ = value
        member.action, member.meaning = action, meaning
        return member

    WITHIN_QUOTA = "within-quota", "admit", "the share fits the team's concurrent quotas and its period budget"
    NO_GPU = "no-gpu", "admit", "the profile holds no GPU (CPU only): no quota or budget applies"
    BUDGET_ALERT = "budget-alert", "admit", "over the period budget; the team's `on_exhausted` is `alert`"
    BUDGET_DEPRIORITIZED = ("budget-deprioritized", "admit",
                            "over the period budget, admitted as lowest-priority, preemptible work "
                            "(`on_exhausted: deprioritize`)")
    ALREADY_ADMITTED = ("already-admitted", "admit",
                        "asked again with the key of an interval that is open (`Ledger.admit` is idempotent)")
    QUOTA_FULL = ("quota-full", "wait",
                  "the team, the member or the team's share of the model holds its concurrent quota")
    NO_CAPACITY = "no-capacity", "wait", "within quota, but no card of the model has the share free (embedded)"
    RESTART_ORDER = "restart-order", "wait", "requests that queued before the hub restarted are placed first"
    VOLCANO_PENDING = ("volcano-pending", "wait",
                       "admitted by gpupool; the pod waits in Volcano's queue (Kubernetes mode)")
    QUOTA_NEVER_FITS = ("quota-never-fits", "deny",
                        "larger than the quota itself: waiting would never end")
    BUDGET_DENY = "budget-deny", "deny", "the period budget is used up and the team's `on_exhausted` is `deny`"
    NEVER_FITS_POOL = ("never-fits-pool", "deny",
                       "larger than any card (embedded) or node (Kubernetes) can hold")
    QUEUE_TIMEOUT = ("queue-timeout", "end",
                     "waited the queue timeout (the team's `queue.timeout_seconds`, else "
                     "`settings.queue_timeout_seconds`) without a place")
    CANCELLED = "cancelled", "end", "stopped while it waited (the Stop button, DELETE on the server, its pod deleted)"


def reason_reference() -> str:
    """The reason codes as a Markdown table (docs/admission.md; `tests/unit/project/test_readme.py` keeps it current)."""
    rows = ["| code | outcome | when |", "|---|---|---|"]
    rows += [f"| `{code}` | {code.action} | {code.meaning} |" for code in Reason]
    return "\n".join(rows)


# --- inputs ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdmissionRequest:
    """What is asked for: a profile of the policy, or a model and share (training jobs).

    `at` is when the decision is made (normally now); it selects the budget period. `reserve` is the
    time of use the request commits to at admission: its share × `reserve` GPU-hours must fit in the
    budget, and the ledger counts them against it until the interval has run that long. `preemptible`
    is for requests without a profile; a profile says itself whether its work is preemptible.
    """

    user: str
    team: str
    at: datetime
    profile: str | None = None
    model: str | None = None
    share: Fraction | None = None
    preemptible: bool = False
    reserve: timedelta = timedelta(0)


class Held(Protocol):
    """Anything that holds a share: a ledger `Interval`, or the embedded pool's `Allocation`."""

    @property
    def user(self) -> str: ...
    @property
    def team(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def share(self) -> Fraction: ...


@dataclass(frozen=True)
class Holdings:
    """Shares held right now, in card units: per team, per team and model, per team and member."""

    team: Mapping[str, Fraction] = field(default_factory=dict)
    team_model: Mapping[tuple[str, str], Fraction] = field(default_factory=dict)
    team_user: Mapping[tuple[str, str], Fraction] = field(default_factory=dict)

    @classmethod
    def of(cls, held: Iterable[Held]) -> Holdings:
        team: dict[str, Fraction] = {}
        team_model: dict[tuple[str, str], Fraction] = {}
        team_user: dict[tuple[str, str], Fraction] = {}
        for item in held:
            team[item.team] = team.get(item.team, Fraction(0)) + item.share
            team_model[item.team, item.model] = team_model.get((item.team, item.model), Fraction(0)) + item.share
            team_user[item.team, item.user] = team_user.get((item.team, item.user), Fraction(0)) + item.share
        return cls(team, team_model, team_user)


@dataclass(frozen=True)
class Usage:
    """GPU-hours counted against budgets in `period`: per team and per team and model."""

    period: str
    team: Mapping[str, Fraction] = field(default_factory=dict)
    team_model: Mapping[tuple[str, str], Fraction] = field(default_factory=dict)


# --- outputs ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Alert:
    """A team's usage has reached `threshold` of a budget (`scope` "" = all models, else one model)."""

    team: str
    period: str
    scope: str
    threshold: Decimal
    used: Fraction
    budget: Decimal

    @property
    def threshold_text(self) -> str:
        """The threshold as the alert log stores it: 0.8, 1 (0.80 and 0.8 are the same threshold)."""
        return format(self.threshold.normalize(), "f")

    @property
    def message(self) -> str:
        what = f"{self.scope} budget" if self.scope else "budget"
        return (
            f'team "{self.team}" has used {format_percent(self.threshold)} of its {what} of '
            f"{format_hours(self.budget)} GPU-hours for {self.period} "
            f"({format_hours(self.used)} GPU-hours, {_percent_of(self.used, self.budget)})"
        )


@dataclass(frozen=True)
class Decision:
    """The answer: `admit`, `wait` or `deny`, why (`reason` for people, `code` for programs), and how admitted
    work runs."""

    action: Action
    reason: str
    priority: int
    preemptible: bool
    alerts: tuple[Alert, ...] = ()
    period: str = ""
    code: Reason = field(kw_only=True)

    def __post_init__(self) -> None:
        if self.code.action != self.action:
            raise ValueError(f"a decision to {self.action} cannot have the reason code {self.code} "
                             f"(that code goes with {self.code.action})")

    @property
    def admitted(self) -> bool:
        return self.action == "admit"


@dataclass(frozen=True)
class Resolved:
    """A request checked against the policy: what it holds and how it would run if admitted."""

    team: str
    user: str
    profile: str
    label: str  # for people: the profile's display name or "0.25 × H200"
    model: str | None  # None for CPU-only profiles
    share: Fraction
    priority: int
    preemptible: bool


# --- formatting for people ---------------------------------------------------------------------------------


def _trimmed(value: Fraction | Decimal, places: int) -> str:
    if type(value) is Fraction and value.denominator == 1:
        value = value.numerator
    if type(value) is int and -10**18 < value < 10**18:
        return str(value)  # a whole number: what the rounding below gives, without it (decide's hot path)
    scaled = Fraction(value) * 10**places
    rounded = math.floor(scaled + Fraction(1, 2))  # half up; values here are never negative
    text = str(Decimal(rounded).scaleb(-places))
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def format_share(share: Fraction) -> str:
    """1 → '1', 1/4 → '0.25', 1/7 → '0.143'."""
    return _trimmed(share, 3)


def format_hours(hours: Fraction | Decimal) -> str:
    """GPU-hours for people: 512.3, 0.25, 500; three significant digits below 0.01, so a short run is not "0"."""
    if 0 < hours < Fraction(1, 100):
        return f"{float(hours):.3g}"
    return _trimmed(hours, 2)


def format_percent(fraction: Fraction | Decimal) -> str:
    return f"{_trimmed(Fraction(fraction) * 100, 1)}%"


def _percent_of(used: Fraction, budget: Decimal) -> str:
    # Rounded down, so that "100%" is never shown for a budget that is not used up yet.
    return f"{math.floor(used / Fraction(budget) * 100)}%" if budget else "no budget"


def _gpus(limit: Fraction) -> str:
    return "GPU" if limit == 1 else "GPUs"


# --- the decision ----------------------------------------------------------------------------------------------


def resolve(policy: Policy, request: AdmissionRequest) -> Resolved:
    """Check `request` against `policy`; ValueError naming what is wrong and what is accepted."""
    ensure_utc(request.at, "the request's time (at)")
    if request.team not in policy.teams:
        raise ValueError(f"unknown team {request.team!r} (known: {', '.join(sorted(policy.teams)) or 'none'})")
    if not isinstance(request.user, str) or not request.user:
        raise ValueError("the request names no user")
    if not isinstance(request.reserve, timedelta) or request.reserve < timedelta(0):
        raise ValueError(f"reserve must be a timedelta of 0 or more, not {request.reserve!r}")
    team = policy.teams[request.team]
    if request.profile is not None and (request.model is not None or request.share is not None):
        raise ValueError("give either a profile or a model and share, not both")
    if request.profile is not None:
        profile = policy.profiles.get(request.profile)
        if profile is None:
            raise ValueError(
                f"no such profile: {request.profile!r}; options include: {', '.join(policy.profiles) or 'none'}"
            )
        if request.team not in profile.teams:
            offered = ", ".join(policy.profiles_for_teams({request.team})) or "none"
            raise ValueError(
                f"profile {request.profile!r} is not offered to team {request.team!r} (its profiles: {offered})"
            )
        model = profile.gpu.model if profile.gpu is not None else None
        share = profile_share(profile, policy)
        return Resolved(request.team, request.user, request.profile, profile.display_name, model, share,
                        team.priority, profile.preemptible)
    if request.model is None or request.share is None:
        raise ValueError("give a profile, or both a GPU model and a share")
    if request.model not in policy.models:
        raise ValueError(f"unknown GPU model {request.model!r} (known: {', '.join(policy.models) or 'none'})")
    if not isinstance(request.share, Fraction | int) or isinstance(request.share, bool) or request.share <= 0:
        raise ValueError(f"share must be a Fraction above 0 (e.g. Fraction(1, 4)), not {request.share!r}")
    share = request.share if type(request.share) is Fraction else Fraction(request.share)
    return Resolved(request.team, request.user, DIRECT_PROFILE, f"{format_share(share)} × {request.model}",
                    request.model, share, team.priority, request.preemptible)


def reached_alerts(policy: Policy, team_name: str, usage: Usage) -> tuple[Alert, ...]:
    """Every alert threshold of `team_name`'s budgets its usage has reached in `usage.period`."""
    budget = policy.teams[team_name].budget
    scopes: list[tuple[str, Decimal, Fraction]] = []
    if budget.gpu_hours is not None:
        scopes.append(("", budget.gpu_hours, usage.team.get(team_name, Fraction(0))))
    for model, hours in sorted(budget.per_model.items()):
        scopes.append((model, hours, usage.team_model.get((team_name, model), Fraction(0))))
    alerts = []
    for scope, limit, used in scopes:
        if limit == 0:  # a budget of nothing is not "used up" news: it never allowed anything
            continue
        for threshold in budget.alert_thresholds:
            if used >= Fraction(threshold) * Fraction(limit):
                alerts.append(Alert(team_name, usage.period, scope, threshold, used, limit))
    return tuple(alerts)


def _budget_problems(team: Team, name: str, resolved: Resolved, usage: Usage,
                     reserve: timedelta) -> list[str]:
    """Why the budget does not allow `resolved` now (empty when it does)."""
    assert resolved.model is not None
    checks: list[tuple[str, Decimal, Fraction]] = []
    if team.budget.gpu_hours is not None:
        checks.append(("budget", team.budget.gpu_hours, usage.team.get(name, Fraction(0))))
    if resolved.model in team.budget.per_model:
        checks.append((f"{resolved.model} budget", team.budget.per_model[resolved.model],
                       usage.team_model.get((name, resolved.model), Fraction(0))))
    if not checks:
        return []
    reserved = resolved.share * Fraction(reserve // timedelta(seconds=1), SECONDS_PER_HOUR)
    problems = []
    for what, limit, used in checks:
        limit_f = Fraction(limit)
        if used >= limit_f or used + reserved > limit_f:
            text = (f'team "{name}": {what} of {format_hours(limit)} GPU-hours for {usage.period} used: '
                    f"{format_hours(used)} ({_percent_of(used, limit)})")
            if used < limit_f:
                text += f", and the {format_hours(reserved)} GPU-hours this request reserves do not fit"
            problems.append(f"{text}; resets {period_reset(usage.period)}")
    return problems


def decide(policy: Policy, request: AdmissionRequest, holdings: Holdings, usage: Usage) -> Decision:
    """Admit, wait or deny `request`, given what is held now and what the period has used."""
    resolved = resolve(policy, request)
    period = period_of(request.at)
    if usage.period != period:
        raise ValueError(f"the usage given is for {usage.period}, but the request at {request.at.isoformat()} "
                         f"falls in {period}")
    name, team = resolved.team, policy.teams[resolved.team]
    alerts = reached_alerts(policy, name, usage)

    def decision(code: Reason, reason: str, priority: int = resolved.priority,
                 preemptible: bool = resolved.preemptible) -> Decision:
        return Decision(code.action, reason, priority, preemptible, alerts, period, code=code)

    if resolved.model is None or resolved.share == 0:
        return decision(Reason.NO_GPU, f"{resolved.label} holds no GPU")
    model, share, label = resolved.model, resolved.share, resolved.label

    # Larger than the quota itself: waiting would never end. (The texts are written only for the limit exceeded.)
    limits = [
        (team.quota.gpus, lambda: f'team "{name}" may hold at most {format_share(team.quota.gpus or 0)} '
                                  f"{_gpus(team.quota.gpus or 0)} at once (quota)"),
        (team.quota.per_user_gpus, lambda: f'a member of team "{name}" may hold at most '
                                           f"{format_share(team.quota.per_user_gpus or 0)} "
                                           f"{_gpus(team.quota.per_user_gpus or 0)} at once (quota)"),
        (team.quota.per_model.get(model), lambda: f'team "{name}" may hold at most '
                                                  f"{format_share(team.quota.per_model.get(model) or 0)} {model} "
                                                  "at once (quota per model)"),
    ]
    for limit, text in limits:
        if limit is not None and share > limit:
            return decision(Reason.QUOTA_NEVER_FITS, f"{label} can never start: {text()}")

    priority, preemptible, notes, admitted = resolved.priority, resolved.preemptible, [], Reason.WITHIN_QUOTA
    problems = _budget_problems(team, name, resolved, usage, request.reserve)
    if problems:
        over = "; ".join(problems)
        action = team.budget.on_exhausted
        if action == "deny":
            return decision(Reason.BUDGET_DENY, over)
        if action == "deprioritize":
            priority, preemptible, admitted = LOWEST_PRIORITY, True, Reason.BUDGET_DEPRIORITIZED
            notes.append(f"runs as lowest-priority, preemptible work: {over}")
        else:
            admitted = Reason.BUDGET_ALERT
            notes.append(f"over budget, alerting: {over}")

    held_team = holdings.team.get(name, Fraction(0))
    held_model = holdings.team_model.get((name, model), Fraction(0))
    held_user = holdings.team_user.get((name, resolved.user), Fraction(0))
    full = []
    if team.quota.gpus is not None and held_team + share > team.quota.gpus:
        full.append(f'team "{name}" holds {format_share(held_team)} of {format_share(team.quota.gpus)} '
                    f"{_gpus(team.quota.gpus)} (quota)")
    if team.quota.per_user_gpus is not None and held_user + share > team.quota.per_user_gpus:
        full.append(f"{resolved.user} holds {format_share(held_user)} of "
                    f"{format_share(team.quota.per_user_gpus)} {_gpus(team.quota.per_user_gpus)} "
                    f'allowed per member of team "{name}" (quota)')
    limit_model = team.quota.per_model.get(model)
    if limit_model is not None and held_model + share > limit_model:
        full.append(f'team "{name}" holds {format_share(held_model)} of {format_share(limit_model)} {model} '
                    "(quota per model)")
    if full:
        return decision(Reason.QUOTA_FULL, "; ".join(full + notes), priority, preemptible)
    return decision(admitted, "; ".join(notes) or f"{label} is within quota and budget", priority, preemptible)
