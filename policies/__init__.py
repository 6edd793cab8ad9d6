"""The policy model: GPU models, profiles, teams, quotas, budgets and prices, loaded from `policies/*.yaml`; and
every pure decision made under it: admission (`admission`), preemption victims (`preemption`), restarts
(`restarts`), idleness (`idleness`), billing periods and the one clock (`periods`), card placement (`placement`).
No database, network, process or engine library is imported here (tests/unit/project/test_layers.py checks)."""

# The repository's folders are the `gpupool.*` packages (setup.cfg's package_dir). Imported under their
# folder's name (`import policies` with the repository root on sys.path) they would be a second copy of every
# module in them, with its own state: refused.
if __name__ != "gpupool.policies":
    raise ImportError(
        f"{__name__!r} is gpupool's policies/ folder imported by its folder name: import gpupool.policies "
        "instead (the folder is installed as gpupool.policies: `make install`, or `pip install -e .`)"
    )

from pathlib import Path

from gpupool.policies.loader import PolicyError, PolicyProblem, load_policy
from gpupool.policies.model import Policy

#: The default policy set shipped with gpupool (two declared H200s, teams vision and nlp).
DEFAULT_POLICY_DIR = Path(__file__).parent
EXAMPLES_DIR = DEFAULT_POLICY_DIR / "examples"

__all__ = ["DEFAULT_POLICY_DIR", "EXAMPLES_DIR", "Policy", "PolicyError", "PolicyProblem", "load_policy"]
