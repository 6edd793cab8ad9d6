"""`gpupool bill`: a team's monthly bill from the ledger, as the command prints it."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from fractions import Fraction

from gpupool.hub.accounting.ledger import Ledger
from gpupool.hub.cli import main


def test_bill_command_prints_the_seeded_month(tmp_path, capsys):
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    start = datetime(2026, 11, 3, 8, tzinfo=UTC)
    ledger.open_interval("a1", "alice", "vision", "h200-quarter", "H200", Fraction(1, 4), start)
    ledger.close_interval("a1", datetime(2026, 11, 3, 18, tzinfo=UTC), "stopped")  # 10 h × 0.25 = 2.5 GPU-h
    ledger.dispose()
    assert main(["bill", "--team", "vision", "--period", "2026-11", "--format", "json",
                 "--state-dir", str(tmp_path)]) == 0
    bill = json.loads(capsys.readouterr().out)
    assert bill["team"] == "vision" and bill["currency"] == "EUR"
    assert bill["total"] == "8.00"  # 2.5 GPU-hours × 3.20 EUR


def test_bill_command_refuses_bad_input(tmp_path, capsys):
    assert main(["bill", "--team", "robotics", "--period", "2026-11", "--state-dir", str(tmp_path)]) == 1
    assert "unknown team 'robotics' (known: nlp, vision)" in capsys.readouterr().err
    assert main(["bill", "--team", "vision", "--period", "2026-13", "--state-dir", str(tmp_path)]) == 1
    assert "2026-13" in capsys.readouterr().err
