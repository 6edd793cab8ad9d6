"""The idle culler's signals, each against the real thing where it runs here: HAMi's metric names served by a real
`prometheus_client` exporter (the Kubernetes path), the process table (CPU of a server's process tree), a real
Jupyter server's API (kernels); NVML through a TEST DOUBLE (no GPU here; `--gpu` runs tests/e2e/test_gpu.py for real).
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from gpupool.hub.idle_signals import (
    DCGM_ENGINE_ACTIVE, HAMI_LAST_KERNEL, HAMI_UTILIZATION, CPUMeter, NVMLGPU, PodGPUMetrics, ProcessTable, ProcessTree,
)

LABELS = ["podnamespace", "podname", "ctrname", "vdeviceid", "deviceuuid"]


@pytest.fixture
def hami_exporter():
    """HAMi's vGPU monitor's per-container metrics, by their names and labels, served by prometheus_client."""
    registry = CollectorRegistry()
    utilization = Gauge(HAMI_UTILIZATION, "Container device utilization description", LABELS, registry=registry)
    last_kernel = Gauge(HAMI_LAST_KERNEL, "Container device last kernel description", LABELS, registry=registry)
    memory = Gauge("vGPU_device_memory_usage_in_bytes", "vGPU device usage", LABELS, registry=registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    port = server.server_port
    yield f"http://127.0.0.1:{port}/metrics", utilization, last_kernel, memory
    server.shutdown()
    thread.join(5)


def test_hami_metrics_give_each_pods_own_gpu_use(hami_exporter):
    url, utilization, last_kernel, memory = hami_exporter
    busy = ("users", "jupyter-alice", "notebook", "0", "GPU-aaaa")
    idle = ("users", "jupyter-bob", "notebook", "0", "GPU-aaaa")  # the same card: its neighbour's use is not bob's
    utilization.labels(*busy).set(63)
    last_kernel.labels(*busy).set(2)
    utilization.labels(*idle).set(0)
    last_kernel.labels(*idle).set(5400)
    memory.labels(*idle).set(8 * 2**30)  # holding memory is not using the GPU
    # A pod with two shares (two cards): the busier one counts.
    utilization.labels("users", "jupyter-carol", "notebook", "0", "GPU-bbbb").set(0)
    utilization.labels("users", "jupyter-carol", "notebook", "1", "GPU-cccc").set(40)
    last_kernel.labels("users", "jupyter-dave", "notebook", "0", "GPU-dddd").set(1)  # a kernel since the last pass

    metrics = PodGPUMetrics([url])
    metrics.refresh()
    assert metrics.reading("users", "jupyter-alice", 60).percent == 100.0  # a kernel 2 s ago: busy
    bob = metrics.reading("users", "jupyter-bob", 60)
    assert bob.percent == 0.0 and bob.note == "last kernel 5400 s ago"
    assert metrics.reading("users", "jupyter-carol", 60).percent == 40.0
    assert metrics.reading("users", "jupyter-dave", 60).percent == 100.0
    unknown = metrics.reading("other", "jupyter-alice", 60)  # another namespace's pod of that name
    assert unknown.percent is None and "no HAMi metrics for pod other/jupyter-alice" in unknown.note


def test_dcgm_exporters_engine_activity_per_pod():
    # NVIDIA's DCGM exporter with its pod mapping: a device or MIG slice per pod, its engine's active ratio.
    registry = CollectorRegistry()
    active = Gauge(DCGM_ENGINE_ACTIVE, "Ratio of time the graphics engine is active", ["gpu", "UUID", "GPU_I_ID",
                   "namespace", "pod", "container"], registry=registry)
    active.labels("0", "GPU-aaaa", "3", "users", "jupyter-alice", "notebook").set(0.42)
    active.labels("0", "GPU-aaaa", "5", "users", "jupyter-bob", "notebook").set(0.0)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    port = server.server_port
    try:
        metrics = PodGPUMetrics([f"http://127.0.0.1:{port}/metrics"], "dcgm")
        metrics.refresh()
        assert metrics.reading("users", "jupyter-alice", 60).percent == pytest.approx(42.0)
        assert metrics.reading("users", "jupyter-bob", 60).percent == 0.0
        assert "no DCGM metrics for pod users/jupyter-carol" in metrics.reading("users", "jupyter-carol", 60).note
    finally:
        server.shutdown()
        thread.join(5)


def test_hami_metrics_that_do_not_answer_leave_the_signal_unknown():
    with socket.socket() as probe:  # a port nothing listens on once the probe is closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    metrics = PodGPUMetrics([f"http://127.0.0.1:{port}/metrics"], timeout=2)
    metrics.refresh()
    reading = metrics.reading("users", "jupyter-alice", 60)
    assert reading.percent is None and "Connection refused" in reading.note


def test_cpu_of_a_process_tree_busy_and_sleeping():
    sleeping = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    # A parent that sleeps while its child computes: the tree is busy.
    busy = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run([sys.executable, '-c', "
                                                  "'while True: pass'])"])
    try:
        meter = CPUMeter()
        trees = {name: ProcessTree(p.pid, psutil.Process(p.pid).create_time())
                 for name, p in (("sleeping", sleeping), ("busy", busy))}
        deadline = time.monotonic() + 30
        while len(trees["busy"].processes()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        # The busy tree read from one snapshot of the process table, as a culling pass reads it.
        trees["busy"] = ProcessTree(busy.pid, psutil.Process(busy.pid).create_time(), ProcessTable())
        assert len(trees["busy"].processes()) == 2
        first = {name: meter.percent(name, tree.processes()) for name, tree in trees.items()}
        assert first["busy"] == (None, "first look: CPU use is measured from the next one")
        time.sleep(1.5)
        second = {name: meter.percent(name, tree.processes())[0] for name, tree in trees.items()}
        assert second["sleeping"] < 5 and second["busy"] > second["sleeping"]
        # A PID whose start time is not the server's is not the server (a reused PID).
        assert ProcessTree(sleeping.pid, psutil.Process(sleeping.pid).create_time() - 100).processes() == []
    finally:
        for process in (sleeping, busy):
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
            process.kill()
            process.wait()


def test_nvml_per_process_samples_through_the_double(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("pynvml", Path(__file__).resolve().parents[2] / "nvml_double" / "pynvml.py")
    double = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(double)
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps({"cards": ["GPU-0", "GPU-1"], "utilization": {"101": 70, "202": 0},
                                   "memory": {"202": 3 * 2**30}}))
    monkeypatch.setenv("GPUPOOL_NVML_DOUBLE", str(samples))
    monkeypatch.setitem(sys.modules, "pynvml", double)
    gpu = NVMLGPU()
    assert gpu.available
    gpu.new_pass()
    assert gpu.reading(["GPU-0"], {101, 102}).percent == 70.0
    # Another server on the same card in the same pass reads the same samples (a second NVML call in the same
    # second would find none newer, and see a busy server idle).
    assert gpu.reading(["GPU-0"], {202}).percent == 0.0 and gpu.reading(["GPU-0"], {101}).percent == 70.0
    holding = gpu.reading(["GPU-1"], {202})
    assert holding.percent == 0.0 and holding.note == "holds 3072 MiB of GPU memory"
    assert gpu.reading(["GPU-9"], {101}).percent is None  # a card NVML does not know: unknown, not idle
    assert gpu.reading([], {101}).note == "the server holds no card"


def test_without_a_driver_the_gpu_signal_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # the import fails, as on a machine without nvidia-ml-py
    gpu = NVMLGPU()
    reading = gpu.reading(["GPU-0"], {1})
    assert not gpu.available and reading.percent is None and reading.note.startswith("no NVIDIA driver")


@pytest.mark.asyncio
async def test_idle_training_jobs_count_in_the_reports_and_busy_ones_do_not(tmp_path):
    # The culler's look at the embedded mode's running jobs (for the reports only), in-process, on real processes.
    from datetime import UTC, datetime

    import sqlalchemy as sa

    from gpupool.policies import periods
    from gpupool.hub.accounting.culls import IDLE_TIME, idle_figures
    from gpupool.hub.accounting.jobs import JobSubmission, resolve
    from gpupool.hub.culler import IdleCuller
    from gpupool.policies import load_policy
    from gpupool.policies.defaults import ledger_url

    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "policy.yaml").write_text(
        "models:\n  H200: {vendor: nvidia, memory_gib: 141, backends: [whole]}\n"
        "inventory:\n  - {model: H200, count: 2}\n"
        "teams:\n  vision: {}\n"
        "profiles:\n  h200: {display_name: 1 × H200, gpu: {model: H200, count: 1}, teams: [vision]}\n"
        "settings:\n  idle: {cpu_below_percent: 1}\n")  # a busy loop uses more than 1% even on a loaded machine
    culler = IdleCuller(policy_dir=str(policies), ledger_url=ledger_url(tmp_path), gpu_source="none",
                        hub_api_url="http://127.0.0.1:9/hub/api", api_token="unused")
    culler.initialize([])
    policy = load_policy(policies)
    processes = {"sleeping": subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]),
                 "busy": subprocess.Popen([sys.executable, "-c", "while True: pass"])}
    holdings = {}
    try:
        for kind, process in processes.items():
            resolved = resolve(policy, "alice", ["vision"], JobSubmission(profile="h200", command=["python"]))
            job = culler.jobs.submit("alice", resolved, JobSubmission(profile="h200", command=["python"]),
                                     datetime.now(UTC))
            holdings[kind] = f"job:{job.id}:1"
            started_ms = int(psutil.Process(process.pid).create_time() * 1000)
            assert culler.jobs.start_run(job.id, datetime.now(UTC), pid=process.pid, pid_started_ms=started_ms,
                                         holding=holdings[kind])
        for _ in range(2):  # the first look starts the CPU measure; the second sees the time between
            culler._table = ProcessTable()
            await culler.look_at_jobs()
            time.sleep(1.5)
        culler._table = ProcessTable()
        await culler.look_at_jobs()
    finally:
        for process in processes.values():
            process.kill()
            process.wait()
    with culler.ledger.engine.connect() as connection:
        rows = {row.run: row for row in connection.execute(sa.select(IDLE_TIME))}
    assert set(rows) == {holdings["sleeping"]} and rows[holdings["sleeping"]].kind == "job"
    assert rows[holdings["sleeping"]].idle_s >= 1
    figures = idle_figures(culler.ledger.engine, periods.period_of(periods.utcnow()))["vision"]
    assert figures.job_idle_gpu_hours > 0 and figures.idle_gpu_hours == 0 and figures.culled == 0
