"""Bills: a seeded month against a bill worked out by hand, to the cent; CSV, JSON and HTML; the command."""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime
from decimal import Decimal
from fractions import Fraction

import pytest

from gpupool.hub.accounting.bills import (
    BillLine, UserLine, bill_command, bill_for, bills_for_period, make_bill, render_bill, round_half_up,
)
from gpupool.hub.accounting.ledger import Ledger, UsageRow

F = Fraction
D = Decimal
NOW = datetime(2026, 12, 5, tzinfo=UTC)  # November has ended: its bill is final


def t(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def seed(ledger: Ledger) -> None:
    """November 2026 for team vision (prices: H200 3.20, A100-80GB 1.80 per GPU-hour), plus noise."""
    def run(key, user, profile, model, share, start, end=None, team="vision"):
        ledger.open_interval(key, user, team, profile, model, share, start)
        if end is not None:
            ledger.close_interval(key, end, "stopped")

    run("a1", "alice", "h200-quarter", "H200", F(1, 4), t(2026, 11, 2, 8), t(2026, 11, 2, 18))  # 10 h
    run("b1", "bob", "h200-quarter", "H200", F(1, 4), t(2026, 11, 3, 9), t(2026, 11, 3, 14))  # 5 h
    run("a2", "alice", "h200-mig", "H200", F(1, 7), t(2026, 11, 4, 9), t(2026, 11, 4, 16))  # 7 h
    run("c1", "carol", "h200-mig", "H200", F(1, 7), t(2026, 11, 5, 9), t(2026, 11, 5, 12))  # 3 h
    run("b2", "bob", "a100-whole", "A100-80GB", F(1), t(2026, 11, 6, 10), t(2026, 11, 6, 12, 30, 10))  # 2 h 30 min 10 s
    run("d1", "dave", "h200-half", "H200", F(1, 2), t(2026, 10, 31, 22), t(2026, 11, 1, 2))  # 2 h in October
    run("a3", "alice", "h200-whole", "H200", F(1), t(2026, 11, 30, 23), t(2026, 12, 1, 1))  # 1 h in December
    run("e1", "erin", "h200-quarter", "H200", F(1, 4), t(2026, 11, 30, 20))  # still open on 5 December
    run("n1", "nina", "h200-quarter", "H200", F(1, 4), t(2026, 11, 7), t(2026, 11, 8), team="nlp")
    run("o1", "alice", "h200-quarter", "H200", F(1, 4), t(2026, 10, 5), t(2026, 10, 6))  # October only


#: Worked out by hand:
#: - h200-quarter: alice 0.25 × 10 h = 2.5, bob 0.25 × 5 h = 1.25, erin 0.25 × 4 h (20:00 to the month's end)
#:   = 1; 4.75 GPU-hours × 3.20 = 15.20
#: - h200-mig: alice 1/7 × 7 h = 1, carol 1/7 × 3 h = 3/7; 10/7 = 1.428571… × 3.20 = 4.571428… → 4.57
#: - a100-whole: bob 1 × 9010 s = 9010/3600 GPU-hours × 1.80 = 4.505 → 4.51 (half up; half-even would say 4.50)
#: - h200-half: dave 0.5 × 2 h after midnight on 1 November = 1 × 3.20 = 3.20
#: - h200-whole: alice 1 × 1 h before midnight on 30 November = 1 × 3.20 = 3.20
#: total 4.51 + 3.20 + 4.57 + 15.20 + 3.20 = 30.68
EXPECTED_LINES = (
    BillLine("A100-80GB", "a100-whole", F(9010, 3600), D("1.80"), D("4.51")),
    BillLine("H200", "h200-half", F(1), D("3.20"), D("3.20")),
    BillLine("H200", "h200-mig", F(10, 7), D("3.20"), D("4.57")),
    BillLine("H200", "h200-quarter", F(19, 4), D("3.20"), D("15.20")),
    BillLine("H200", "h200-whole", F(1), D("3.20"), D("3.20")),
)
EXPECTED_USERS = (
    UserLine("alice", "H200", "h200-mig", F(1), D("3.20")),
    UserLine("alice", "H200", "h200-quarter", F(5, 2), D("8.00")),
    UserLine("alice", "H200", "h200-whole", F(1), D("3.20")),
    UserLine("bob", "A100-80GB", "a100-whole", F(9010, 3600), D("4.51")),
    UserLine("bob", "H200", "h200-quarter", F(5, 4), D("4.00")),
    UserLine("carol", "H200", "h200-mig", F(3, 7), D("1.37")),
    UserLine("dave", "H200", "h200-half", F(1), D("3.20")),
    UserLine("erin", "H200", "h200-quarter", F(1), D("3.20")),
)


def test_a_seeded_month_matches_the_bill_worked_out_by_hand(ledger, policy):
    seed(ledger)
    bill = bill_for(ledger, policy, "vision", "2026-11", now=NOW)
    assert bill.lines == EXPECTED_LINES
    assert bill.users == EXPECTED_USERS
    assert bill.total == D("30.68")
    assert bill.gpu_hours == F(9010, 3600) + 1 + F(10, 7) + F(19, 4) + 1
    assert (bill.team_name, bill.currency, bill.provisional) == ("Computer vision", "EUR", False)
    # Reconciles with the ledger exactly: the lines' hours, the users' hours and the ledger's sum agree.
    assert bill.gpu_hours == ledger.gpu_hours("2026-11", (), team="vision", now=NOW)[()]
    assert sum((u.gpu_hours for u in bill.users), F(0)) == bill.gpu_hours
    assert bill.total == sum((line.amount for line in bill.lines), D(0))


def test_every_teams_bill_from_one_query(ledger, policy):
    seed(ledger)
    bills = bills_for_period(ledger, policy, "2026-11", now=NOW)
    assert sorted(bills) == ["nlp", "vision"]
    assert bills["vision"].lines == EXPECTED_LINES
    assert bills["nlp"].lines == (BillLine("H200", "h200-quarter", F(6), D("3.20"), D("19.20")),)
    october = bills_for_period(ledger, policy, "2026-10", now=NOW)["vision"]
    assert october.lines == (
        BillLine("H200", "h200-half", F(1), D("3.20"), D("3.20")),
        BillLine("H200", "h200-quarter", F(6), D("3.20"), D("19.20")),
    )


def test_a_team_no_longer_in_the_policy_is_still_billed(ledger, make_policy):
    seed(ledger)
    without_nlp = make_policy(teams={"nlp": None},
                              profiles={name: {"teams": ["vision"]} for name in ("cpu", "h200-quarter", "h200-mig",
                                                                                   "a100-whole")})
    bills = bills_for_period(ledger, without_nlp, "2026-11", now=NOW)
    assert (bills["nlp"].team_name, bills["nlp"].total) == ("nlp", D("19.20"))


def test_a_running_month_is_provisional_and_counts_open_intervals_so_far(ledger, policy):
    seed(ledger)
    bill = bill_for(ledger, policy, "vision", "2026-12", now=NOW)
    assert bill.provisional and bill.as_of == NOW
    # alice's 1 h after midnight on 1 December; erin 0.25 × 4 days = 24 GPU-hours so far.
    assert [(line.profile, line.gpu_hours) for line in bill.lines] == [("h200-quarter", F(24)), ("h200-whole", F(1))]


def test_cents_are_rounded_half_up_per_line():
    assert round_half_up(F(4505, 1000), 2) == D("4.51")
    assert round_half_up(F(4504999, 1000000), 2) == D("4.50")
    assert round_half_up(F(0), 2) == D("0.00")
    with pytest.raises(ValueError, match="negative"):
        round_half_up(F(-1), 2)


def test_a_model_without_a_price_is_a_clear_error(make_policy):
    policy = make_policy(billing={"prices": {"A100-80GB": None}})
    rows = [UsageRow("vision", "bob", "A100-80GB", "a100-whole", F(1))]
    with pytest.raises(ValueError, match=r"no price for A100-80GB in billing.prices \(priced: H200\)"):
        make_bill(policy, "vision", "2026-11", rows, NOW)
    free = make_policy(billing={"prices": {}})
    assert make_bill(free, "vision", "2026-11", rows, NOW).total == D("0.00")


# --- rendering ----------------------------------------------------------------------------------------------


def bill_of(make_policy, user="alice", display_name="Computer vision"):
    policy = make_policy(teams={"vision": {"display_name": display_name}})
    rows = [UsageRow("vision", user, "H200", "h200-quarter", F(5, 2)),
            UsageRow("vision", "bob", "A100-80GB", "a100-whole", F(9010, 3600))]
    return make_bill(policy, "vision", "2026-11", rows, NOW)


def test_csv(make_policy):
    text = render_bill(bill_of(make_policy), "csv")
    assert list(csv.reader(io.StringIO(text))) == [
        ["section", "team", "period", "user", "model", "profile", "gpu_hours", "unit_price", "amount", "currency"],
        ["line", "vision", "2026-11", "", "A100-80GB", "a100-whole", "2.5028", "1.80", "4.51", "EUR"],
        ["line", "vision", "2026-11", "", "H200", "h200-quarter", "2.5000", "3.20", "8.00", "EUR"],
        ["user", "vision", "2026-11", "alice", "H200", "h200-quarter", "2.5000", "", "8.00", "EUR"],
        ["user", "vision", "2026-11", "bob", "A100-80GB", "a100-whole", "2.5028", "", "4.51", "EUR"],
        ["total", "vision", "2026-11", "", "", "", "5.0028", "", "12.51", "EUR"],
    ]


def test_csv_cells_cannot_become_spreadsheet_formulas(make_policy):
    text = render_bill(bill_of(make_policy, user="=HYPERLINK(\"http://x\")"), "csv")
    assert "'=HYPERLINK" in text and ",=HYPERLINK" not in text


def test_json_keeps_money_and_hours_exact(make_policy):
    data = json.loads(render_bill(bill_of(make_policy), "json"))
    assert data["total"] == "12.51" and data["currency"] == "EUR" and data["provisional"] is False
    assert data["lines"][0] == {"model": "A100-80GB", "profile": "a100-whole", "gpu_hours": "2.5028",
                                "gpu_hours_exact": "901/360", "unit_price": "1.80", "amount": "4.51"}
    assert data["users"][0]["user"] == "alice"
    assert F(data["gpu_hours_exact"]) == F(5, 2) + F(9010, 3600)
    assert (data["start"], data["end"]) == ("2026-11-01T00:00:00+00:00", "2026-12-01T00:00:00+00:00")


def test_html_is_self_contained_printable_and_escapes_what_users_wrote(make_policy):
    page = render_bill(bill_of(make_policy, user="<script>alert(1)</script>", display_name="R&D <b>"), "html")
    assert page.startswith("<!DOCTYPE html>")
    assert "<script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "R&amp;D &lt;b&gt;" in page and "<b>" not in page
    assert "@media print" in page and "@page" in page
    assert "src=" not in page and "<link" not in page  # nothing to fetch: it prints offline
    assert "12.51" in page and "Provisional" not in page


def test_unknown_format(make_policy):
    with pytest.raises(ValueError, match=r"unknown bill format 'pdf' \(accepted: csv, json, html\)"):
        render_bill(bill_of(make_policy), "pdf")


# --- the command -------------------------------------------------------------------------------------------------


def test_bill_command(ledger, policy, database_url):
    seed(ledger)
    text = bill_command(database_url, policy, "vision", "2026-11", "csv", now=NOW)
    assert text.splitlines()[-1] == "total,vision,2026-11,,,,10.6813,,30.68,EUR"
    assert json.loads(bill_command(database_url, policy, "vision", "2026-11", "json", now=NOW))["total"] == "30.68"
    assert "Computer vision" in bill_command(database_url, policy, "vision", "2026-11", "html", now=NOW)


@pytest.mark.parametrize(("args", "message"), [
    (("robots", "2026-11", "csv"), r"unknown team 'robots' \(known: nlp, vision\)"),
    (("vision", "2026-13", "csv"), r"'2026-13' is not a billing period \(accepted: a UTC calendar month YYYY-MM"),
    (("vision", "2026-11", "xml"), r"unknown bill format 'xml' \(accepted: csv, json, html\)"),
])
def test_bill_command_bad_arguments(ledger, policy, database_url, args, message):
    with pytest.raises(ValueError, match=message):
        bill_command(database_url, policy, *args)


def test_bill_command_without_a_ledger(tmp_path, policy):
    with pytest.raises(ValueError, match=r"no ledger at .*none.sqlite \(the file does not exist\); start the hub"):
        bill_command(f"sqlite:///{tmp_path / 'none.sqlite'}", policy, "vision", "2026-11", "csv")
