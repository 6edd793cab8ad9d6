"""The real Kubernetes control plane on loopback, with the real Volcano, for the tests of the Kubernetes mode
(issues 15 and 35).

etcd, kube-apiserver (token auth, RBAC, service-account keys made at start, the Priority admission plugin),
kube-controller-manager (garbage collector, namespaces, service accounts), kube-scheduler and KWOK (nodes and
pod lifecycles without a kubelet or containers), all built from the Go module proxy by `make kube-tools`
(kube/build-tools.sh, versions in kube/versions.env) into a cache outside the repository; and Volcano
v1.14.4's `vc-scheduler` and `vc-controller-manager`, built by the same script from Volcano's release source
(`../shared/upstream/`), run out of cluster against the API server (leader election off), with Volcano's
CRDs and its ValidatingAdmissionPolicies (what replaces its webhook: no webhook runs) from that source, and
the scheduler configuration gpupool's chart ships (`helm/gpupool/files/volcano-scheduler.conf`, read as is).
Every process listens on 127.0.0.1 on free ports and keeps its files in one temporary folder; the logs are
kept when a test fails (the folder's path is printed).

The fake GPU nodes are registered as the device plugins register real ones (`fake_nodes`): Volcano's vGPU
plugin's node annotation and `volcano.sh/vgpu-*` capacity, HAMi's annotation and its `nvidia.com/gpu` count,
the NVIDIA plugin's MIG and time-slicing resources; no resource a device plugin does not advertise. What of
Volcano's vGPU device plugin the scheduler needs besides is played by named doubles: its periodic re-report of
that registration (`KubeCluster._report_vgpu_nodes`) and its mark on a bound pod's assignment once the kubelet
admits the pod (`KubeCluster._allocate_vgpu_pods`).

Apache YuniKorn, the second engine (issue 37), built by the same script from its release source: a cluster
started with `engines=("yunikorn",)` runs no Volcano, and `KubeCluster.start_yunikorn` runs YuniKorn's scheduler
out of cluster (NAMESPACE, KUBECONFIG) with a `yunikorn-defaults` of `service.schedulingInterval: 100ms`; its REST
server on a free loopback port (the build's patch, `YUNIKORN_REST_PORT`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import yaml

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "kube" / "build-tools.sh"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok")
VOLCANO_BINARIES = ("vc-scheduler", "vc-controller-manager")
YUNIKORN_BINARY = "yunikorn-scheduler"
#: Where the test cluster's YuniKorn runs and reads its ConfigMaps (`yunikorn-configs`, `yunikorn-defaults`).
YUNIKORN_NAMESPACE = "yunikorn"
#: YuniKorn's service settings in its `yunikorn-defaults` (read once at start): a 100 ms scheduling interval
#: instead of 1 s (POST → Running from ~2.7 s to 0.3 s, issue 37).
YUNIKORN_DEFAULTS = {"service.schedulingInterval": "100ms"}
#: Volcano's scheduler configuration as gpupool's chart ships it: the test cluster's vc-scheduler reads this file.
SCHEDULER_CONF = ROOT / "helm" / "gpupool" / "files" / "volcano-scheduler.conf"
#: In Volcano's unpacked source: its chart's CRDs and the admission policies that replace its webhook.
VOLCANO_CHART = Path("installer") / "helm" / "chart" / "volcano"

#: The annotation KWOK's nodes carry and KWOK selects on: nodes without it are left alone.
FAKE_NODE = {"kwok.x-k8s.io/node": "fake"}
#: The scheduler name Volcano's scheduler and controllers serve (their default), as pods and Jobs name it.
VOLCANO_SCHEDULER = "volcano"


def tools_dir() -> Path:
    """Where `make kube-tools` puts this checkout's pinned set (one folder per set of versions)."""
    done = subprocess.run(["bash", str(BUILD), "--print-dir"], capture_output=True, text=True, check=True)
    return Path(done.stdout.strip())


def volcano_dir() -> Path:
    """Where `make kube-tools` puts Volcano: `bin/` and `src/` (its unpacked release source)."""
    done = subprocess.run(["bash", str(BUILD), "--print-volcano-dir"], capture_output=True, text=True, check=True)
    return Path(done.stdout.strip())


def yunikorn_dir() -> Path:
    """Where `make kube-tools` puts YuniKorn: `bin/` and `src/` (the unpacked k8shim, core and interface)."""
    done = subprocess.run(["bash", str(BUILD), "--print-yunikorn-dir"], capture_output=True, text=True, check=True)
    return Path(done.stdout.strip())


def require(problem: str | None) -> None:
    """A module's engine is missing (`problem`, from `missing_tools` or `missing_yunikorn`): skip, naming it; fail
    instead under GPUPOOL_REQUIRE_KUBE=1 (CI, where `make test` builds them)."""
    if problem is None:
        return
    if os.environ.get("GPUPOOL_REQUIRE_KUBE") == "1":
        pytest.fail(problem)
    pytest.skip(problem)


def missing_yunikorn() -> str | None:
    """Why a cluster with YuniKorn cannot start here, or None: the control plane and YuniKorn's scheduler."""
    problem = missing_tools(volcano=False)
    if problem:
        return problem
    yunikorn = yunikorn_dir()
    if not (yunikorn / "bin" / YUNIKORN_BINARY).is_file() or not (yunikorn / "src" / ".complete").is_file():
        return (f"YuniKorn is not built ({YUNIKORN_BINARY} missing in {yunikorn / 'bin'}): run make kube-tools with "
                "YuniKorn's three release archives in ../shared/upstream (kube/versions.env)")
    return None


