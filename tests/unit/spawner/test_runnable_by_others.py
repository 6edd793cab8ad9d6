"""Whether another account may run a file: every folder above it searchable by others, the file executable by
them (moved from tests/e2e/test_system_users.py, which makes real system users; this check needs none)."""

from __future__ import annotations

import os
from pathlib import Path

from gpupool.spawner.local import runnable_by_others


def test_runnable_by_others(tmp_path):
    private = tmp_path / "private"
    private.mkdir()
    os.chmod(private, 0o700)
    tool = private / "tool"
    tool.write_text("")
    os.chmod(tool, 0o755)
    assert not runnable_by_others(tool)
    assert runnable_by_others(Path("/bin/sh"))
