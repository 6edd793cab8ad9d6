"""The policy model: GPU models, profiles, teams, quotas, budgets and prices, loaded from `policies/*.yaml`."""

from pathlib import Path

from gpupool.policies.loader import PolicyError, PolicyProblem, load_policy
from gpupool.policies.model import Policy

#: The default policy set shipped with gpupool (two declared H200s, teams vision and nlp).
DEFAULT_POLICY_DIR = Path(__file__).parent
EXAMPLES_DIR = DEFAULT_POLICY_DIR / "examples"

__all__ = ["DEFAULT_POLICY_DIR", "EXAMPLES_DIR", "Policy", "PolicyError", "PolicyProblem", "load_policy"]
