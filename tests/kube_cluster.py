"""The real Kubernetes control plane on loopback, for the tests of the Kubernetes mode (issue 15).

etcd, kube-apiserver (token auth, RBAC, service-account keys made at start, the Priority admission plugin),
kube-controller-manager (garbage collector, namespaces, service accounts), kube-scheduler and KWOK (nodes and
pod lifecycles without a kubelet or containers), all built from the Go module proxy by `make kube-tools`
(kube/build-tools.sh, versions in kube/versions.env) into a cache outside the repository. Every process
listens on 127.0.0.1 on free ports and keeps its files in one temporary folder; the logs are kept when a test
fails (the folder's path is printed).

What is not real, and says so: Volcano. Its scheduler and controllers are not served by the Go module proxy
these machines reach, so its CRDs (Queue, PodGroup, Job) come from `../shared/schemas/volcano/` (exactly as
Volcano's chart installs them) and the API server validates and stores Volcano objects for real, but nothing
schedules a Volcano Job or makes a bare pod's PodGroup. Pods that name `schedulerName: volcano` are bound by a
second profile of the real kube-scheduler named `volcano` (`VOLCANO_STANDIN`): a stand-in for Volcano's
scheduler, named as one in every test that relies on it.
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

import requests
import yaml

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
VOLCANO_CRDS = SHARED / "schemas" / "volcano"
BUILD = ROOT / "kube" / "build-tools.sh"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok")

#: The annotation KWOK's nodes carry and KWOK selects on: nodes without it are left alone.
FAKE_NODE = {"kwok.x-k8s.io/node": "fake"}
#: The scheduler profile that stands in for Volcano's scheduler (see the module's docstring).
VOLCANO_STANDIN = "volcano"

def tools_dir() -> Path:
    """Where `make kube-tools` puts this checkout's pinned set (one folder per set of versions)."""
    done = subprocess.run(["bash", str(BUILD), "--print-dir"], capture_output=True, text=True, check=True)
    return Path(done.stdout.strip())


def missing_tools() -> str | None:
    """Why the cluster cannot start here, or None: the binaries `make kube-tools` builds."""
    bin_dir = tools_dir() / "bin"
    absent = [name for name in BINARIES if not (bin_dir / name).is_file()]
    if not (tools_dir() / "kwok-stages" / ".complete").is_file():
        absent.append("KWOK's stages")
    if not (tools_dir() / "kwok-crds" / ".complete").is_file():
        absent.append("KWOK's CRDs")
    if absent:
        return f"the Kubernetes control plane is not built ({', '.join(absent)} missing in {bin_dir}): run make kube-tools"
    if not VOLCANO_CRDS.is_dir():
        return f"Volcano's CRDs are not in {VOLCANO_CRDS}"
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
    """kube-scheduler with its default profile and the `volcano` stand-in profile (same plugins)."""
    return {"apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
            "leaderElection": {"leaderElect": False},
            "profiles": [{"schedulerName": "default-scheduler"}, {"schedulerName": VOLCANO_STANDIN}]}


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
    return loaded


#: What one card of a model offers of each resource a profile may ask for (the device plugins' units): HAMi
#: splits a card ten ways and counts memory and cores in percent, MIG offers up to seven slices, Volcano's vGPU
#: counts memory in MiB. Generous on purpose: the fake nodes must hold what the policies ask, no more is tested.
PER_CARD = {"nvidia.com/gpu": 10, "nvidia.com/gpumem-percentage": 100, "nvidia.com/gpucores": 100,
            "volcano.sh/vgpu-number": 10, "volcano.sh/vgpu-cores": 100, "hygon.com/dcunum": 10,
            "hygon.com/dcucores": 100}
NODE_BASICS = {"cpu": "64", "memory": "512Gi", "pods": "110", "ephemeral-storage": "1Ti"}


