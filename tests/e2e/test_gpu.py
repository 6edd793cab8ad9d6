"""On a machine with an NVIDIA GPU (opt in with --gpu): the pool's cards come from NVML, MPS starts.

Skipped by default with the reason shown; `make test PYTEST_ARGS="--gpu -k gpu"` runs them.
"""

from __future__ import annotations

import importlib.util
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


# A kernel of the GPU, for the idle culler's signal: a CUDA loop (busy) and a process that holds a context and
# sleeps (idle), each its own process, as servers' kernels are.
CUDA_LOOP = """
import sys, time, torch
x = torch.randn(4096, 4096, device="cuda")
print("ready", flush=True)
if sys.argv[1] == "busy":
    while True:
        x = x @ x
        x = x / x.norm()
else:
    time.sleep(600)
"""


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch with CUDA to run a kernel")
def test_the_culler_sees_a_cuda_loop_busy_and_a_sleeping_context_idle():
    import subprocess
    import sys
    import time

    import pynvml

    from gpupool.hub.idle_signals import NVMLGPU

    pynvml.nvmlInit()
    uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    processes = {kind: subprocess.Popen([sys.executable, "-c", CUDA_LOOP, kind], stdout=subprocess.PIPE, text=True)
                 for kind in ("busy", "idle")}
    try:
        for process in processes.values():
            assert process.stdout.readline().strip() == "ready"
        gpu = NVMLGPU()
        gpu.reading([uuid], set())  # the first look starts NVML's sample window
        time.sleep(3)
        readings = {kind: gpu.reading([uuid], {p.pid}) for kind, p in processes.items()}
        assert readings["busy"].percent is not None and readings["busy"].percent > 1, readings
        assert readings["idle"].percent is not None and readings["idle"].percent < 1, readings
        assert "MiB of GPU memory" in readings["idle"].note  # it holds memory, and uses nothing
    finally:
        for process in processes.values():
            process.kill()
            process.wait()


def test_lora_sft_on_a_quarter_card_trains_in_bf16_on_the_gpu(tmp_path):
    """The lora-sft template on the GPU, as a quarter share: it says what it chose (bf16 where the card has it,
    the micro-batch for a quarter of the card's memory) and registers its adapter, logits checked."""
    import sys

    import torch
    import yaml

    from gpupool.images import TEMPLATES_DIR

    folder = tmp_path / "sft"
    shutil.copytree(TEMPLATES_DIR / "lora-sft", folder)
    config = yaml.safe_load((folder / "config.yaml").read_text())
    config["train"].update(steps=6, checkpoint_every=3)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "GPUPOOL_SHARE": "1/4", "GPUPOOL_GPU_MODEL": "GPU", "GPUPOOL_TEAM": "vision",
           "HF_HUB_OFFLINE": "1", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    done = subprocess.run([sys.executable, "train.py"], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    assert "gpupool: on 1/4 × GPU (" in done.stdout and f"): {precision}, batch 8" in done.stdout, done.stdout
    assert "the registered adapter gives the trained model's logits" in done.stdout
