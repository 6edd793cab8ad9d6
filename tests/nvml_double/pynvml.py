"""A TEST DOUBLE of `pynvml` (nvidia-ml-py), for the idle culler's tests on machines without an NVIDIA GPU.

Put this folder first on PYTHONPATH and point GPUPOOL_NVML_DOUBLE at a JSON file the test writes:
`{"cards": ["GPU-…", …], "utilization": {"PID": SM percent, …}, "memory": {"PID": bytes, …}}`. Each call of
`nvmlDeviceGetProcessUtilization` returns one sample, stamped now, per process listed with a utilisation on
any card, as NVML returns the samples since the asked timestamp; none since it raises NVMLError_NotFound, as
NVML does. It implements only what gpupool calls; the real library is what runs on a GPU machine (`--gpu`).
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
    now = int(time.time() * 1_000_000)
    samples = [SimpleNamespace(pid=int(pid), timeStamp=now, smUtil=int(sm), memUtil=0, encUtil=0, decUtil=0)
               for pid, sm in _state().get("utilization", {}).items()]
    if not samples or now <= last_seen:
        raise NVMLError_NotFound("no samples since the timestamp")
    return samples