def fake_nodes(policy, cards: int = 8, per_model: int = 2) -> list[dict]:
    """Fake GPU nodes for the GPU profiles of `policy`: `per_model` nodes of `cards` cards for each model (and
    for each MIG slice of the single strategy, whose nodes GPU feature discovery labels by slice), offering
    every extended resource the model's profiles ask for (HAMi's, MIG's, time-slicing's, Volcano vGPU's,
    other vendors'), labelled as GPU feature discovery labels them and tainted as the pods tolerate; plus one
    CPU node without a taint."""
    from gpupool.policies.model import product_label
    from gpupool.policies.resources import profile_gpu

    GPU_PRODUCT = "nvidia.com/gpu.product"
    kinds: dict[tuple[str, str], dict] = {}
    for profile in policy.profiles.values():
        gpu = profile_gpu(profile, policy)
        if gpu is None:
            continue
        model = policy.models[gpu.model]
        product = gpu.node_selector.get(GPU_PRODUCT) or (product_label(gpu.model, model)
                                                         if model.vendor == "nvidia" else "")
        kind = kinds.setdefault((gpu.model, product), {"labels": {}, "resources": {}, "taints": []})
        if product:
            kind["labels"][GPU_PRODUCT] = product
        kind["labels"].update(gpu.node_selector)
        for toleration in gpu.tolerations:
            taint = {"key": toleration["key"], "effect": toleration.get("effect", "NoSchedule"),
                     **({"value": toleration["value"]} if "value" in toleration else {})}
            if taint not in kind["taints"]:
                kind["taints"].append(taint)
        for name in gpu.limits:
            if name.startswith("nvidia.com/mig-"):
                per_card = 7
            elif name == "nvidia.com/gpu.shared":
                per_card = model.timeslice.replicas
            elif name.endswith("-memory") or name.endswith("dcumem"):
                per_card = model.memory_gib * 1024
            else:
                per_card = PER_CARD.get(name, 10)
            kind["resources"][name] = str(cards * per_card)
    nodes = []
    for (model, product), kind in sorted(kinds.items()):
        mig = product.split("-MIG-", 1)[1].lower().replace(".", "-") if "-MIG-" in product else ""
        base = "-".join(filter(None, ["gpu", model.lower(), mig and f"mig-{mig}"]))
        labels = {"gpupool.io/gpu-model": model, **kind["labels"],
                  **({"nvidia.com/gpu.count": str(cards)} if "nvidia.com/gpu.product" in kind["labels"] else {})}
        for i in range(per_model):
            nodes.append({"name": f"{base}-{i}", "labels": labels, "taints": kind["taints"],
                          "allocatable": {**NODE_BASICS, **kind["resources"]}})
    nodes.append({"name": "cpu-0", "labels": {}, "allocatable": dict(NODE_BASICS), "taints": []})
    return nodes


class KubeCluster:
    """A running control plane: `api()` is an admin's HTTP session, `kubectl()` an admin's kubectl."""

    def __init__(self, base: Path):
        self.base = base
        self.bin = tools_dir() / "bin"
        self.stages = tools_dir() / "kwok-stages"
        self.processes: dict[str, subprocess.Popen] = {}
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
        stages.write_text(yaml.safe_dump_all(_kwok_stages(self.stages)))
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

        self.kubectl("apply", "--server-side", "-f", str(VOLCANO_CRDS))
        _wait("Volcano's CRDs", lambda: all(
            session.get(f"{self.url}/apis/{group}/{version}/{plural}", timeout=3).ok
            for group, version, plural in (("scheduling.volcano.sh", "v1beta1", "queues"),
                                           ("scheduling.volcano.sh", "v1beta1", "podgroups"),
                                           ("batch.volcano.sh", "v1alpha1", "jobs"))), 30)
        _wait("the default service account", lambda: session.get(
            f"{self.url}/api/v1/namespaces/default/serviceaccounts/default", timeout=3).ok, 60,
            self.processes["kube-controller-manager"], self.base / "kube-controller-manager.log")
        self.started_in = time.monotonic() - began
        return self

    def stop(self) -> None:
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

    def forget_container_log(self, namespace: str, pod: str, container: str) -> None:
        """Before a new pod of a used name runs (Volcano names a Job's pods the same on every restart): the last
        one's `Logs` goes, and KWOK's kubelet server no longer serves its file under that name (KWOK keys logs by
        pod name, a kubelet by pod uid)."""
        gone = self.kubectl("delete", "logs.kwok.x-k8s.io", pod, "-n", namespace, "--ignore-not-found", "--wait")
        if not gone.stdout.strip():
            return
        url = f"http://127.0.0.1:{self.kubelet_port}/containerLogs/{namespace}/{pod}/{container}"
        _wait(f"KWOK to forget the log of {pod}", lambda: requests.get(url, timeout=5).status_code != 200,
              30)

    def add_node(self, name: str, labels: dict[str, str], allocatable: dict[str, str],
                 taints: list[dict] | None = None) -> dict:
        """A fake node that KWOK manages (Ready, with the given labels, extended resources and taints)."""
        node = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "annotations": dict(FAKE_NODE),
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


