"""What the idle culler looks at, per server: thin edges over NVML, the process table and GPU metrics.

- `ProcessTree`: a server's own processes (embedded mode), the server process and its descendants, checked by
  PID and start time as the spawner does.
- `CPUMeter`: their CPU use since the last look, in % of one core.
- `NVMLGPU`: their GPU use from NVML's per-process samples (`nvmlDeviceGetProcessUtilization`) on the server's
  own cards, never the card's total: a neighbour's work on the same card does not keep a server alive.
- `PodGPUMetrics`: the same per pod from metrics in Prometheus' text format (HAMi's
  `Device_utilization_desc_of_container` and `Device_last_kernel_of_container`, or DCGM exporter's
  `DCGM_FI_PROF_GR_ENGINE_ACTIVE`), scraped from the exporters or a Prometheus `/federate`.

(Jupyter's own activity, kernels executing and the latest kernel or terminal activity, is reported by each server:
`gpupool.hub.lab_idle`.)

Each says when it cannot tell (no driver, no per-process samples under time-slicing or MIG, a metric missing),
and the culler then leaves that signal out rather than guess (`idleness.Signals`).
"""

from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass

import psutil

#: HAMi's vGPU monitor: a container's SM utilisation of its share (%), and seconds since its last kernel.
HAMI_UTILIZATION = "Device_utilization_desc_of_container"
HAMI_LAST_KERNEL = "Device_last_kernel_of_container"
#: NVIDIA's DCGM exporter: the ratio (0 to 1) of time a device's (or MIG slice's) graphics engine was active.
DCGM_ENGINE_ACTIVE = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"


# --- the server's processes (embedded) ----------------------------------------------------------------------


class ProcessTable:
    """Who is whose child, read once (a pass of the culler reads the process table once, not once per server)."""

    def __init__(self):
        self.children: dict[int, list[int]] = {}
        for process in psutil.process_iter(["ppid"]):
            self.children.setdefault(process.info["ppid"] or 0, []).append(process.pid)

    def descendants(self, pid: int) -> list[int]:
        found, todo = [], list(self.children.get(pid, ()))
        while todo:
            child = todo.pop()
            found.append(child)
            todo.extend(self.children.get(child, ()))
        return found


class ProcessTree:
    """The processes of a server started as PID `pid` at `started` (seconds since the epoch, as the spawner
    records it): empty when that process is gone (a PID reused since is not the server). With a `table`, its
    descendants come from that snapshot; without, from the process table now."""

    def __init__(self, pid: int | None, started: float | None, table: ProcessTable | None = None):
        self.pid, self.started, self.table = pid, started, table

    def processes(self) -> list[psutil.Process]:
        if not self.pid:
            return []
        try:
            root = psutil.Process(self.pid)
            if self.started is not None and abs(root.create_time() - self.started) > 1:
                return []
            if self.table is None:
                return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []
        found = [root]
        for pid in self.table.descendants(self.pid):
            try:
                found.append(psutil.Process(pid))
            except psutil.Error:
                continue  # ended since the snapshot
        return found


class CPUMeter:
    """CPU use of process trees between two looks, per server run, in % of one core."""

    def __init__(self):
        self._last: dict[str, tuple[float, float]] = {}

    @staticmethod
    def cpu_seconds(processes: list[psutil.Process]) -> float:
        total = 0.0
        for index, process in enumerate(processes):
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
            if index == 0:  # children that ended and were reaped count in their parent's totals
                total += times.children_user + times.children_system
        return total

    def percent(self, run: str, processes: list[psutil.Process]) -> tuple[float | None, str]:
        if not processes:
            self._last.pop(run, None)
            return None, "the server's processes are not on this machine"
        now, used = time.monotonic(), self.cpu_seconds(processes)
        before = self._last.get(run)
        self._last[run] = (now, used)
        if before is None or now <= before[0]:
            return None, "first look: CPU use is measured from the next one"
        return max(0.0, (used - before[1]) / (now - before[0]) * 100), ""

    def forget_except(self, runs: set[str]) -> None:
        for run in set(self._last) - runs:
            del self._last[run]


# --- GPU use of the server's own processes (embedded: NVML) ---------------------------------------------------


@dataclass(frozen=True)
class GPUReading:
    percent: float | None
    note: str = ""


