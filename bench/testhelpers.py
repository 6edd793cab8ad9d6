"""What the benchmarks borrow from the test suite: its helper modules (tests/kube_cluster.py, the test modules'
fixtures), loaded by path as pytest's importlib mode loads them. A benchmark runs as `python bench/NAME.py`,
which puts this folder on sys.path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))  # the test helpers import each other by module name, as under pytest


def load(name: str):
    """The module `name`.py: a support module in tests/, or a test module in its folders (tests/unit/spawner/…)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", next(TESTS.rglob(f"{name}.py")))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
