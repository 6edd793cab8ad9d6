"""Fixtures of the accounting tests: a ledger on each database (the policy fixtures are in tests/unit/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpupool.hub.accounting.ledger import Ledger


@pytest.fixture
def ledger(database_url: str) -> Iterator[Ledger]:
    ledger = Ledger(database_url)
    yield ledger
    ledger.dispose()