class VolcanoJobControllerDouble(Rounds):
    """A double of Volcano's job controller (`vc-controller-manager`, not built here: see the module's
    docstring), named as one, for one-task Volcano Jobs of `namespace`: what gpupool reads of it and nothing
    more. Each round it gives a new Job the `Pending` phase, makes the task's pod from the template
    (`<job>-<task>-0`, with Volcano's `volcano.sh/job-name` label and `volcano.sh/job-retry-count` annotation;
    the real kube-scheduler's `volcano` profile binds it and KWOK runs it), sets `Running` when the pod runs,
    and when the pod ends applies the Job's `policies` as Volcano does (an `exitCode` entry first, then the
    `PodEvicted` event (the pod deleted while it ran, or evicted by its kubelet) or `PodFailed`; `RestartJob`
    deletes the pod and counts `status.retryCount` up to `maxRetry`, past it the Job `Failed`; `TerminateJob` →
    `Terminated`; `TaskCompleted`/`CompleteJob` → `Completed`). Its pods have no ownerReferences (KWOK's pod-complete stage would complete any pod a `Job`
    owns at once), so it deletes the pods of a Job that is gone, as the garbage collector would."""

    API = "/apis/batch.volcano.sh/v1alpha1"

    def __init__(self, cluster: KubeCluster, namespace: str):
        super().__init__(cluster)
        self.namespace = namespace
        self.made: dict[str, int] = {}  # Job uid → the retry whose pod was made

    def _url(self, path: str, core: bool = False) -> str:
        return f"{self.cluster.url}{'/api/v1' if core else self.API}/namespaces/{self.namespace}/{path}"

    def _status(self, session, job: dict, phase: str, retries: int, **extra) -> None:
        status = {**(job.get("status") or {}), "state": {"phase": phase}, "retryCount": retries, **extra}
        reply = session.patch(self._url(f"jobs/{job['metadata']['name']}/status"), json={"status": status},
                              headers={"Content-Type": "application/merge-patch+json"}, timeout=10)
        reply.raise_for_status()

    def _round(self, session) -> None:
        jobs = session.get(self._url("jobs"), timeout=10).json().get("items", [])
        pods = session.get(self._url("pods", core=True), params={"labelSelector": "volcano.sh/job-name"},
                           timeout=10).json().get("items", [])
        by_job: dict[str, dict] = {p["metadata"]["labels"]["volcano.sh/job-name"]: p for p in pods}
        names = {j["metadata"]["name"] for j in jobs}
        for name, pod in by_job.items():
            if name not in names and not pod["metadata"].get("deletionTimestamp"):
                session.delete(self._url(f"pods/{pod['metadata']['name']}", core=True), timeout=10)
        for job in jobs:
            if job["metadata"].get("deletionTimestamp"):
                continue
            status = job.get("status") or {}
            phase = (status.get("state") or {}).get("phase")
            retries = status.get("retryCount", 0)
            if phase in ("Completed", "Failed", "Terminated", "Aborted"):
                continue
            if phase is None:
                self._status(session, job, "Pending", 0)
                continue
            pod = by_job.get(job["metadata"]["name"])
            if pod is None and self.made.get(job["metadata"]["uid"]) == retries:
                # the pod of this retry was made and is gone: evicted (Volcano's preemption deletes it, a drain)
                self._apply(session, job, None, "PodEvicted", None, retries)
                continue
            if pod is None:
                self._make_pod(session, job, retries)
                continue
            if pod["metadata"].get("deletionTimestamp"):
                continue
            pod_phase = (pod.get("status") or {}).get("phase")
            if pod_phase == "Running" and phase != "Running":
                self._status(session, job, "Running", retries)
            elif pod_phase == "Succeeded":
                self._status(session, job, "Completed", retries)
            elif pod_phase == "Failed":
                self._failed(session, job, pod, retries)

    def _failed(self, session, job: dict, pod: dict, retries: int) -> None:
        status = pod.get("status") or {}
        code = next((c["state"]["terminated"].get("exitCode") for c in status.get("containerStatuses") or []
                     if "terminated" in (c.get("state") or {})), None)
        event = "PodEvicted" if status.get("reason") == "Evicted" else "PodFailed"
        self._apply(session, job, pod, event, code, retries)

    def _apply(self, session, job: dict, pod: dict | None, event: str, code: int | None, retries: int) -> None:
        policies = job["spec"].get("policies") or []
        action = next((p["action"] for p in policies if p.get("exitCode") is not None and p["exitCode"] == code),
                      None) or next((p["action"] for p in policies if p.get("event") == event), None)
        if action == "RestartJob":
            if retries + 1 > job["spec"].get("maxRetry", 3):
                self._status(session, job, "Failed", retries)
                return
            if pod is not None:
                session.delete(self._url(f"pods/{pod['metadata']['name']}", core=True),
                               params={"gracePeriodSeconds": 0}, timeout=10)
            self._status(session, job, "Restarting", retries + 1)
        elif action == "TerminateJob":
            self._status(session, job, "Terminated", retries, failed=1)
        else:
            self._status(session, job, "Failed", retries, failed=1)

    def _make_pod(self, session, job: dict, retries: int) -> None:
        task = job["spec"]["tasks"][0]
        template = task["template"]
        name = job["metadata"]["name"]
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"{name}-{task['name']}-0", "namespace": self.namespace,
                            "labels": {**(template.get("metadata") or {}).get("labels", {}),
                                       "volcano.sh/job-name": name},
                            "annotations": {**((template.get("metadata") or {}).get("annotations") or {}),
                                            "volcano.sh/job-retry-count": str(retries),
                                            "scheduling.k8s.io/group-name": name}},
               "spec": template["spec"]}
        self.cluster.forget_container_log(self.namespace, pod["metadata"]["name"], task["name"])
        reply = session.post(self._url("pods", core=True), json=pod, timeout=10)
        if reply.status_code not in (201, 409):  # 409: the last pod is still being deleted; the next round
            raise RuntimeError(f"pod of {name}: {reply.status_code} {reply.text[:300]}")
        if reply.status_code == 201:
            self.made[job["metadata"]["uid"]] = retries
            self.cluster.container_log(reply.json(), task["name"], [])  # its container's log starts empty
        if phase := (job.get("status") or {}).get("state", {}).get("phase"):
            if phase == "Restarting":
                self._status(session, job, "Pending", retries)


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
def running_cluster(base: Path | None = None, keep=lambda: False) -> Iterator[KubeCluster]:
    """Start a cluster in `base` (a new temporary folder by default), stop it at the end. The folder, with every
    component's log, is kept and named when the block raised or `keep()` says so at the end (a test failed)."""
    folder = base or Path(tempfile.mkdtemp(prefix="gpupool-kube-"))
    cluster = KubeCluster(folder)
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