def missing_tools(volcano: bool = True) -> str | None:
    """Why the cluster cannot start here, or None: the binaries `make kube-tools` builds (Volcano's unless
    `volcano` is false)."""
    bin_dir = tools_dir() / "bin"
    absent = [name for name in BINARIES if not (bin_dir / name).is_file()]
    if not (tools_dir() / "kwok-stages" / ".complete").is_file():
        absent.append("KWOK's stages")
    if not (tools_dir() / "kwok-crds" / ".complete").is_file():
        absent.append("KWOK's CRDs")
    if (bin_dir / "kwok").is_file() and not (bin_dir / ".kwok-uid-preconditions").is_file():
        absent.append("KWOK built with kube/build-tools.sh's UID patch")
    if absent:
        return f"the Kubernetes control plane is not built ({', '.join(absent)} missing in {bin_dir}): run make kube-tools"
    if not volcano:
        return None
    volcano = volcano_dir()
    absent = [name for name in VOLCANO_BINARIES if not (volcano / "bin" / name).is_file()]
    if absent or not (volcano / "src" / ".complete").is_file():
        return (f"Volcano is not built ({', '.join(absent) or 'its unpacked source'} missing in {volcano}): run "
                "make kube-tools with Volcano's release archive in ../shared/upstream (kube/versions.env)")
    return None


def _free_ports(n: int = 1) -> int:
    """The first of `n` consecutive free ports outside the kernel's ephemeral range (the harness's rule: a port
    from that range could be taken by any outgoing connection before the component binds it). Ports one
    component binds together are picked together, so no two of them can be the same."""
    from harness import free_port_block

    return free_port_block(n)


