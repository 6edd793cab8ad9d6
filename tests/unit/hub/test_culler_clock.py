"""The idle culler's clock (`IdleCuller.clock_offset_file`): the system clock unless the admin names an offset file;
an offset that only grows; other processes' times moved by the offset in force when they happened."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gpupool.hub import culler
from gpupool.policies import periods


@pytest.fixture
def system(monkeypatch):
    """The system clock, stopped at a known time; move it with `system[0] += …`."""
    now = [datetime(2026, 5, 1, 10, 0, tzinfo=UTC)]
    monkeypatch.setattr(periods, "utcnow", lambda: now[0])
    return now


def test_without_an_offset_file_the_culler_reads_the_system_clock(system):
    clock = culler.Clock("")
    assert clock.now() == system[0]
    assert clock.from_system(system[0] - timedelta(minutes=3)) == system[0] - timedelta(minutes=3)
    assert culler.IdleCuller().clock_offset_file == ""  # production: no file, no offset


def test_the_offset_moves_the_culler_and_never_back(system, tmp_path, caplog):
    path = tmp_path / "clock"
    path.write_text("-7200\n")
    clock = culler.Clock(str(path))
    assert clock.now() == system[0] - timedelta(hours=2)
    path.write_text("-600")  # the test lets 110 minutes pass at once
    system[0] += timedelta(seconds=5)
    assert clock.now() == system[0] - timedelta(minutes=10)
    path.write_text("-3600")  # back: refused, the offset stays; said once, not at every look
    assert clock.now() == clock.now() == system[0] - timedelta(minutes=10)
    assert [r.getMessage() for r in caplog.records if "never goes back" in r.getMessage()] == [
        f"{path}: the culler's clock never goes back: not -3600.0 s after -600.0 s; the culler's clock keeps its "
        "offset of -600.0 s"]
    path.write_text("soon")  # not a number once running: refused, the offset stays
    assert clock.now() == system[0] - timedelta(minutes=10)
    assert "must be a number of seconds" in caplog.text
    path.unlink()  # no file: no offset, the system's time
    assert clock.now() == system[0]


def test_a_bad_offset_file_fails_the_start_naming_it(tmp_path):
    for text in ("an hour", "nan", "inf"):
        path = tmp_path / "clock"
        path.write_text(text)
        with pytest.raises(ValueError, match=f"{path}: the culler's clock offset must be a number of seconds"):
            culler.Clock(str(path))
    assert culler.Clock(str(tmp_path / "none")).now() is not None  # a missing file: no offset yet


def test_other_processes_times_move_by_the_offset_in_force_when_they_happened(system, tmp_path):
    path = tmp_path / "clock"
    path.write_text("-7200")
    clock = culler.Clock(str(path))
    started = system[0]
    before = system[0] - timedelta(minutes=5)  # a server started before the culler read its clock
    system[0] += timedelta(minutes=1)
    path.write_text("-3600")
    clock.now()
    moved_at = system[0]
    system[0] += timedelta(minutes=1)
    assert clock.from_system(before) == before - timedelta(hours=2)
    assert clock.from_system(started + timedelta(seconds=30)) == started + timedelta(seconds=30) - timedelta(hours=2)
    # A kernel's activity after the culler saw the clock move is as recent in its time as it was in the system's.
    assert clock.from_system(moved_at + timedelta(seconds=10)) == moved_at + timedelta(seconds=10) - timedelta(hours=1)
    assert clock.now() - clock.from_system(moved_at + timedelta(seconds=10)) == timedelta(seconds=50)
