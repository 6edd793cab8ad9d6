"""A TEST DOUBLE of `pynvml` (nvidia-ml-py), for the idle culler's tests on machines without an NVIDIA GPU.

Put this folder first on PYTHONPATH and point GPUPOOL_NVML_DOUBLE at a JSON file the test writes:
`{"cards": ["GPU-…", …], "utilization": {"PID": SM percent, …, or "*": every process}, "memory": {"PID": bytes}}`.
`nvmlDeviceGetProcessUtilization` returns one sample per process listed, stamped with the current whole second,
when that is newer than the asked timestamp, as NVML returns the samples since it; none raises
NVMLError_NotFound, as NVML does. It implements only what gpupool calls; the real library is what runs on a GPU machine (`--gpu`).
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace


class NVMLError(Exception):
    pass


class NVMLError_NotFound(NVMLError):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_InvalidArgument(NVMLError):
    pass


def _state() -> dict:
    with open(os.environ["GPUPOOL_NVML_DOUBLE"]) as file:
        return json.load(file)


def nvmlInit() -> None:
    _state()


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return len(_state()["cards"])


def nvmlDeviceGetHandleByIndex(index: int) -> str:
    return _state()["cards"][index]


def nvmlDeviceGetHandleByUUID(uuid) -> str:
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    if uuid not in _state()["cards"]:
        raise NVMLError_InvalidArgument(f"no card {uuid}")
    return uuid


def nvmlDeviceGetUUID(handle: str) -> str:
    return handle


def nvmlDeviceGetComputeRunningProcesses(handle: str) -> list:
    return [SimpleNamespace(pid=int(pid), usedGpuMemory=used) for pid, used in _state().get("memory", {}).items()]


def nvmlDeviceGetProcessUtilization(handle: str, last_seen: int) -> list:
    # As NVML: samples are taken at intervals (here one a second), and a call returns those newer than
    # `last_seen`; asked twice within a second, the second call finds none.
    stamp = int(time.time()) * 1_000_000
    utilization = _state().get("utilization", {})
    if "*" in utilization:  # every process on the machine (the test's way to say "everything is busy")
        import psutil

        utilization = {pid: utilization["*"] for pid in psutil.pids()}
    samples = [SimpleNamespace(pid=int(pid), timeStamp=stamp, smUtil=int(sm), memUtil=0, encUtil=0, decUtil=0)
               for pid, sm in utilization.items()]
    if not samples or stamp <= last_seen:
        raise NVMLError_NotFound("no samples since the timestamp")
    return samples