def _wait(what: str, ready, timeout: float, process: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            if result := ready():
                return result
        if process is not None and process.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            raise RuntimeError(f"{what} exited with {process.returncode}:\n{tail}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready after {timeout} s")
        time.sleep(0.2)


def _scheduler_config() -> dict:
    """kube-scheduler with its default profile only: pods naming `volcano` are Volcano's."""
    return {"apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
            "leaderElection": {"leaderElect": False},
            "profiles": [{"schedulerName": "default-scheduler"}]}


#: A pod with this label is one whose node's kubelet is gone: KWOK does not finish its deletion (it stays
#: Terminating, as on a lost node, until the label goes).
KUBELET_LOST = "gpupool.test/kubelet-lost"


def _kwok_stages(stages: Path) -> list[dict]:
    """KWOK's own stages from its module: nodes become Ready, pods Running, Job pods complete, pods deleted
    (except those labelled `KUBELET_LOST`); and the chaos stage that fails a running container with the exit
    code of the pod's annotation."""
    files = ["node/fast/node-initialize.yaml", "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
             "pod/fast/pod-ready.yaml", "pod/fast/pod-complete.yaml", "pod/fast/pod-delete.yaml",
             "pod/chaos/pod-container-running-failed.yaml"]
    loaded = [yaml.safe_load((stages / name).read_text()) for name in files]
    for stage in loaded:
        if stage["metadata"]["name"] == "pod-delete":
            stage["spec"]["selector"]["matchExpressions"].append(
                {"key": f'.metadata.labels["{KUBELET_LOST}"]', "operator": "DoesNotExist"})
        if stage["metadata"]["name"] == "pod-complete":
            # KWOK completes the pods a `Job` owns at once: Kubernetes' batch/v1 Jobs, not Volcano's Jobs (also
            # of kind Job, batch.volcano.sh), whose training pods run until a test ends them.
            stage["spec"]["selector"]["matchExpressions"].append(
                {"key": ".metadata.ownerReferences.[].apiVersion", "operator": "In", "values": ["batch/v1"]})
    return loaded


#: How many pods one card takes (HAMi's and Volcano's vGPU device plugins' `deviceSplitCount`, default 10).
SPLIT = 10
NODE_BASICS = {"cpu": "64", "memory": "512Gi", "pods": "110", "ephemeral-storage": "1Ti"}
#: When a device plugin last said it was there (its handshake annotation's form: "Reported " and Go's
#: `time.Now().String()`).
_REPORTED = "Reported 2026-01-01 00:00:00.000000000 +0000 UTC m=+0.000000001"
#: How often the double of Volcano's vGPU device plugin (`KubeCluster._report_vgpu_nodes`) re-reports its nodes'
#: registration; the real plugin does it every 30 s.
VGPU_REPORT_PERIOD = 2.0
#: The pod annotation in which Volcano's deviceshare and its vGPU device plugin follow a vGPU assignment.
VGPU_BIND_PHASE = "volcano.sh/bind-phase"


def vgpu_bound(pod: dict) -> bool:
    """Whether the vGPU device plugin (`KubeCluster._allocate_vgpu_pods`) has taken a pod's vGPU assignment."""
    return pod["metadata"].get("annotations", {}).get(VGPU_BIND_PHASE) == "success"


def _reported_now() -> str:
    now = time.time()
    return (time.strftime("Reported %Y-%m-%d %H:%M:%S", time.gmtime(now))
            + f".{int(now * 1e9) % 10**9:09d} +0000 UTC m=+{time.monotonic():.9f}")


def _uuid(node: str, card: int) -> str:
    return f"GPU-{node}-{card:02d}"


def device_registration(backend: str, node: str, cards: int, memory_mib: int, product: str) -> tuple[dict, dict]:
    """The node annotations and allocatable resources with which a GPU backend's device plugin registers a node
    of `cards` cards of `memory_mib` MiB each, in the format the scheduler that reads them decodes:
    - `volcano-vgpu`: Volcano's vGPU device plugin: `volcano.sh/node-vgpu-register`, one
      `uuid,count,devmem,type,health,mode:` per card (decoded by Volcano's `vgpu.decodeNodeDevices`, in
      pkg/scheduler/api/devices/nvidia/vgpu of its source), and `volcano.sh/vgpu-number` (cards × split),
      `volcano.sh/vgpu-memory` (MiB) and `volcano.sh/vgpu-cores` (100 a card), which it checks are there;
    - `hami`: HAMi's device plugin: `hami.io/node-nvidia-register`, a JSON array of its `DeviceInfo` (id, index,
      count, devmem, devcore, type, numa, mode, health; HAMi's pkg/device), and `nvidia.com/gpu` = cards ×
      split; nothing else (no `nvidia.com/gpucores` or `gpumem-percentage`: HAMi's scheduler extender counts
      those from the annotation);
    - `whole`: NVIDIA's device plugin: `nvidia.com/gpu` = cards."""
    kind = f"NVIDIA-{product}"
    if backend == "volcano-vgpu":
        register = "".join(f"{_uuid(node, i)},{SPLIT},{memory_mib},{kind},true,hami-core:" for i in range(cards))
        return ({"volcano.sh/node-vgpu-register": register, "volcano.sh/node-vgpu-handshake": _REPORTED},
                {"volcano.sh/vgpu-number": str(cards * SPLIT), "volcano.sh/vgpu-memory": str(cards * memory_mib),
                 "volcano.sh/vgpu-cores": str(cards * 100)})
    if backend == "hami":
        devices = [{"id": _uuid(node, i), "index": i, "count": SPLIT, "devmem": memory_mib, "devcore": 100,
                    "type": kind, "numa": 0, "mode": "hami-core", "health": True} for i in range(cards)]
        return ({"hami.io/node-nvidia-register": json.dumps(devices), "hami.io/node-handshake": _REPORTED},
                {"nvidia.com/gpu": str(cards * SPLIT)})
    return {}, {"nvidia.com/gpu": str(cards)}


def under_volcano(directory: Path) -> Path:
    """The policy in `directory` rewritten so that its 0.25 × H200 notebook (`h200-quarter`, HAMi's in the
    examples) is a Volcano vGPU share: Volcano's scheduler places HAMi's pods on no node a real HAMi device
    plugin registers (they ask `nvidia.com/gpucores`, which HAMi's scheduler extender counts, not a node
    resource), and Volcano's vGPU device plugin is the share Volcano's own scheduler places."""
    cluster_file, profiles_file = directory / "cluster.yaml", directory / "profiles.yaml"
    cluster = yaml.safe_load(cluster_file.read_text())
    backends = cluster["models"]["H200"]["backends"]
    if "volcano-vgpu" not in backends:
        backends.append("volcano-vgpu")
    cluster_file.write_text(yaml.safe_dump(cluster, sort_keys=False, allow_unicode=True))
    profiles = yaml.safe_load(profiles_file.read_text())
    quarter = profiles["profiles"]["h200-quarter"]
    quarter["gpu"]["backend"] = "volcano-vgpu"
    quarter["display_name"] = "0.25 × H200 (Volcano vGPU)"
    profiles_file.write_text(yaml.safe_dump(profiles, sort_keys=False, allow_unicode=True))
    return directory


def fake_nodes(policy, cards: int = 8, per_model: int = 2) -> list[dict]:
    """Fake GPU nodes for the GPU profiles of `policy`: `per_model` nodes of `cards` cards for each model and
    sharing backend (a node runs one device plugin: HAMi's, Volcano's vGPU one or NVIDIA's), registered as that
    plugin registers a real node (`device_registration`), and for each MIG slice of the single strategy (nodes
    GPU feature discovery labels by slice); labelled as GPU feature discovery labels them and tainted as the
    pods tolerate; plus one CPU node without a taint. NVIDIA's plugin advertises MIG slices
    (`nvidia.com/mig-*`) and time-slicing replicas (`nvidia.com/gpu.shared`) as node resources, so those are.
    Other vendors' (Hygon's DCUs through HAMi) keep their plugin's resources."""
    from gpupool.policies.model import product_label
    from gpupool.policies.resources import profile_gpu

    GPU_PRODUCT = "nvidia.com/gpu.product"
    kinds: dict[tuple[str, str, str], dict] = {}
    for slug, profile in sorted(policy.profiles.items()):
        gpu = profile_gpu(profile, policy)
        if gpu is None:
            continue
        model = policy.models[gpu.model]
        product = gpu.node_selector.get(GPU_PRODUCT) or (product_label(gpu.model, model)
                                                         if model.vendor == "nvidia" else "")
        backend = profile.gpu.backend if model.vendor == "nvidia" else "vendor"
        plugin = backend if backend in ("hami", "volcano-vgpu") else "nvidia"
        kind = kinds.setdefault((gpu.model, product, plugin), {
            "labels": {}, "resources": {}, "annotations": {}, "taints": [], "memory": model.memory_gib * 1024,
            "product": product})
        if product:
            kind["labels"][GPU_PRODUCT] = product
        kind["labels"].update(gpu.node_selector)
        for toleration in gpu.tolerations:
            taint = {"key": toleration["key"], "effect": toleration.get("effect", "NoSchedule"),
                     **({"value": toleration["value"]} if "value" in toleration else {})}
            if taint not in kind["taints"]:
                kind["taints"].append(taint)
        if plugin != "nvidia" or model.vendor != "nvidia":
            if model.vendor != "nvidia":  # another vendor's plugin: its own resources, counted per card
                for name in gpu.limits:
                    per_card = model.memory_gib * 1024 if name.endswith("mem") else (100 if "cores" in name
                                                                                    else SPLIT)
                    kind["resources"][name] = str(cards * per_card)
            continue
        for name in gpu.limits:
            if name.startswith("nvidia.com/mig-"):
                kind["resources"][name] = str(cards * 7)
            elif name == "nvidia.com/gpu.shared":
                kind["resources"][name] = str(cards * model.timeslice.replicas)
            elif name == "nvidia.com/gpu":
                kind["resources"][name] = str(cards)
    nodes = []
    for (model, product, plugin), kind in sorted(kinds.items()):
        mig = product.split("-MIG-", 1)[1].lower().replace(".", "-") if "-MIG-" in product else ""
        base = "-".join(filter(None, ["gpu", model.lower(), mig and f"mig-{mig}",
                                      plugin if plugin in ("hami", "volcano-vgpu") else ""]))
        labels = {"gpupool.io/gpu-model": model, **kind["labels"],
                  **({"nvidia.com/gpu.count": str(cards)} if "nvidia.com/gpu.product" in kind["labels"] else {})}
        for i in range(per_model):
            name = f"{base}-{i}"
            annotations, resources = ({}, {})
            if plugin in ("hami", "volcano-vgpu"):
                annotations, resources = device_registration(plugin, name, cards, kind["memory"],
                                                             kind["product"])
            nodes.append({"name": name, "labels": labels, "taints": kind["taints"], "annotations": annotations,
                          "allocatable": {**NODE_BASICS, **kind["resources"], **resources}})
    nodes.append({"name": "cpu-0", "labels": {}, "annotations": {}, "allocatable": dict(NODE_BASICS),
                  "taints": []})
    return nodes


class KubeCluster:
    """A running control plane: `api()` is an admin's HTTP session, `kubectl()` an admin's kubectl."""

    def __init__(self, base: Path, engines: tuple[str, ...] = ("volcano",), stages: tuple[dict, ...] = ()):
        self.base = base
        self.engines = engines  # Volcano is started with the control plane; YuniKorn by `start_yunikorn`
        self.extra_stages = stages  # KWOK stages beside its own (`_kwok_stages`): a benchmark's pod lifecycles
        self.bin = tools_dir() / "bin"
        self.stages = tools_dir() / "kwok-stages"
        self.processes: dict[str, subprocess.Popen] = {}
        self._stopping = threading.Event()
        self.vgpu_report_period = VGPU_REPORT_PERIOD
        self.token = secrets.token_hex(16)
        self.port = 0  # picked as it starts
        self.url = ""
        self.kubeconfig = base / "kubeconfig"
        self.ca = base / "certs" / "apiserver.crt"  # written by kube-apiserver at start (self-signed, with its CA)

    # --- lifecycle ---------------------------------------------------------------------------------------

    def _run(self, name: str, *args: str) -> subprocess.Popen:
        with (self.base / f"{name}.log").open("wb") as log:
            process = subprocess.Popen([str(self.bin / name.split(":")[0]), *args], stdout=log,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.processes[name] = process
        return process

    def start(self) -> KubeCluster:
        began = time.monotonic()
        etcd_port = _free_ports(3)
        peer_port, metrics_port = etcd_port + 1, etcd_port + 2
        etcd = self._run("etcd", "--data-dir", str(self.base / "etcd"), "--unsafe-no-fsync",
                         "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                         "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                         "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                         "--initial-cluster", f"default=http://127.0.0.1:{peer_port}",
                         "--listen-metrics-urls", f"http://127.0.0.1:{metrics_port}", "--log-level", "warn")
        _wait("etcd", lambda: requests.get(f"http://127.0.0.1:{etcd_port}/health", timeout=2).ok, 30,
              etcd, self.base / "etcd.log")

        # Service-account keys made at start; the admin's token in the system:masters group.
        key = self.base / "sa.key"
        subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True)
        (self.base / "tokens.csv").write_text(f'{self.token},admin,admin,"system:masters"\n')
        self.port = _free_ports()  # etcd's are bound by now: no collision with them
        self.url = f"https://127.0.0.1:{self.port}"
        apiserver = self._run(
            "kube-apiserver", "--etcd-servers", f"http://127.0.0.1:{etcd_port}",
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1", "--secure-port", str(self.port),
            # no Endpoints for the `kubernetes` Service: a loopback address is not a valid endpoint
            "--endpoint-reconciler-type", "none",
            "--cert-dir", str(self.base / "certs"), "--token-auth-file", str(self.base / "tokens.csv"),
            "--authorization-mode", "RBAC", "--service-account-key-file", str(key),
            "--service-account-signing-key-file", str(key),
            "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range", "10.96.0.0/16",
            "--enable-admission-plugins", "NamespaceLifecycle,ServiceAccount,Priority,DefaultTolerationSeconds",
            "--disable-admission-plugins", "StorageObjectInUseProtection,PersistentVolumeClaimResize",
            "--enable-priority-and-fairness=false", "--profiling=false", "--v=1",
            # KWOK's nodes are reached at their InternalIP (loopback); their kubelet's certificate is its own
            "--kubelet-preferred-address-types", "InternalIP")
        _wait("kube-apiserver", lambda: self.api().get(f"{self.url}/readyz", timeout=3).ok, 90,
              apiserver, self.base / "kube-apiserver.log")
        session = self.api()

        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "gpupool-test",
            "clusters": [{"name": "gpupool-test", "cluster": {"server": self.url, "certificate-authority": str(self.ca)}}],
            "users": [{"name": "admin", "user": {"token": self.token}}],
            "contexts": [{"name": "gpupool-test", "context": {"cluster": "gpupool-test", "user": "admin"}}],
        }))
        self._run("kube-controller-manager", "--kubeconfig", str(self.kubeconfig), "--leader-elect=false",
                  # node-lifecycle lifts the not-ready taint the API server puts on new nodes once KWOK reports them Ready
                  "--controllers", "garbagecollector,namespace,serviceaccount,serviceaccount-token,nodelifecycle",
                  "--service-account-private-key-file", str(key), "--use-service-account-credentials=false",
                  "--secure-port", "0", "--v=1")
        scheduler_config = self.base / "scheduler.yaml"
        scheduler_config.write_text(yaml.safe_dump(
            {**_scheduler_config(), "clientConnection": {"kubeconfig": str(self.kubeconfig)}}))
        self._run("kube-scheduler", "--config", str(scheduler_config), "--secure-port", "0", "--v=1")

        stages = self.base / "kwok-stages.yaml"
        stages.write_text(yaml.safe_dump_all([*_kwok_stages(self.stages), *self.extra_stages]))
        # KWOK's `Logs`: which file its kubelet server serves as a pod's container log (`container_log`)
        self.kubectl("apply", "--server-side", "-f", str(tools_dir() / "kwok-crds" / "kwok.x-k8s.io_logs.yaml"))
        _wait("KWOK's Logs CRD", lambda: session.get(f"{self.url}/apis/kwok.x-k8s.io/v1alpha1/logs", timeout=3).ok, 30)
        self.kubelet_port = kubelet_port = _free_ports()
        self._run("kwok", "--kubeconfig", str(self.kubeconfig), "--config", str(stages), "--enable-crds", "Logs",
                  "--manage-all-nodes=false", "--manage-nodes-with-annotation-selector",
                  ",".join(f"{k}={v}" for k, v in FAKE_NODE.items()),
                  # pods get loopback addresses: a server the tests run for a pod (PodProcesses) is reachable there
                  "--node-ip", "127.0.0.1", "--cidr", "127.244.0.1/16",
                  "--node-lease-duration-seconds", "40",
                  # its kubelet server (HTTPS), which the nodes advertise: the API server reads pods' logs there
                  "--server-address", f"127.0.0.1:{kubelet_port}", "--node-port", str(kubelet_port))

        if "volcano" in self.engines:
            self._start_volcano(session)
        _wait("the default service account", lambda: session.get(
            f"{self.url}/api/v1/namespaces/default/serviceaccounts/default", timeout=3).ok, 60,
            self.processes["kube-controller-manager"], self.base / "kube-controller-manager.log")
        self.started_in = time.monotonic() - began
        return self

    def _start_volcano(self, session: requests.Session) -> None:
        """Volcano's CRDs and ValidatingAdmissionPolicies from its release source (its chart installs the same
        files; its MutatingAdmissionPolicies are off in its chart by default, and no webhook runs), then
        vc-controller-manager and vc-scheduler out of cluster with this cluster's kubeconfig, leader election
        off, health checks on loopback ports, and the chart's scheduler configuration."""
        chart = volcano_dir() / "src" / VOLCANO_CHART
        # the chart's CRDs and its jobflow subchart's (vc-controller-manager waits for every informer it starts)
        for crds in (chart / "crd" / "bases", chart / "charts" / "jobflow" / "crd" / "bases"):
            self.kubectl("apply", "--server-side", "-f", str(crds))
        _wait("Volcano's CRDs", lambda: all(
            session.get(f"{self.url}/apis/{group}/{version}/{plural}", timeout=3).ok
            for group, version, plural in (("scheduling.volcano.sh", "v1beta1", "queues"),
                                           ("scheduling.volcano.sh", "v1beta1", "podgroups"),
                                           ("batch.volcano.sh", "v1alpha1", "jobs"))), 30)
        for policy in sorted((chart / "policy").glob("*-validating.yaml")):
            self.kubectl("apply", "--server-side", "-f", str(policy))
        # vc-scheduler watches the FOLDER of --scheduler-conf and reloads on every write there: a folder of its own
        conf_dir = self.base / "volcano-scheduler"
        conf_dir.mkdir()
        shutil.copy(SCHEDULER_CONF, conf_dir / SCHEDULER_CONF.name)
        volcano_bin = volcano_dir() / "bin"
        controllers_health = _free_ports(2)
        controllers = self._run_from(
            volcano_bin, "vc-controller-manager", "--kubeconfig", str(self.kubeconfig), "--leader-elect=false",
            "--enable-healthz", "--healthz-address", f"127.0.0.1:{controllers_health}",
            "--listen-address", f"127.0.0.1:{controllers_health + 1}", "--v=2")
        scheduler_health = _free_ports(2)
        scheduler = self._run_in_cluster_from(
            volcano_bin, "vc-scheduler", "--kubeconfig", str(self.kubeconfig), "--leader-elect=false",
            "--scheduler-conf", str(conf_dir / SCHEDULER_CONF.name),
            "--enable-healthz", "--healthz-address", f"127.0.0.1:{scheduler_health}",
            "--listen-address", f"127.0.0.1:{scheduler_health + 1}", "--cache-dump-dir", str(self.base),
            "--v=3")
        for name, port, process in (("vc-controller-manager", controllers_health, controllers),
                                    ("vc-scheduler", scheduler_health, scheduler)):
            _wait(name, lambda port=port: requests.get(f"http://127.0.0.1:{port}/healthz", timeout=3).ok, 60,
                  process, self.base / f"{name}.log")
        # vc-scheduler makes the `root` and `default` queues once its caches are synced
        _wait("vc-scheduler's root and default queues", lambda: all(
            session.get(f"{self.url}/apis/scheduling.volcano.sh/v1beta1/queues/{queue}", timeout=3).ok
            for queue in ("root", "default")), 60, scheduler, self.base / "vc-scheduler.log")
        self._logs_watch = threading.Thread(target=self._forget_logs_of_deleted_pods, daemon=True,
                                            name="kwok-logs-of-deleted-pods")
        self._logs_watch.start()
        self._vgpu_reports = threading.Thread(target=self._report_vgpu_nodes, daemon=True,
                                              name="volcano-vgpu-device-plugin-reports")
        self._vgpu_reports.start()
        self._vgpu_allocations = threading.Thread(target=self._allocate_vgpu_pods, daemon=True,
                                                  name="volcano-vgpu-device-plugin-allocations")
        self._vgpu_allocations.start()

    def start_yunikorn(self) -> subprocess.Popen:
        """YuniKorn's scheduler, out of cluster: its namespace with a `yunikorn-defaults` of `YUNIKORN_DEFAULTS`
        (apply a `yunikorn-configs` before, or it starts on its own default queues; it reads both live), then the
        binary with NAMESPACE and KUBECONFIG, its REST server on a free loopback port (`self.yunikorn_url`),
        ready when that answers its health check and the fake nodes are its nodes."""
        session = self.api()
        if not session.get(f"{self.url}/api/v1/namespaces/{YUNIKORN_NAMESPACE}", timeout=10).ok:
            self.kubectl("create", "namespace", YUNIKORN_NAMESPACE)
        self.kubectl("apply", "--server-side", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "yunikorn-defaults", "namespace": YUNIKORN_NAMESPACE}, "data": YUNIKORN_DEFAULTS}))
        port = _free_ports()
        self.yunikorn_url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "NAMESPACE": YUNIKORN_NAMESPACE, "KUBECONFIG": str(self.kubeconfig),
               "YUNIKORN_REST_PORT": str(port)}
        log = self.base / f"{YUNIKORN_BINARY}.log"
        with log.open("wb") as out:
            process = subprocess.Popen([str(yunikorn_dir() / "bin" / YUNIKORN_BINARY)], stdout=out,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                       env=env)
        self.processes[YUNIKORN_BINARY] = process
        nodes = {n["metadata"]["name"] for n in self.get("/api/v1/nodes")["items"]}

        def ready():
            health = requests.get(f"{self.yunikorn_url}/ws/v1/scheduler/healthcheck", timeout=3)
            known = requests.get(f"{self.yunikorn_url}/ws/v1/partition/default/nodes", timeout=3)
            return health.ok and known.ok and {n["nodeID"] for n in known.json()} >= nodes

        _wait("YuniKorn's scheduler and its nodes", ready, 90, process, log)
        return process

    def _allocate_vgpu_pods(self) -> None:
        """The other part of Volcano's vGPU device plugin that Volcano's scheduler depends on: when the kubelet
        admits a pod that Volcano's deviceshare bound with a vGPU assignment (`volcano.sh/bind-phase:
        allocating`), the plugin hands the card to the container and marks the assignment done
        (`volcano.sh/bind-phase: success`). Volcano strips the assignment of a pod not so marked whenever its
        session gives the pod's place up (`vgpu.GPUDevices.Release`, a PATCH of the pod); on a preemption victim
        that PATCH races the evictor's status update of the same pod, which then fails on a conflict and the
        victim is never evicted. Done here as soon as the pod is bound (`vgpu_bound`)."""
        session = self.api()
        while not self._stopping.wait(0.2):
            try:
                pods = session.get(f"{self.url}/api/v1/pods", params={"fieldSelector": "spec.nodeName!="},
                                   timeout=10).json().get("items", [])
                for pod in pods:
                    meta = pod["metadata"]
                    if (meta.get("annotations") or {}).get(VGPU_BIND_PHASE) == "allocating":
                        session.patch(f"{self.url}/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                                      json={"metadata": {"annotations": {VGPU_BIND_PHASE: "success"}}},
                                      headers={"Content-Type": "application/merge-patch+json"}, timeout=10)
            except (requests.RequestException, ValueError):
                continue  # the API server busy or going: the next round

    def _report_vgpu_nodes(self) -> None:
        """The part of Volcano's vGPU device plugin that Volcano's scheduler depends on and no kubelet here runs:
        on every node it registered (`volcano.sh/node-vgpu-register`), it re-reports that registration on a
        period (the real plugin every 30 s: `volcano.sh/node-vgpu-handshake` = "Reported <time>"; here every
        `vgpu_report_period` s, `VGPU_REPORT_PERIOD` unless changed). Volcano's scheduler needs it: v1.14.4
        counts a vGPU pod's share of its card twice (its deviceshare `Allocate` adds it to the device state its
        cache shares with the session, then the cache adds the bound pod's `volcano.sh/vgpu-ids-new` again:
        volcano-sh/volcano#4809), and only a node update makes its cache rebuild the node's cards from the
        registration and count each pod on them once. Without the reports the third 0.25 share of a card waits
        forever."""
        session = self.api()
        while not self._stopping.wait(self.vgpu_report_period):
            try:
                nodes = session.get(f"{self.url}/api/v1/nodes", timeout=10).json().get("items", [])
                for node in nodes:
                    if "volcano.sh/node-vgpu-register" in (node["metadata"].get("annotations") or {}):
                        session.patch(f"{self.url}/api/v1/nodes/{node['metadata']['name']}", json={
                            "metadata": {"annotations": {"volcano.sh/node-vgpu-handshake": _reported_now()}}},
                            headers={"Content-Type": "application/merge-patch+json"}, timeout=10)
            except (requests.RequestException, ValueError):
                continue  # the API server busy or going: the next period

    def _run_in_cluster_from(self, folder: Path, name: str, *args: str) -> subprocess.Popen:
        """`_run_from`, with what a pod of the cluster finds: Volcano's device plugins (deviceshare: the vGPU
        assignment it writes on a pod) make their own client from the in-cluster configuration only
        (`rest.InClusterConfig`: KUBERNETES_SERVICE_HOST/PORT and the service account's token and CA at
        /var/run/secrets/kubernetes.io/serviceaccount). The process gets them in a mount namespace of its own
        (a tmpfs over /run there; nothing on this machine's /run changes): the admin's token and the API
        server's certificate."""
        account = self.base / "serviceaccount"
        account.mkdir(exist_ok=True)
        (account / "token").write_text(self.token)
        shutil.copy(self.ca, account / "ca.crt")
        (account / "namespace").write_text("volcano-system")
        inside = "/run/secrets/kubernetes.io/serviceaccount"
        script = (f'mount -t tmpfs tmpfs /run && mkdir -p {inside} && cp "$0"/token "$0"/ca.crt "$0"/namespace '
                  f'{inside}/ && exec "$@"')
        unshare = ["unshare", "--mount", "--propagation", "private",
                   *(["--map-root-user"] if os.getuid() != 0 else [])]
        env = {**os.environ, "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(self.port)}
        with (self.base / f"{name}.log").open("wb") as log:
            process = subprocess.Popen([*unshare, "sh", "-c", script, str(account), str(folder / name), *args],
                                       stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True, env=env)
        self.processes[name] = process
        return process

    def _run_from(self, folder: Path, name: str, *args: str) -> subprocess.Popen:
        with (self.base / f"{name}.log").open("wb") as log:
            process = subprocess.Popen([str(folder / name), *args], stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        self.processes[name] = process
        return process

    def _forget_logs_of_deleted_pods(self) -> None:
        """KWOK keys container logs by pod name (its `Logs` object), a kubelet by pod uid; Volcano's job
        controller names a Job's pods the same on every restart. When a pod whose log `container_log` set up is
        deleted, its `Logs` goes at once (its file names the pod's uid), before the next pod of that name can
        run: the new pod's log is not the last one's."""
        session = self.api()
        version = ""
        while not self._stopping.is_set():
            try:
                with session.get(f"{self.url}/api/v1/pods", params={
                        "watch": "1", "resourceVersion": version, "allowWatchBookmarks": "true",
                        "timeoutSeconds": "30"}, stream=True, timeout=(5, 60)) as reply:
                    if reply.status_code == 410:
                        version = ""
                        continue
                    for line in reply.iter_lines():
                        event = json.loads(line)
                        if event["type"] == "ERROR":
                            version = ""
                            break
                        meta = event["object"]["metadata"]
                        version = meta.get("resourceVersion", version)
                        if event["type"] == "DELETED":
                            self._forget_log(session, meta)
            except (requests.RequestException, ValueError):
                if self._stopping.wait(0.5):
                    return

    def _forget_log(self, session: requests.Session, meta: dict) -> None:
        url = f"{self.url}/apis/kwok.x-k8s.io/v1alpha1/namespaces/{meta['namespace']}/logs/{meta['name']}"
        logs = session.get(url, timeout=10)
        if not logs.ok:
            return
        files = [entry.get("logsFile", "") for entry in logs.json()["spec"].get("logs", [])]
        if any(f"_{meta['uid']}_" in name for name in files):
            session.delete(url, json={"preconditions": {"uid": logs.json()["metadata"]["uid"]}}, timeout=10)

    def stop(self) -> None:
        self._stopping.set()
        for process in reversed(list(self.processes.values())):
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def logs(self) -> str:
        """The last lines of every component's log, for a failure's report."""
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}"
                         for log in sorted(self.base.glob("*.log")))

    # --- use ---------------------------------------------------------------------------------------------

    def api(self) -> requests.Session:
        """An HTTP session of the cluster's administrator (token auth; TLS checked against the API server's own
        certificate, which it made at start in its `--cert-dir`)."""
        session = requests.Session()
        session.headers["Authorization"] = f"Bearer {self.token}"
        session.verify = str(self.ca)
        session.trust_env = False  # else REQUESTS_CA_BUNDLE from the environment replaces `verify`
        return session

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([str(self.bin / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args],
                              input=input, capture_output=True, text=True, timeout=120)
        if check and done.returncode:
            raise AssertionError(f"kubectl {' '.join(args)} exited {done.returncode}:\n{done.stderr}{done.stdout}")
        return done

    def get(self, path: str) -> dict:
        reply = self.api().get(f"{self.url}{path}", timeout=10)
        reply.raise_for_status()
        return reply.json()

    def container_log(self, pod: dict, container: str, lines: list[str], rotate: bool = False) -> Path:
        """Write what a pod's container printed, as a container runtime writes it (the CRI log format the kubelet
        serves; one file per pod, by uid: a pod of the same name made again starts a new log), and tell KWOK's
        kubelet server to serve that file as the container's log (its `Logs` object, named as the pod):
        `GET …/pods/NAME/log` through the API server then reads it, `follow` included. Called again, it appends;
        with `rotate`, the file is first moved aside and a new one begun, as the kubelet rotates a log."""
        meta = pod["metadata"]
        path = self.base / "container-logs" / meta["namespace"] / f"{meta['name']}_{meta['uid']}_{container}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists()
        if rotate:
            path.rename(path.with_suffix(".log.1"))
        with open(path, "a") as log:
            for line in lines:
                stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{time.time_ns() % 10**9:09d}Z"
                log.write(f"{stamp} stdout F {line}\n")
        if new:
            self.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps({
                "apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "Logs",
                "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
                "spec": {"logs": [{"containers": [container], "logsFile": str(path), "follow": True}]}}))
        return path

    def add_node(self, name: str, labels: dict[str, str], allocatable: dict[str, str],
                 taints: list[dict] | None = None, annotations: dict[str, str] | None = None) -> dict:
        """A fake node that KWOK manages (Ready, with the given labels, extended resources, taints and
        annotations: a device plugin's registration, `device_registration`)."""
        node = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "annotations": {**(annotations or {}), **FAKE_NODE},
                             "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                        "type": "kwok", **labels}},
                "spec": {"taints": taints or []},
                "status": {"allocatable": allocatable, "capacity": allocatable}}
        self.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(node))
        def ready():
            now = self.get(f"/api/v1/nodes/{name}")
            conditions = {c["type"]: c["status"] for c in now["status"].get("conditions", [])}
            # Ready by KWOK's node stage, and the not-ready taint lifted by the node lifecycle controller
            not_ready = [t for t in now["spec"].get("taints") or [] if t["key"].startswith("node.kubernetes.io/")]
            return now if conditions.get("Ready") == "True" and not not_ready else None
        return _wait(f"node {name} Ready and schedulable", ready, 60)


