"""Fixtures of the in-process tests: a small policy with two GPU models (`make_policy`, `policy`), used by the
pure decisions' tests (tests/unit/policies) and the records' (tests/unit/accounting)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from gpupool.policies.model import Policy

BASE_POLICY: dict[str, Any] = {
    "models": {
        "H200": {"vendor": "nvidia", "memory_gib": 141, "backends": ["hami", "mig", "whole"],
                 "mig": {"profiles": ["1g.18gb", "2g.35gb"]}},
        "A100-80GB": {"vendor": "nvidia", "memory_gib": 80, "backends": ["hami", "whole"]},
    },
    "profiles": {
        "cpu": {"display_name": "CPU only", "teams": ["vision", "nlp"]},
        "h200-quarter": {"display_name": "0.25 × H200", "gpu": {"model": "H200", "share": 0.25},
                         "teams": ["vision", "nlp"]},
        "h200-half": {"display_name": "0.5 × H200", "gpu": {"model": "H200", "share": 0.5}, "teams": ["vision"]},
        "h200-mig": {"display_name": "MIG 1g.18gb", "gpu": {"model": "H200", "mig": "1g.18gb"},
                     "teams": ["vision", "nlp"]},
        "h200-whole": {"display_name": "1 × H200", "gpu": {"model": "H200", "count": 1}, "teams": ["vision"]},
        "h200-two": {"display_name": "2 × H200", "gpu": {"model": "H200", "count": 2}, "teams": ["vision"]},
        "a100-whole": {"display_name": "1 × A100", "gpu": {"model": "A100-80GB", "count": 1},
                       "teams": ["vision", "nlp"]},
        "h200-quarter-spot": {"display_name": "0.25 × H200 (preemptible)", "preemptible": True,
                              "gpu": {"model": "H200", "share": 0.25}, "teams": ["vision"]},
    },
    "teams": {
        "vision": {"display_name": "Computer vision", "priority": 100,
                   "quota": {"gpus": 2, "per_user_gpus": 1, "per_model": {"H200": 1.5}},
                   "budget": {"gpu_hours": 100, "per_model": {"H200": 60}, "on_exhausted": "alert",
                              "alert_thresholds": [0.5, 0.8, 1.0]}},
        "nlp": {"priority": 50, "quota": {"gpus": 1}, "budget": {"gpu_hours": 300, "on_exhausted": "alert"}},
    },
    "billing": {"currency": "EUR", "prices": {"H200": "3.20", "A100-80GB": "1.80"}},
}


def merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`base` with `changes` merged in, section by section (None removes a key, {} empties a section)."""
    result = copy.deepcopy(base)
    for key, value in changes.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and value and isinstance(result.get(key), dict):
            result[key] = merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


@pytest.fixture(scope="session")
def make_policy() -> Callable[..., Policy]:
    """make_policy(teams={"vision": {"budget": {"on_exhausted": "deny"}}}) → the test policy, changed.

    Policies are immutable, so one factory serves the session (and hypothesis tests).
    """

    def make(**changes: Any) -> Policy:
        return Policy.model_validate(merge(BASE_POLICY, changes))

    return make


@pytest.fixture(scope="session")
def policy(make_policy: Callable[..., Policy]) -> Policy:
    return make_policy()