class NVMLGPU:
    """Per-process GPU utilisation from NVML, on the cards a server holds (by UUID).

    NVML is opened once; `available` is False (and `why` says so) on a machine without an NVIDIA driver.
    `nvmlDeviceGetProcessUtilization` returns the samples since a timestamp: each look asks from the last
    sample it saw on that card, and a server's figure is the highest SM utilisation of its processes among them.
    """

    def __init__(self):
        self.why = ""
        self._last: dict[str, int] = {}
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as error:  # no driver, no library: NVMLError_LibraryNotFound and the like
            self.nvml, self.why = None, f"no NVIDIA driver on this machine ({error})"
            return
        self.nvml = pynvml

    @property
    def available(self) -> bool:
        return self.nvml is not None

    def all_cards(self) -> list[str]:
        """Every card NVML sees, by UUID (a job's processes are looked for on all of them)."""
        if self.nvml is None:
            return []
        found = []
        for index in range(self.nvml.nvmlDeviceGetCount()):
            uuid = self.nvml.nvmlDeviceGetUUID(self.nvml.nvmlDeviceGetHandleByIndex(index))
            found.append(uuid.decode() if isinstance(uuid, bytes) else uuid)
        return found

    def reading(self, cards: list[str], pids: set[int]) -> GPUReading:
        if self.nvml is None:
            return GPUReading(None, self.why)
        if not cards:
            return GPUReading(None, "the server holds no card")
        nvml, highest, memory = self.nvml, 0.0, 0
        for uuid in cards:
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            except nvml.NVMLError as error:
                return GPUReading(None, f"NVML does not know card {uuid} ({error})")
            try:
                for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if process.pid in pids and process.usedGpuMemory:
                        memory += process.usedGpuMemory
            except nvml.NVMLError:
                pass
            samples = self._samples(uuid, handle)
            if isinstance(samples, str):
                return GPUReading(None, samples)
            for sample in samples:
                if sample.pid in pids:
                    highest = max(highest, float(sample.smUtil))
        return GPUReading(highest, f"holds {memory // 2**20} MiB of GPU memory" if memory else "")

    def new_pass(self) -> None:
        """A culling pass begins: each card's samples since the last pass are read once, at its first reading, and
        serve every server (and job) on that card; a second read would find none newer and see them idle."""
        self._pass: dict[str, list | str] = {}

    def _samples(self, uuid: str, handle) -> list | str:
        """The card's per-process samples since the last pass (this pass's, read once), or why there are none."""
        cache = getattr(self, "_pass", None)
        if cache is None:
            cache = self._pass = {}
        if uuid in cache:
            return cache[uuid]
        nvml = self.nvml
        try:
            samples = list(nvml.nvmlDeviceGetProcessUtilization(handle, self._last.get(uuid, 0)))
        except nvml.NVMLError_NotFound:
            samples = []  # no process ran a kernel on this card since the last look
        except nvml.NVMLError_NotSupported:
            samples = f"card {uuid} gives no per-process samples (MIG or time-slicing): its GPU use is unknown"
        except nvml.NVMLError as error:
            samples = f"NVML failed on card {uuid} ({error})"
        for sample in samples if isinstance(samples, list) else ():
            self._last[uuid] = max(self._last.get(uuid, 0), int(sample.timeStamp))
        cache[uuid] = samples
        return samples


# --- GPU use from metrics (Kubernetes: HAMi) ------------------------------------------------------------------


@dataclass(frozen=True)
class MetricNames:
    """Where a per-pod GPU figure is in an exporter's metrics: the names of its namespace and pod labels, its
    utilisation metric and the factor to percent, and (HAMi only) the seconds since the pod's last kernel."""

    namespace_label: str
    pod_label: str
    utilization: str
    to_percent: float
    last_kernel: str | None = None


#: The exporters the culler reads: HAMi's vGPU monitor (a share's own SM utilisation, per container of a pod),
#: and NVIDIA's DCGM exporter with its Kubernetes pod mapping (the graphics engine's active ratio of a device or
#: MIG slice, per pod: right where each pod has its own device or slice, not for shares of one card).
METRICS = {
    "hami": MetricNames("podnamespace", "podname", HAMI_UTILIZATION, 1.0, HAMI_LAST_KERNEL),
    "dcgm": MetricNames("namespace", "pod", DCGM_ENGINE_ACTIVE, 100.0),
}


SOURCE_NAMES = {"hami": "HAMi", "dcgm": "DCGM"}


class PodGPUMetrics:
    """Per-pod GPU use from metrics in Prometheus' text format, read from `urls` once per culling pass: the
    exporter on each GPU node (HAMi's vGPU monitor, port 9394; DCGM exporter, port 9400), or a Prometheus
    server's `/federate?match[]=...`. `source`: `hami` or `dcgm` (`METRICS`)."""

    def __init__(self, urls: list[str], source: str = "hami", timeout: float = 10):
        self.urls, self.timeout = list(urls), timeout
        self.source, self.names = source, METRICS[source]
        self.by_pod: dict[tuple[str, str], tuple[float, float | None]] = {}
        self.errors: list[str] = []

    def refresh(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        names = self.names
        utilization: dict[tuple[str, str], float] = {}
        last_kernel: dict[tuple[str, str], float] = {}
        self.errors = []
        for url in self.urls:
            try:
                with urllib.request.urlopen(url, timeout=self.timeout) as answer:
                    text = answer.read().decode()
                families = list(text_string_to_metric_families(text))
            except (OSError, ValueError) as error:
                self.errors.append(f"{url}: {error}")
                continue
            for family in families:
                for sample in family.samples:
                    pod = (sample.labels.get(names.namespace_label, ""), sample.labels.get(names.pod_label, ""))
                    if not pod[1]:
                        continue
                    if sample.name == names.utilization:
                        utilization[pod] = max(utilization.get(pod, 0.0), sample.value * names.to_percent)
                    elif sample.name == names.last_kernel:
                        last_kernel[pod] = min(last_kernel.get(pod, sample.value), sample.value)
        self.by_pod = {pod: (utilization.get(pod, 0.0), last_kernel.get(pod))
                       for pod in set(utilization) | set(last_kernel)}

    def reading(self, namespace: str, pod: str, interval_s: float) -> GPUReading:
        """The pod's utilisation (its busiest device); with HAMi, a kernel run since the last pass (`interval_s`
        ago) counts as busy too."""
        found = self.by_pod.get((namespace, pod))
        if found is None:
            problem = f" ({'; '.join(self.errors)})" if self.errors else ""
            return GPUReading(None, f"no {SOURCE_NAMES[self.source]} metrics for pod {namespace}/{pod}{problem}")
        percent, since_kernel = found
        if since_kernel is not None and since_kernel <= interval_s:
            percent = max(percent, 100.0)  # ran a kernel since the last look
        note = f"last kernel {since_kernel:.0f} s ago" if since_kernel is not None else ""
        return GPUReading(percent, note)