class Rounds:
    """A thread that runs `_round(session)` every 0.2 s with an admin session of `cluster` while the block runs;
    a failed round is said and the next one tries again."""

    def __init__(self, cluster: KubeCluster):
        self.cluster = cluster
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=type(self).__name__)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()  # its rounds are bounded (10 s requests): then nothing else touches its state

    def _run(self) -> None:
        session = self.cluster.api()
        while not self._stop.wait(0.2):
            try:
                self._round(session)
            except Exception as error:  # noqa: BLE001 - said, and the next round tries again
                print(f"{type(self).__name__}: {type(error).__name__}: {error}", flush=True)

    def _round(self, session: requests.Session) -> None:
        raise NotImplementedError


class PodProcesses(Rounds):
    """The container runtime's part, which KWOK leaves out: while a pod of `namespace` runs (KWOK made it
    Running on a loopback pod address), its first container's command runs as a local process with the pod's
    environment, listening on the pod's address; it is killed when the pod goes. A stand-in, named as one:
    no image is pulled, the command must exist on this machine (a notebook server's `jupyterhub-singleuser`)."""

    def __init__(self, cluster: KubeCluster, namespace: str, workdir: Path):
        super().__init__(cluster)
        self.namespace, self.workdir = namespace, workdir
        self.processes: dict[str, tuple[str, subprocess.Popen]] = {}  # pod uid → (name, process)

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)  # its rounds end their processes within 10 s each
        for _, process in self.processes.values():
            _end(process)

    def _round(self, session: requests.Session) -> None:
        try:
            pods = session.get(f"{self.cluster.url}/api/v1/namespaces/{self.namespace}/pods", timeout=10).json()
        except (requests.RequestException, ValueError):
            return  # the API server busy or going: the next round
        running = {}
        for pod in pods.get("items", []):
            uid, status = pod["metadata"]["uid"], pod.get("status") or {}
            if status.get("phase") == "Running" and status.get("podIP") and not pod["metadata"].get(
                    "deletionTimestamp"):
                running[uid] = pod
        for uid, (_, process) in list(self.processes.items()):
            if uid not in running:
                _end(process)
                del self.processes[uid]
        for uid, pod in running.items():
            if uid not in self.processes:
                self.processes[uid] = (pod["metadata"]["name"], self._start(pod))

    def _start(self, pod: dict) -> subprocess.Popen:
        container = pod["spec"]["containers"][0]
        env = {"PATH": os.environ["PATH"], "HOME": str(self.workdir)}
        env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
        address = pod["status"]["podIP"]
        # What the pod's network gives a container: its own address (JupyterHub tells the server where to listen
        # through JUPYTERHUB_SERVICE_URL; KubeSpawner's is 0.0.0.0, every pod's own in a cluster).
        if "JUPYTERHUB_SERVICE_URL" in env:
            env["JUPYTERHUB_SERVICE_URL"] = env["JUPYTERHUB_SERVICE_URL"].replace("0.0.0.0", address)
        command = [*(container.get("command") or []), *(container.get("args") or [])]
        if os.getuid() == 0:
            command.append("--allow-root")
        with (self.workdir / f"{pod['metadata']['name']}.log").open("ab") as log:
            return subprocess.Popen(command, env=env, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)


def _end(process: subprocess.Popen) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 15)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()


@contextlib.contextmanager
def running_cluster(base: Path | None = None, keep=lambda: False, engines: tuple[str, ...] = ("volcano",),
                    stages: tuple[dict, ...] = ()) -> Iterator[KubeCluster]:
    """Start a cluster in `base` (a new temporary folder by default), stop it at the end. The folder, with every
    component's log, is kept and named when the block raised or `keep()` says so at the end (a test failed).
    `engines`: Volcano's is started with it; YuniKorn's is started by `KubeCluster.start_yunikorn`. `stages`:
    KWOK stages added to its own."""
    folder = base or Path(tempfile.mkdtemp(prefix="gpupool-kube-"))
    cluster = KubeCluster(folder, engines, stages)
    failed = True
    try:
        cluster.start()
        yield cluster
        failed = keep()
    except BaseException:
        print(f"\nKubernetes control plane logs kept in {folder}\n{cluster.logs()}")
        raise
    finally:
        cluster.stop()
        if failed:
            print(f"\nKubernetes control plane logs kept in {folder}")
        elif base is None:
            shutil.rmtree(folder, ignore_errors=True)
