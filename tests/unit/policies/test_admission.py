"""Admission, the pure function: every `on_exhausted` × quota state × budget state, thresholds, bad input."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from fractions import Fraction
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool.policies.admission import (
    LOWEST_PRIORITY, AdmissionRequest, Alert, Decision, Holdings, Reason, Usage, decide, reached_alerts,
)

AT = datetime(2026, 11, 15, 12, tzinfo=UTC)
PERIOD = "2026-11"
F = Fraction


def held(*items: tuple[str, str, Fraction | int], team: str = "vision") -> Holdings:
    """Holdings of (user, model, share) in `team`."""
    return Holdings.of(SimpleNamespace(user=u, team=team, model=m, share=F(s)) for u, m, s in items)


def used(team: Fraction | int = 0, h200: Fraction | int = 0, a100: Fraction | int = 0, name: str = "vision") -> Usage:
    return Usage(PERIOD, {name: F(team)}, {(name, "H200"): F(h200), (name, "A100-80GB"): F(a100)})


def ask(profile: str | None = "h200-quarter", user: str = "alice", team: str = "vision", **kwargs) -> AdmissionRequest:
    return AdmissionRequest(user=user, team=team, at=kwargs.pop("at", AT), profile=profile, **kwargs)


def with_exhausted(make_policy, on_exhausted: str, **budget):
    return make_policy(teams={"vision": {"budget": {"on_exhausted": on_exhausted, **budget}}})


# --- the full table -------------------------------------------------------------------------------------

#: What alice's request for 0.25 × H200 meets (vision: 2 GPUs, 1 per member, 1.5 H200 at once).
QUOTA_STATES = {
    "free": (held(), None),
    "exactly-fits": (held(("bob", "A100-80GB", 1), ("carol", "H200", F(3, 4))), None),
    "team-full": (held(("bob", "A100-80GB", 1), ("carol", "H200", 1)), 'team "vision" holds 2 of 2 GPUs (quota)'),
    "member-full": (held(("alice", "A100-80GB", 1)),
                    'alice holds 1 of 1 GPU allowed per member of team "vision" (quota)'),
    "model-full": (held(("bob", "H200", 1), ("carol", "H200", F(1, 2))),
                   'team "vision" holds 1.5 of 1.5 H200 (quota per model)'),
}
#: Usage this month (vision: 100 GPU-hours, of which 60 on H200).
BUDGET_STATES = {
    "under": (used(10, h200=10), None),
    "team-exhausted": (used(100, h200=40, a100=60),
                       'team "vision": budget of 100 GPU-hours for 2026-11 used: 100 (100%); '
                       "resets 2026-12-01 00:00 UTC"),
    "model-exhausted": (used(60, h200=60),
                        'team "vision": H200 budget of 60 GPU-hours for 2026-11 used: 60 (100%); '
                        "resets 2026-12-01 00:00 UTC"),
    "over-both": (used(F(1203, 10), h200=F(1203, 20), a100=F(1203, 20)),
                  'team "vision": budget of 100 GPU-hours for 2026-11 used: 120.3 (120%); '
                  'resets 2026-12-01 00:00 UTC; team "vision": H200 budget of 60 GPU-hours for 2026-11 '
                  "used: 60.15 (100%); resets 2026-12-01 00:00 UTC"),
}


@pytest.mark.parametrize("budget_state", BUDGET_STATES)
@pytest.mark.parametrize("quota_state", QUOTA_STATES)
@pytest.mark.parametrize("on_exhausted", ["alert", "deprioritize", "deny"])
def test_every_on_exhausted_quota_and_budget_state(make_policy, on_exhausted, quota_state, budget_state):
    holdings, quota_reason = QUOTA_STATES[quota_state]
    usage, budget_reason = BUDGET_STATES[budget_state]
    decision = decide(with_exhausted(make_policy, on_exhausted), ask(), holdings, usage)

    exhausted = budget_reason is not None
    if exhausted and on_exhausted == "deny":
        assert (decision.action, decision.reason) == ("deny", budget_reason)  # said at once, not after a wait
        assert decision.code is Reason.BUDGET_DENY
    elif quota_reason is not None:
        assert decision.action == "wait"
        assert decision.reason.startswith(quota_reason)
        assert decision.code is Reason.QUOTA_FULL
    else:
        assert decision.action == "admit"
        assert decision.code is {"alert": Reason.BUDGET_ALERT, "deprioritize": Reason.BUDGET_DEPRIORITIZED}.get(
            on_exhausted, Reason.WITHIN_QUOTA) if exhausted else Reason.WITHIN_QUOTA
    deprioritized = exhausted and on_exhausted == "deprioritize"
    assert decision.priority == (LOWEST_PRIORITY if deprioritized else 100)
    assert decision.preemptible is deprioritized
    if exhausted and on_exhausted != "deny":
        assert budget_reason in decision.reason
    if not exhausted and quota_reason is None:
        assert decision.reason == "0.25 × H200 is within quota and budget"
    assert decision.period == PERIOD


def test_every_reason_code_is_stable_text_and_belongs_to_one_action():
    # The codes are an interface (metrics labels, progress events, REST errors): renaming one breaks scripts.
    assert {code.value: code.action for code in Reason} == {
        "within-quota": "admit", "no-gpu": "admit", "budget-alert": "admit", "budget-deprioritized": "admit",
        "already-admitted": "admit", "quota-full": "wait", "no-capacity": "wait", "restart-order": "wait",
        "volcano-pending": "wait", "quota-never-fits": "deny", "budget-deny": "deny", "never-fits-pool": "deny",
        "queue-timeout": "end", "cancelled": "end",
    }
    with pytest.raises(ValueError, match="cannot have the reason code quota-full"):
        Decision("admit", "", 0, False, code=Reason.QUOTA_FULL)


def test_the_reasons_people_read(make_policy):
    deprioritize = with_exhausted(make_policy, "deprioritize", gpu_hours=500, per_model={})
    usage = Usage(PERIOD, {"vision": F(5123, 10)})
    decision = decide(deprioritize, ask(), held(("bob", "H200", 1), ("carol", "A100-80GB", 1)), usage)
    assert decision.action == "wait"
    assert decision.reason == (
        'team "vision" holds 2 of 2 GPUs (quota); runs as lowest-priority, preemptible work: '
        'team "vision": budget of 500 GPU-hours for 2026-11 used: 512.3 (102%); resets 2026-12-01 00:00 UTC'
    )
    deny = with_exhausted(make_policy, "deny", gpu_hours=500, per_model={})
    assert decide(deny, ask(), held(), usage).reason == (
        'team "vision": budget of 500 GPU-hours for 2026-11 used: 512.3 (102%); resets 2026-12-01 00:00 UTC'
    )
    alert = with_exhausted(make_policy, "alert", gpu_hours=500, per_model={})
    decision = decide(alert, ask(), held(), usage)
    assert decision.action == "admit" and decision.priority == 100 and not decision.preemptible
    assert decision.reason.startswith('over budget, alerting: team "vision": budget of 500')


def test_several_full_quotas_are_all_named(policy):
    decision = decide(policy, ask(), held(("alice", "H200", 1), ("bob", "H200", 1)), used())
    assert decision.action == "wait"
    assert decision.reason == (
        'team "vision" holds 2 of 2 GPUs (quota); alice holds 1 of 1 GPU allowed per member of team "vision" '
        '(quota); team "vision" holds 2 of 1.5 H200 (quota per model)'
    )


def test_december_resets_on_the_first_of_january(make_policy):
    deny = with_exhausted(make_policy, "deny")
    at = datetime(2026, 12, 31, 23, 59, tzinfo=UTC)
    decision = decide(deny, ask(at=at), held(), Usage("2026-12", {"vision": F(100)}))
    assert decision.reason.endswith("resets 2027-01-01 00:00 UTC")


def test_a_per_model_budget_binds_only_its_model(make_policy):
    deny = with_exhausted(make_policy, "deny")
    usage = used(60, h200=60)
    assert decide(deny, ask("h200-quarter"), held(), usage).action == "deny"
    assert decide(deny, ask("a100-whole"), held(), usage).action == "admit"


# --- requests that could never start -----------------------------------------------------------------------


@pytest.mark.parametrize("budget_state", BUDGET_STATES)
@pytest.mark.parametrize("on_exhausted", ["alert", "deprioritize", "deny"])
def test_larger_than_the_quota_itself_is_denied_not_queued(make_policy, on_exhausted, budget_state):
    policy = with_exhausted(make_policy, on_exhausted)
    decision = decide(policy, ask("h200-two"), held(), BUDGET_STATES[budget_state][0])
    assert (decision.action, decision.code) == ("deny", Reason.QUOTA_NEVER_FITS)
    assert decision.reason == ('2 × H200 can never start: a member of team "vision" may hold at most 1 GPU '
                               "at once (quota)")


def test_never_fits_the_team_or_the_model_quota(make_policy):
    policy = make_policy(teams={"vision": {"quota": {"per_user_gpus": 4, "per_model": {"H200": 1.5}}}})
    assert decide(policy, ask("h200-two"), held(), used()).reason == (
        '2 × H200 can never start: team "vision" may hold at most 1.5 H200 at once (quota per model)'
    )
    direct = ask(None, team="nlp", model="H200", share=F(2))
    assert decide(policy, direct, held(team="nlp"), used(name="nlp")).reason == (
        '2 × H200 can never start: team "nlp" may hold at most 1 GPU at once (quota)'
    )


# --- what is always admitted, and how admitted work runs ---------------------------------------------------------


def test_cpu_only_is_admitted_whatever_the_quota_and_budget(make_policy):
    deny = with_exhausted(make_policy, "deny")
    holdings, _ = QUOTA_STATES["team-full"]
    decision = decide(deny, ask("cpu"), holdings, used(120, h200=70))
    assert (decision.action, decision.reason, decision.priority) == ("admit", "CPU only holds no GPU", 100)
    assert decision.code is Reason.NO_GPU
    assert decision.alerts  # the budget is still reported as used up


def test_a_preemptible_profile_runs_preemptible_at_team_priority(policy):
    decision = decide(policy, ask("h200-quarter-spot"), held(), used())
    assert (decision.action, decision.priority, decision.preemptible) == ("admit", 100, True)


def test_direct_requests_name_a_model_and_share(policy):
    direct = ask(None, team="nlp", model="A100-80GB", share=F(1), preemptible=True)
    decision = decide(policy, direct, held(team="nlp"), used(name="nlp"))
    assert (decision.action, decision.priority, decision.preemptible) == ("admit", 50, True)
    direct = ask(None, team="nlp", model="H200", share=F(1, 7))
    assert decide(policy, direct, held(("bob", "H200", F(6, 7)), team="nlp"), used(name="nlp")).action == "admit"
    assert decide(policy, direct, held(("bob", "H200", F(1)), team="nlp"), used(name="nlp")).reason == (
        'team "nlp" holds 1 of 1 GPU (quota)'
    )


def test_mig_slices_count_as_sevenths(policy):
    # Six 1g slices (6/7) and a quarter: 6/7 + 1/7 = 1 fits alice's 1 GPU; one more slice does not.
    holdings = held(("alice", "H200", F(6, 7)))
    assert decide(policy, ask("h200-mig"), holdings, used()).action == "admit"
    assert decide(policy, ask("h200-quarter"), holdings, used()).reason == (
        'alice holds 0.857 of 1 GPU allowed per member of team "vision" (quota)'
    )


def test_per_user_quota_counts_only_what_the_member_holds_in_this_team(policy):
    elsewhere = Holdings.of([SimpleNamespace(user="alice", team="nlp", model="H200", share=F(1))])
    assert decide(policy, ask(), elsewhere, used()).action == "admit"


# --- reservations: GPU-hours committed at admission ----------------------------------------------------------------


def test_a_reservation_must_fit_in_the_budget(make_policy):
    deny = make_policy(teams={"vision": {"budget": {"gpu_hours": 10, "per_model": {}, "on_exhausted": "deny"}}})
    usage = Usage(PERIOD, {"vision": F(9)})
    one_hour = ask("h200-whole", reserve=timedelta(hours=1))
    assert decide(deny, one_hour, held(), usage).action == "admit"  # 9 + 1 × 1 h = 10: fits exactly
    two_hours = ask("h200-whole", reserve=timedelta(hours=2))
    decision = decide(deny, two_hours, held(), usage)
    assert decision.action == "deny"
    assert decision.reason == (
        'team "vision": budget of 10 GPU-hours for 2026-11 used: 9 (90%), and the 2 GPU-hours this request '
        "reserves do not fit; resets 2026-12-01 00:00 UTC"
    )
    quarter = ask("h200-quarter", reserve=timedelta(hours=4))  # 0.25 × 4 h = 1 GPU-hour
    assert decide(deny, quarter, held(), usage).action == "admit"


# --- alert thresholds ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("team_used", "expected"), [
    (F(0), []),
    (F(4999, 100), []),
    (F(50), [Decimal("0.5")]),
    (F(7999, 100), [Decimal("0.5")]),
    (F(80), [Decimal("0.5"), Decimal("0.8")]),
    (F(100), [Decimal("0.5"), Decimal("0.8"), Decimal("1.0")]),
    (F(250), [Decimal("0.5"), Decimal("0.8"), Decimal("1.0")]),
])
def test_thresholds_reached_for_the_team_budget(policy, team_used, expected):
    alerts = decide(policy, ask(), held(), used(team_used, a100=team_used)).alerts
    assert [a.threshold for a in alerts if a.scope == ""] == expected
    assert all(a.period == PERIOD and a.team == "vision" and a.budget == 100 for a in alerts)


def test_thresholds_of_a_per_model_budget_have_their_own_scope(policy):
    alerts = reached_alerts(policy, "vision", used(48, h200=48))
    assert [(a.scope, a.threshold) for a in alerts] == [("H200", Decimal("0.5")), ("H200", Decimal("0.8"))]
    assert alerts[1].message == (
        'team "vision" has used 80% of its H200 budget of 60 GPU-hours for 2026-11 (48 GPU-hours, 80%)'
    )


def test_default_thresholds_are_80_and_100_percent(policy):
    alerts = reached_alerts(policy, "nlp", used(240, name="nlp"))
    assert [a.threshold for a in alerts] == [Decimal("0.8")]
    assert alerts[0].threshold_text == "0.8"
    assert Alert("nlp", PERIOD, "", Decimal("1.0"), F(300), Decimal(300)).threshold_text == "1"


def test_a_zero_budget_denies_gpus_and_sends_no_alerts(make_policy):
    zero = make_policy(teams={"vision": {"budget": {"gpu_hours": 0, "per_model": {}, "on_exhausted": "deny"}}})
    decision = decide(zero, ask(), held(), used())
    assert decision.action == "deny" and decision.alerts == ()
    assert decision.reason == ('team "vision": budget of 0 GPU-hours for 2026-11 used: 0 (no budget); '
                               "resets 2026-12-01 00:00 UTC")


def test_a_team_without_budget_or_quota_is_always_admitted(make_policy):
    free = make_policy(teams={"vision": {"quota": None, "budget": None}})
    decision = decide(free, ask("h200-two"), held(("alice", "H200", 5)), used(10**6, h200=10**6))
    assert decision == dataclasses.replace(decision, action="admit", alerts=())


def test_decisions_are_frozen(policy):
    decision = decide(policy, ask(), held(), used())
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.action = "deny"  # type: ignore[misc]


# --- bad input -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("request_", "message"), [
    (ask(team="robots"), r"unknown team 'robots' \(known: nlp, vision\)"),
    (ask("h200-huge"), r"no such profile: 'h200-huge'; options include: cpu, h200-quarter"),
    (ask("h200-half", team="nlp"), r"profile 'h200-half' is not offered to team 'nlp' \(its profiles: cpu, "),
    (ask(at=datetime(2026, 11, 15)), r"has no timezone"),
    (ask("h200-quarter", model="H200", share=F(1, 4)), r"either a profile or a model and share"),
    (ask(None, model="H200"), r"give a profile, or both a GPU model and a share"),
    (ask(None, model="V100", share=F(1)), r"unknown GPU model 'V100' \(known: H200, A100-80GB\)"),
    (ask(None, model="H200", share=0.25), r"share must be a Fraction above 0"),
    (ask(None, model="H200", share=F(0)), r"share must be a Fraction above 0"),
    (ask(user=""), r"names no user"),
    (ask(reserve=timedelta(hours=-1)), r"reserve must be a timedelta of 0 or more"),
])
def test_bad_requests_are_value_errors_that_say_what_is_accepted(policy, request_, message):
    with pytest.raises(ValueError, match=message):
        decide(policy, request_, held(), used())


def test_usage_of_another_period_is_refused(policy):
    with pytest.raises(ValueError, match="usage given is for 2026-10"):
        decide(policy, ask(), held(), Usage("2026-10", {}))


# --- properties ----------------------------------------------------------------------------------------------------

GPU_PROFILES = {"h200-quarter": ("H200", F(1, 4)), "h200-half": ("H200", F(1, 2)), "h200-mig": ("H200", F(1, 7)),
                "h200-whole": ("H200", F(1)), "a100-whole": ("A100-80GB", F(1))}
shares = st.sampled_from([F(0), F(1, 7), F(1, 4), F(1, 2), F(3, 4), F(1)])


@settings(max_examples=300, deadline=None)
@given(
    profile=st.sampled_from(sorted(GPU_PROFILES)),
    on_exhausted=st.sampled_from(["alert", "deprioritize", "deny"]),
    alice=st.tuples(shares, shares), bob=st.tuples(shares, shares),
    team_used=st.fractions(min_value=0, max_value=150, max_denominator=100),
    h200_used=st.fractions(min_value=0, max_value=90, max_denominator=100),
)
def test_admitted_work_never_exceeds_a_quota_and_deny_never_admits_over_budget(
    make_policy, profile, on_exhausted, alice, bob, team_used, h200_used
):
    policy = with_exhausted(make_policy, on_exhausted)
    holdings = held(("alice", "H200", alice[0]), ("alice", "A100-80GB", alice[1]),
                    ("bob", "H200", bob[0]), ("bob", "A100-80GB", bob[1]))
    decision = decide(policy, ask(profile), holdings, used(team_used, h200=h200_used))
    model, share = GPU_PROFILES[profile]
    if decision.action == "admit":
        assert holdings.team.get("vision", 0) + share <= 2
        assert holdings.team_user.get(("vision", "alice"), 0) + share <= 1
        assert model != "H200" or holdings.team_model.get(("vision", "H200"), 0) + share <= F(3, 2)
    over = team_used >= 100 or (model == "H200" and h200_used >= 60)
    if on_exhausted == "deny" and over:
        assert decision.action == "deny"
    if decision.action == "wait":
        assert "(quota" in decision.reason
