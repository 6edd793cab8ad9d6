"""On a machine with an NVIDIA GPU (opt in with --gpu): the pool's cards come from NVML, MPS starts.

Skipped by default with the reason shown; `make test PYTEST_ARGS="--gpu -k gpu"` runs them.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

import pytest

from gpupool.policies.loader import load_policy_files
from gpupool.spawner.local import ensure_mps_daemon
from gpupool.spawner.pool import discover_cards

pytestmark = pytest.mark.gpu


def machine_policy(tmp_path):
    import pynvml

    pynvml.nvmlInit()
    try:
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        name = name.decode() if isinstance(name, bytes) else name
    finally:
        pynvml.nvmlShutdown()
    product = name.replace(" ", "-")
    (tmp_path / "policy.yaml").write_text(f"""
models: {{GPU: {{vendor: nvidia, memory_gib: 1, product: {product}, backends: [hami]}}}}
teams: {{t: {{}}}}
profiles: {{q: {{display_name: q, gpu: {{model: GPU, share: 0.25}}, teams: [t]}}}}
""")
    return load_policy_files([tmp_path / "policy.yaml"])


def test_cards_come_from_nvml(tmp_path):
    cards, source = discover_cards(machine_policy(tmp_path))
    assert source == "nvml" and cards
    assert all(c.uuid.startswith(("GPU-", "MIG-")) and c.model == "GPU" for c in cards)


@pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is None, reason="the driver ships no MPS daemon")
def test_mps_daemon_starts(tmp_path):
    try:
        assert ensure_mps_daemon(str(tmp_path), logging.getLogger("test"))
        assert (tmp_path / "mps" / "pipe" / "control").exists()
    finally:  # stop the daemon this test started
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "mps" / "pipe")}
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, env=env, check=False)
