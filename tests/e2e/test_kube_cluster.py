"""The Kubernetes mode against the real control plane (tests/kube_cluster.py): etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, KWOK's fake GPU nodes and the real Volcano (vc-scheduler with the
scheduler configuration gpupool's chart ships, vc-controller-manager), built by `make kube-tools`.

What the API server checks for real here and no schema file did: server-side apply of `gpupool render`'s
output (and that a second apply changes nothing), the chart's manifests in a server-side dry run, every
profile's Volcano Job stored by Volcano's real CRDs without a field pruned, the Priority admission plugin
giving pods the priority of their PriorityClass, and GPUKubeSpawner creating, watching (list + watch from a
resourceVersion, label and field selectors as a real API server serves them), re-adopting and deleting a pod
that the scheduler binds to a fake node of its GPU model and KWOK runs.

Pods that name `schedulerName: volcano` get their PodGroup from Volcano's controller, are admitted in their
team's queue and bound by Volcano's scheduler; training jobs are Volcano Jobs that Volcano's job controller
runs and restarts. The fake nodes are registered as the device plugins register real ones; the 0.25 × H200
notebook of these tests goes through Volcano's vGPU device plugin (`volcano_policy_copy`: HAMi's own
backend needs HAMi's scheduler, which Volcano is not).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime, timedelta
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest
import pytest_asyncio
import requests
import yaml

from gpupool.hub.accounting.jobs import Job, JobStore, JobSubmission, resolve
from gpupool.hub.accounting.ledger import HowEnded, State
from gpupool.policies import periods
from gpupool.policies import DEFAULT_POLICY_DIR, EXAMPLES_DIR, load_policy
from gpupool.spawner.jobs.runner import JobRunner
from gpupool.spawner.jobs.volcano import VolcanoBackend, parse_time
from gpupool.spawner.jobs.volcano_objects import (
    EVICTION_HEADROOM, JOB_ID_LABEL, JobSpec, job_name, running_since, volcano_job,
)
from gpupool.spawner.kube import GPUKubeSpawner
from gpupool.spawner.usage import get_ledger
from gpupool.spawner.volcano import Release
from kubespawner import KubeSpawner
from kubernetes_asyncio.config import kube_config

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    # pytest's importlib mode puts no test folder on sys.path: load the helpers of the modules that own them.
    spec = importlib.util.spec_from_file_location(f"gpupool_cluster_{name}", next(Path(__file__).resolve().parents[1].rglob(f"{name}.py")))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kc = _load("kube_cluster")
kube = _load("test_kube_spawner")  # JupyterHub's real user objects around a GPUKubeSpawner
helm_tests = _load("test_helm")  # the chart rendered by the real Helm library

POLICY_SETS = pytest.mark.parametrize("policies", [DEFAULT_POLICY_DIR, EXAMPLES_DIR], ids=["default", "examples"])
NAMESPACE = "gpupool-users"


def volcano_policy_copy(tmp_path: Path, queue_timeout: int, budgets: dict[str, int] | None = None) -> Path:
    """kube.policy_copy (the example policy, vision's queue timeout and some budgets changed), `kc.under_volcano`."""
    return kc.under_volcano(kube.policy_copy(tmp_path, queue_timeout, budgets))


@pytest.fixture(scope="module")
def cluster(request):
    kc.require(kc.missing_tools())
    failures = request.session.testsfailed
    with kc.running_cluster(keep=lambda: request.session.testsfailed > failures) as running:
        policy_dir = running.base / "node-policy"
        shutil.copytree(EXAMPLES_DIR, policy_dir)
        for node in kc.fake_nodes(load_policy(kc.under_volcano(policy_dir))):
            running.add_node(node["name"], node["labels"], node["allocatable"], node["taints"], node["annotations"])
        # Where the time-slicing ConfigMap goes: the NVIDIA GPU operator's namespace, there before gpupool.
        for namespace in (NAMESPACE, "gpu-operator"):
            running.kubectl("create", "namespace", namespace)
        yield running


def gpupool(*args: str, cwd: Path) -> str:
    """The `gpupool` command as an administrator runs it (another folder, the installed entry point)."""
    done = subprocess.run([str(Path(sys.executable).with_name("gpupool")), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def stored(cluster, obj: dict) -> dict:
    """The object as the API server now holds it."""
    group_version = obj["apiVersion"]
    prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    plural = {"Queue": "queues", "PriorityClass": "priorityclasses", "ConfigMap": "configmaps", "Job": "jobs",
              "Pod": "pods"}[obj["kind"]]
    namespace = obj["metadata"].get("namespace")
    where = f"/namespaces/{namespace}" if namespace else ""
    return cluster.get(f"{prefix}{where}/{plural}/{obj['metadata']['name']}")


def lost(sent, kept, path: str = "") -> list[str]:
    """What of `sent` the API server did not keep as sent (a structural schema prunes unknown fields; defaults
    it adds are fine): the paths of missing or changed values."""
    if isinstance(sent, dict) and isinstance(kept, dict):
        return [p for key, value in sent.items() for p in lost(value, kept.get(key), f"{path}.{key}")]
    if isinstance(sent, list) and isinstance(kept, list) and len(sent) == len(kept):
        return [p for i, (a, b) in enumerate(zip(sent, kept)) for p in lost(a, b, f"{path}[{i}]")]
    return [] if sent == kept else [f"{path}: sent {sent!r}, kept {kept!r}"]


# --- the engine ------------------------------------------------------------------------------------------------


def test_the_engine_is_the_pinned_release_with_volcanos_crds_and_fake_gpu_nodes(cluster):
    versions = dict(line.split("=", 1) for line in (ROOT / "kube" / "versions.env").read_text().splitlines()
                    if line and not line.startswith("#"))
    assert cluster.get("/version")["gitVersion"] == versions["KUBERNETES_VERSION"]
    for binary in kc.VOLCANO_BINARIES:  # Volcano's own version ldflags, as its Makefile sets them
        said = subprocess.run([str(kc.volcano_dir() / "bin" / binary), "--version"], capture_output=True,
                              text=True, timeout=60).stdout
        assert f"Version: {versions['VOLCANO_VERSION']}" in said and versions["VOLCANO_COMMIT"] in said, said
    # the scheduler configuration the chart ships, the one vc-scheduler reads
    assert (cluster.base / "volcano-scheduler" / kc.SCHEDULER_CONF.name).read_text() == kc.SCHEDULER_CONF.read_text()
    policies = {p["metadata"]["name"] for p in cluster.get(
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies")["items"]}
    assert {"queue-validation-policy"} <= policies
    crds = {c["metadata"]["name"]: c for c in cluster.get(
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions")["items"]}
    for name in ("queues.scheduling.volcano.sh", "podgroups.scheduling.volcano.sh", "jobs.batch.volcano.sh"):
        assert {"type": "Established", "status": "True"}.items() <= {
            k: v for c in crds[name]["status"]["conditions"] if c["type"] == "Established" for k, v in c.items()}.items()
    nodes = {n["metadata"]["name"]: n for n in cluster.get("/api/v1/nodes")["items"]}
    h200 = {name: n for name, n in nodes.items()
            if n["metadata"]["labels"].get("nvidia.com/gpu.product") == "NVIDIA-H200"}
    # one device plugin a node: NVIDIA's (MIG slices, whole cards), HAMi's, Volcano's vGPU one
    assert sorted(h200) == ["gpu-h200-0", "gpu-h200-1", "gpu-h200-volcano-vgpu-0", "gpu-h200-volcano-vgpu-1"]
    for node in h200.values():
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert ready["Ready"] == "True"  # KWOK's node stage, no kubelet
        assert "nvidia.com/gpumem-percentage" not in node["status"]["allocatable"]  # no device plugin's resource
        assert "nvidia.com/gpucores" not in node["status"]["allocatable"]
    assert h200["gpu-h200-0"]["status"]["allocatable"]["nvidia.com/mig-1g.18gb"] == "56"
    hami = nodes["gpu-a100-80gb-hami-0"]  # the A100's HAMi profile's node
    assert {k: v for k, v in hami["status"]["allocatable"].items() if "/" in k} == {"nvidia.com/gpu": "80"}
    cards = json.loads(hami["metadata"]["annotations"]["hami.io/node-nvidia-register"])
    assert len(cards) == 8 and cards[0]["devmem"] == 80 * 1024 and cards[0]["type"] == "NVIDIA-NVIDIA-A100-SXM4-80GB"
    vgpu = h200["gpu-h200-volcano-vgpu-0"]
    assert {k: v for k, v in vgpu["status"]["allocatable"].items() if k.startswith("volcano.sh/")} == {
        "volcano.sh/vgpu-number": "80", "volcano.sh/vgpu-memory": str(8 * 141 * 1024), "volcano.sh/vgpu-cores": "800"}
    registered = vgpu["metadata"]["annotations"]["volcano.sh/node-vgpu-register"].rstrip(":").split(":")
    assert len(registered) == 8 and registered[0].split(",")[1:] == ["10", str(141 * 1024), "NVIDIA-NVIDIA-H200",
                                                                      "true", "hami-core"]


# --- what gpupool renders, applied for real ----------------------------------------------------------------------


@POLICY_SETS
def test_render_applies_server_side_and_a_second_apply_changes_nothing(cluster, policies, tmp_path):
    manifest = gpupool("render", "--policies", str(policies), "--namespace", NAMESPACE, cwd=tmp_path)
    objects = [o for o in yaml.safe_load_all(manifest) if o]
    try:
        applied_twice_changes_nothing(cluster, manifest, objects)
    finally:  # what later tests apply starts from a cluster without these
        cluster.kubectl("delete", "--wait", "--ignore-not-found", "-f", "-", input=manifest)


def test_teams_named_as_go_reads_numbers_are_applied_as_written(cluster, tmp_path):
    """Philly's virtual clusters are teams named `6214e9`: PyYAML writes that plain, Kubernetes' YAML parser
    (go-yaml) reads it as a number, and `kubectl apply` refused every object labelled with it. Rendered, applied
    and stored as written, with YAML 1.2's octal form beside it."""
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "policy.yaml").write_text(
        "models:\n  P100: {vendor: nvidia, memory_gib: 16, backends: [whole]}\n"
        "inventory:\n  - {model: P100, count: 16}\n"
        "teams:\n  6214e9: {queue: {deserved: {nvidia.com/gpu: '8'}}}\n  0o17: {}\n")
    manifest = gpupool("render", "--policies", str(policies), "--namespace", NAMESPACE, cwd=tmp_path)
    try:
        cluster.kubectl("apply", "--server-side", "-f", "-", input=manifest)
        for team in ("6214e9", "0o17"):
            queue = cluster.get(f"/apis/scheduling.volcano.sh/v1beta1/queues/{team}")
            assert queue["metadata"]["labels"]["gpupool.io/team"] == team
            assert cluster.get(f"/apis/scheduling.k8s.io/v1/priorityclasses/gpupool-{team}")["metadata"]["labels"][
                "gpupool.io/team"] == team
        assert cluster.get("/apis/scheduling.volcano.sh/v1beta1/queues/6214e9")["spec"]["deserved"] == {
            "nvidia.com/gpu": "8"}
    finally:
        cluster.kubectl("delete", "--wait", "--ignore-not-found", "-f", "-", input=manifest)


def as_applied(stored_object: dict) -> dict:
    """What gpupool's apply wrote of a stored object: all but its status and the resource version, which Volcano's
    queue controller changes on its own (a Queue's state), and with only gpupool's entries of its managed fields
    (an apply that writes anything renews their time)."""
    kept = {key: value for key, value in stored_object.items() if key != "status"}
    metadata = dict(kept["metadata"])
    metadata.pop("resourceVersion", None)
    metadata["managedFields"] = [entry for entry in metadata.get("managedFields", [])
                                 if entry.get("manager") == "gpupool"]
    assert metadata["managedFields"], stored_object["metadata"].get("managedFields")
    kept["metadata"] = metadata
    return kept


def applied_twice_changes_nothing(cluster, manifest: str, objects: list[dict]) -> None:
    first = cluster.kubectl("apply", "--server-side", "--field-manager", "gpupool", "-f", "-", input=manifest)
    assert "serverside-applied" in first.stdout
    versions = {(o["kind"], o["metadata"]["name"]): as_applied(stored(cluster, o)) for o in objects}
    again = cluster.kubectl("apply", "--server-side", "--field-manager", "gpupool", "-f", "-", input=manifest)
    assert again.returncode == 0
    assert {(o["kind"], o["metadata"]["name"]): as_applied(stored(cluster, o))
            for o in objects} == versions  # nothing was written the second time
    queues = [o for o in objects if o["kind"] == "Queue"]
    assert queues
    for queue in queues:  # Volcano's CRD keeps all that gpupool wrote: no field pruned
        assert lost(queue, stored(cluster, queue)) == []
    # What a third apply would write, asked of the API server itself (a server-side dry run): the same as what is
    # stored, status aside. (`kubectl diff --server-side` compares whole objects: it shows the status Volcano's
    # controllers write between its read of the live object and its dry run, on a busy machine.)
    dry = cluster.kubectl("apply", "--server-side", "--field-manager", "gpupool", "--dry-run=server", "-o", "json",
                          "--show-managed-fields", "-f", "-", input=manifest)
    answer = json.loads(dry.stdout)
    would = {(o["kind"], o["metadata"]["name"]): without_times(as_applied(o)) for o in answer.get("items", [answer])}
    assert would == {(o["kind"], o["metadata"]["name"]): without_times(as_applied(stored(cluster, o)))
                     for o in objects}


def without_times(applied: dict) -> dict:
    """`as_applied` without the time of gpupool's managed-fields entries (a dry run may stamp its own)."""
    metadata = dict(applied["metadata"])
    metadata["managedFields"] = [{k: v for k, v in entry.items() if k != "time"} for entry in metadata["managedFields"]]
    return {**applied, "metadata": metadata}


def test_a_changed_team_priority_needs_its_priority_class_replaced(cluster, tmp_path):
    """A PriorityClass's value cannot change (the API server refuses the update): after a team's priority
    changes, `kubectl apply` of the new render names the class; deleting it and applying again (what
    docs/kubernetes.md tells an administrator to do) recreates it."""
    policies = tmp_path / "policies"
    shutil.copytree(EXAMPLES_DIR, policies)
    before = gpupool("render", "--policies", str(policies), "--namespace", NAMESPACE, cwd=tmp_path)
    try:
        priority_change(cluster, policies, tmp_path, before)
    finally:
        cluster.kubectl("delete", "--wait", "--ignore-not-found", "-f", "-", input=before)


def priority_change(cluster, policies: Path, tmp_path: Path, before: str) -> None:
    cluster.kubectl("apply", "--server-side", "-f", "-", input=before)
    teams = policies / "teams.yaml"
    teams.write_text(teams.read_text().replace("priority: 100", "priority: 150", 1))
    after = gpupool("render", "--policies", str(policies), "--namespace", NAMESPACE, cwd=tmp_path)
    changed = [o for o in yaml.safe_load_all(after) if o and o["kind"] == "PriorityClass"
               and stored(cluster, o)["value"] != o["value"]]
    # the team's class and its low-priority jobs' class (the team's priority moved by the offset)
    assert sorted(o["metadata"]["name"] for o in changed) == ["gpupool-research", "gpupool-research-low-jobs"]
    refused = cluster.kubectl("apply", "--server-side", "-f", "-", input=after, check=False)
    assert refused.returncode != 0 and "may not be changed in an update" in refused.stderr
    assert all(o["metadata"]["name"] in refused.stderr for o in changed)
    cluster.kubectl("delete", "priorityclass", *(o["metadata"]["name"] for o in changed))
    cluster.kubectl("apply", "--server-side", "-f", "-", input=after)
    assert [stored(cluster, o)["value"] for o in changed] == [o["value"] for o in changed]


def test_the_api_server_refuses_a_queue_volcanos_crd_refuses(cluster):
    broken = {"apiVersion": "scheduling.volcano.sh/v1beta1", "kind": "Queue", "metadata": {"name": "broken"},
              "spec": {"weight": "heavy"}}
    done = cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(broken), check=False)
    assert done.returncode != 0 and "spec.weight" in done.stderr
    assert cluster.api().get(f"{cluster.url}/apis/scheduling.volcano.sh/v1beta1/queues/broken").status_code == 404


def test_the_charts_manifests_pass_a_server_side_dry_run(cluster, tmp_path):
    values = helm_tests.merge(helm_tests.values_for(EXAMPLES_DIR), {
        "mlflow": {"enabled": True, "artifacts": {"destination": "s3://mlflow/", "existingSecret": "s3-keys",
                                                 "s3EndpointUrl": "http://seaweedfs:8333"}},
        "ingress": {"enabled": True, "className": "nginx", "hosts": ["gpu.example.org"]}})
    objects = helm_tests.render(values)
    cluster.kubectl("create", "namespace", helm_tests.NAMESPACE)
    documents = "\n---\n".join(yaml.safe_dump(o) for o in objects)
    done = cluster.kubectl("apply", "--dry-run=server", "--server-side", "-f", "-", input=documents, check=False)
    assert done.returncode == 0, done.stderr
    assert len([line for line in done.stdout.splitlines() if "(server dry run)" in line]) == len(objects)


@POLICY_SETS
def test_every_profiles_volcano_job_is_stored_by_volcanos_crd_without_a_field_lost(cluster, policies):
    policy = load_policy(policies)
    session = cluster.api()
    url = f"{cluster.url}/apis/batch.volcano.sh/v1alpha1/namespaces/{NAMESPACE}/jobs"
    checked = 0
    for slug, profile in policy.profiles.items():
        for team in profile.teams:
            spec = JobSpec(job_id=f"j{checked:04d}", user="alice", team=team, profile=slug,
                           command=("python", "train.py"), env={"SEED": "1"}, workdir="/home/jovyan",
                           max_restarts=2, checkpoint_claim="gpupool-checkpoints")
            job = volcano_job(spec, policy, Release(), NAMESPACE, default_image="quay.io/jupyterhub/singleuser:5.3")
            created = session.post(url, json=job, timeout=10)
            assert created.status_code == 201, created.text
            kept = created.json()
            # Volcano's structural schema prunes what it does not know: nothing of gpupool's may go.
            assert lost(job, kept) == [], slug
            assert session.delete(f"{url}/{job['metadata']['name']}", timeout=10).ok
            checked += 1
    assert checked >= 3


# --- GPUKubeSpawner against the real API server and scheduler ---------------------------------------------------


@pytest.fixture
def kubeconfig(cluster, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(cluster.kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return cluster.kubeconfig


@pytest_asyncio.fixture
async def reflectors():
    await kube.forget_kube_clients()
    yield
    await kube.forget_kube_clients()


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    monkeypatch.setenv("GPUPOOL_LEDGER_URL", url)
    return get_ledger(url)


def real_spawner_config(policy_dir: Path, cluster) -> object:
    c = kube.spawner_config(policy_dir, cluster.url, start_timeout=60)
    c.GPUKubeSpawner.namespace = NAMESPACE
    c.GPUKubeSpawner.queue_poll_interval = 0.2
    c.GPUKubeSpawner.k8s_api_request_retry_timeout = 30
    return c


@pytest.mark.asyncio
async def test_a_notebook_pod_runs_on_a_node_of_its_model_is_readopted_and_deleted(
        cluster, kubeconfig, reflectors, ledger, tmp_path, monkeypatch):
    policies = volcano_policy_copy(tmp_path, queue_timeout=60)
    cluster.kubectl("apply", "--server-side", "-f", "-",
                    input=gpupool("render", "--policies", str(policies), "--namespace", NAMESPACE, cwd=tmp_path))
    hub = kube.HubDB(real_spawner_config(policies, cluster))
    spawner = hub.spawner("alice", ("vision",))
    await spawner._run_apply_user_options({"profile": "h200-quarter"})
    url = await asyncio.wait_for(spawner.start(), 120)

    pod = cluster.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{spawner.pod_name}")
    node = cluster.get(f"/api/v1/nodes/{pod['spec']['nodeName']}")
    assert pod["spec"]["schedulerName"] == kc.VOLCANO_SCHEDULER
    assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-H200"
    assert pod["status"]["phase"] == "Running" and url == f"http://{pod['status']['podIP']}:8888"
    # The Priority admission plugin turned the class into the number `gpupool render` gave it.
    priority_class = cluster.get(f"/apis/scheduling.k8s.io/v1/priorityclasses/{pod['spec']['priorityClassName']}")
    assert pod["spec"]["priority"] == priority_class["value"]
    assert pod["metadata"]["annotations"]["scheduling.volcano.sh/queue-name"] == "vision"
    # Volcano's controller made the pod's PodGroup in its team's queue; Volcano's scheduler bound it through its
    # vGPU device plugin (deviceshare), which wrote the card it gave: the node's, with a quarter's MiB and cores.
    # The type it writes is the request's device vendor, `NVIDIA` (vgpu.NvidiaGPUDevice: fitInDevices writes the
    # request's type, not the card's `NVIDIA-<model>` the node registered).
    group_url = (f"/apis/scheduling.volcano.sh/v1beta1/namespaces/{NAMESPACE}/podgroups/"
                 f"{pod['metadata']['annotations']['scheduling.k8s.io/group-name']}")
    assert cluster.get(group_url)["spec"]["queue"] == "vision"
    kc._wait("its PodGroup Running (Volcano's next session)",
             lambda: cluster.get(group_url)["status"]["phase"] == "Running", 60)
    assert pod["metadata"]["annotations"]["volcano.sh/vgpu-node"] == node["metadata"]["name"]
    card, kind, mib, cores = pod["metadata"]["annotations"]["volcano.sh/vgpu-ids-new"].rstrip(":").split(",")
    assert card.startswith(f"GPU-{node['metadata']['name']}-") and kind == "NVIDIA"
    assert (int(mib), int(cores)) == (int(141 * 1024 * 0.25), 25)
    (running,) = ledger.open_intervals()
    assert (running.user, running.team, running.profile, running.model, running.share, running.state) == (
        "alice", "vision", "h200-quarter", "H200", Fraction(1, 4), State.RUNNING)

    # A new hub process: no reflectors, the spawner built from the database, the pod found again.
    spawner._spawn_pending = spawner._start_pending = False
    hub.save_state(spawner)
    await KubeSpawner._stop_all_reflectors()
    again = hub.spawner("alice")
    assert await again.poll() is None
    assert again.pod_name == spawner.pod_name and again.usage_run == spawner.usage_run

    await asyncio.wait_for(again.stop(), 120)
    gone = cluster.api().get(f"{cluster.url}/api/v1/namespaces/{NAMESPACE}/pods/{spawner.pod_name}", timeout=10)
    assert gone.status_code == 404  # KWOK's delete stage finished what the kubelet would
    assert await again.poll() == 1
    assert ledger.interval(running.key).how == HowEnded.STOPPED and ledger.open_intervals() == []


@pytest.mark.asyncio
async def test_each_backends_pod_is_admitted_by_the_api_server_and_bound_to_a_node_that_offers_it(
        cluster, kubeconfig, reflectors, ledger, tmp_path):
    # The example policy as it is (kube.MANIFESTS is what it renders), less its HAMi profiles: HAMi's pods need
    # HAMi's scheduler (its extender counts the cores and memory its device plugin registers in a node
    # annotation), and Volcano's scheduler, this cluster's engine, leaves them Pending.
    policies = kube.policy_copy(tmp_path, queue_timeout=60)
    cluster.kubectl("apply", "--server-side", "-f", "-",
                    input=gpupool("render", "--policies", str(policies), "--namespace", NAMESPACE, cwd=tmp_path))
    hub = kube.HubDB(real_spawner_config(policies, cluster))
    policy = load_policy(policies)
    landed = {}
    for (user, team, slug, image), expected in kube.MANIFESTS.items():
        if policy.profiles[slug].gpu is not None and policy.profiles[slug].gpu.backend == "hami":
            continue
        spawner = hub.spawner(user, kube.GROUPS[user])
        await spawner._run_apply_user_options({"profile": slug, **({"image": image} if image else {})})
        await asyncio.wait_for(spawner.start(), 120)
        pod = cluster.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{spawner.pod_name}")
        node = cluster.get(f"/api/v1/nodes/{pod['spec']['nodeName']}")
        for name, amount in (expected["requests"] or {}).items():
            assert name in node["status"]["allocatable"], (slug, name)
        for label, value in (expected["nodeSelector"] or {}).items():
            assert node["metadata"]["labels"][label] == value
        landed[slug] = node["metadata"]["name"]
        spawner._spawn_pending = spawner._start_pending = False
        await asyncio.wait_for(spawner.stop(), 120)
    # no NVIDIA toleration: never on a tainted NVIDIA node (untainted nodes, the CPU one or the Hygon ones, may)
    assert not landed["cpu"].startswith(("gpu-h200", "gpu-a100", "gpu-rtx4090"))
    assert landed["h200-mig-1g"].startswith("gpu-h200")
    assert "mig-3g-40gb" in landed["a100-mig-3g"]  # MIG's single strategy: the node labelled by slice
    assert landed["a100-quarter-vgpu"].startswith("gpu-a100-80gb-volcano-vgpu-")  # Volcano's vGPU plugin's node
    assert ledger.open_intervals() == []


@pytest.mark.asyncio
async def test_four_quarter_h200_notebooks_share_one_card_through_volcanos_vgpu_plugin_and_a_fifth_waits(
        cluster, kubeconfig, reflectors, ledger, tmp_path):
    """A node of one H200, registered as Volcano's vGPU device plugin registers it: Volcano's scheduler puts
    four 0.25 × H200 notebooks on its one card (each pod told which card, and its quarter of MiB and cores), the
    fifth waits with the scheduler's reason on its spawn page, and runs once one of the four has stopped."""
    policies = volcano_policy_copy(tmp_path, queue_timeout=240)
    cluster.kubectl("apply", "--server-side", "-f", "-",
                    input=gpupool("render", "--policies", str(policies), "--namespace", NAMESPACE, cwd=tmp_path))
    annotations, resources = kc.device_registration("volcano-vgpu", "one-card-h200", 1, 141 * 1024, "NVIDIA-H200")
    cluster.add_node("one-card-h200", {"nvidia.com/gpu.product": "NVIDIA-H200", "gpupool.io/test-node": "one-card"},
                     {**kc.NODE_BASICS, **resources}, [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}],
                     annotations)
    config = real_spawner_config(policies, cluster)
    config.GPUKubeSpawner.node_selector = {"gpupool.io/test-node": "one-card"}
    hub = kube.HubDB(config)
    spawners = []
    fifth = None
    try:
        for n in range(4):
            spawner = hub.spawner(f"viewer{n}", ("vision",))
            await spawner._run_apply_user_options({"profile": "h200-quarter"})
            await asyncio.wait_for(spawner.start(), 120)
            spawners.append(spawner)
        pods = [cluster.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{s.pod_name}") for s in spawners]
        cards = {p["metadata"]["annotations"]["volcano.sh/vgpu-ids-new"].split(",")[0] for p in pods}
        assert cards == {"GPU-one-card-h200-00"} and {p["spec"]["nodeName"] for p in pods} == {"one-card-h200"}

        fifth = hub.spawner("viewer4", ("vision",))
        await fifth._run_apply_user_options({"profile": "h200-quarter"})
        starting = asyncio.ensure_future(fifth.start())
        said = await until("the fifth's wait explained on its spawn page", lambda: (
            status := getattr(fifth, "_gpupool_status", "")) and "Waiting for 0.25 × H200" in status
            and "waiting for" not in status.split("(", 1)[1] and status)
        pod = cluster.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{fifth.pod_name}")
        assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")
        print(f"the fifth notebook's spawn page says: {said}")
        assert not starting.done()

        spawners[0]._spawn_pending = spawners[0]._start_pending = False
        await asyncio.wait_for(spawners.pop(0).stop(), 120)
        await asyncio.wait_for(starting, 120)  # its card has room again: Volcano binds it
        pod = cluster.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{fifth.pod_name}")
        assert pod["spec"]["nodeName"] == "one-card-h200" and pod["status"]["phase"] == "Running"
        spawners.append(fifth)
        fifth = None
    finally:
        for spawner in spawners + ([fifth] if fifth else []):
            spawner._spawn_pending = spawner._start_pending = False
            await asyncio.wait_for(spawner.stop(), 120)
        cluster.kubectl("delete", "node", "one-card-h200", "--wait=false")


# --- a real hub with GPUKubeSpawner ------------------------------------------------------------------------------

KUBE_HUB = """
c.LocalGPUSpawner.run_as = "self"
c.JupyterHub.spawner_class = "gpupool.spawner.kube.GPUKubeSpawner"
c.GPUKubeSpawner.policy_dir = c.LocalGPUSpawner.policy_dir
c.GPUKubeSpawner.ledger_url = c.LocalGPUSpawner.ledger_url
c.GPUKubeSpawner.namespace = {namespace!r}
# Not pulled: PodProcesses runs the command of the pod on this machine, on the pod's loopback address.
c.GPUKubeSpawner.cmd = [{singleuser!r}]
c.GPUKubeSpawner.hub_connect_url = f"http://127.0.0.1:{{c.JupyterHub.hub_port}}"
c.GPUKubeSpawner.start_timeout = 240
c.GPUKubeSpawner.queue_poll_interval = 0.5
"""


def test_a_real_hub_starts_a_notebook_pod_its_user_reaches_which_survives_a_hub_restart_and_stops(
        cluster, tmp_path, monkeypatch):
    from harness import Hub

    policies = volcano_policy_copy(tmp_path, queue_timeout=240)
    cluster.kubectl("apply", "--server-side", "-f", "-",
                    input=gpupool("render", "--policies", str(policies), "--namespace", NAMESPACE, cwd=tmp_path))
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))  # what the hub process finds the cluster by
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    singleuser = str(Path(sys.executable).with_name("jupyterhub-singleuser"))
    hub = Hub(tmp_path / "hub", {p.name: p.read_text() for p in policies.glob("*.yaml")},
              KUBE_HUB.format(namespace=NAMESPACE, singleuser=singleuser), mlflow=False)
    workdir = tmp_path / "containers"
    workdir.mkdir()
    with kc.PodProcesses(cluster, NAMESPACE, workdir):
        hub.start()
        try:
            hub.add_user("alice", "vision")
            reply = hub.api("POST", "/users/alice/server", json={"profile": "h200-quarter"})
            assert reply.status_code in (201, 202), reply.text
            server = hub.wait_ready("alice", timeout=240)
            pods = cluster.get(f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=hub.jupyter.org/username=alice")
            (pod,) = pods["items"]
            node = cluster.get(f"/api/v1/nodes/{pod['spec']['nodeName']}")
            assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-H200"
            assert pod["metadata"]["annotations"]["scheduling.volcano.sh/queue-name"] == "vision"
            assert server["ready"] and pod["status"]["phase"] == "Running"
            # alice reaches her server through the hub's proxy with her own token.
            token = hub.user_token("alice")
            status = requests.get(f"{hub.url}/user/alice/api/status", headers={"Authorization": f"token {token}"},
                                  timeout=30)
            assert status.status_code == 200, status.text
            ledger = get_ledger(hub.ledger_url)
            (held,) = ledger.open_intervals()
            assert (held.user, held.profile, held.share, held.state) == ("alice", "h200-quarter", Fraction(1, 4),
                                                                         State.RUNNING)

            # The hub crashes and comes back: the pod and its server are found again, the interval goes on.
            hub.kill()
            hub.start()
            hub.wait_ready("alice", timeout=120)
            again = requests.get(f"{hub.url}/user/alice/api/status", headers={"Authorization": f"token {token}"},
                                 timeout=30)
            assert again.status_code == 200, again.text
            assert [i.key for i in ledger.open_intervals()] == [held.key]

            # A named server beside it: a pod of its own, its own run in the ledger; stopping it leaves the other.
            reply = hub.api("POST", "/users/alice/servers/second", json={"profile": "h200-quarter"})
            assert reply.status_code in (201, 202), reply.text
            hub.wait_ready("alice", timeout=240, server="second")
            pods = cluster.get(f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector=hub.jupyter.org/username=alice")
            named = [p for p in pods["items"] if p["metadata"]["name"] != pod["metadata"]["name"]]
            assert len(pods["items"]) == 2 and named[0]["status"]["phase"] == "Running", pods["items"]
            assert named[0]["metadata"]["annotations"]["hub.jupyter.org/servername"] == "second"
            second = [i for i in ledger.open_intervals() if i.key != held.key]
            assert len(second) == 1 and second[0].run != held.run and second[0].share == Fraction(1, 4)
            hub.stop_server("alice", timeout=120, server="second")
            assert ledger.interval(second[0].key).how == HowEnded.STOPPED
            assert [i.key for i in ledger.open_intervals()] == [held.key]
            assert requests.get(f"{hub.url}/user/alice/api/status", headers={"Authorization": f"token {token}"},
                                timeout=30).status_code == 200

            hub.stop_server("alice", timeout=120)
            gone = cluster.api().get(f"{cluster.url}/api/v1/namespaces/{NAMESPACE}/pods/{pod['metadata']['name']}",
                                     timeout=10)
            assert gone.status_code == 404
            assert ledger.interval(held.key).how == HowEnded.STOPPED and ledger.open_intervals() == []
        finally:
            hub.stop()


# --- the rendered PriorityClasses under a real scheduler ---------------------------------------------------------


def quarter_pod(name: str, priority_class: str) -> dict:
    """A 0.25 × H200 (Volcano vGPU) pod of team vision for the tiny node, at `priority_class`, as a deprioritized
    server's looks (Volcano takes victims only among pods marked preemptable)."""
    gpu = {"volcano.sh/vgpu-number": "1", "volcano.sh/vgpu-memory": str(int(141 * 1024 * 0.25)),
           "volcano.sh/vgpu-cores": "25"}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {
                "name": name, "namespace": NAMESPACE,
                "annotations": {"scheduling.volcano.sh/queue-name": "vision", "volcano.sh/preemptable": "true"}},
            "spec": {"schedulerName": kc.VOLCANO_SCHEDULER, "priorityClassName": priority_class,
                     "nodeSelector": {"gpupool.io/test-node": "tiny"},
                     "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                     "containers": [{"name": "notebook", "image": "quay.io/jupyterhub/singleuser:5.3",
                                     "resources": {"limits": gpu, "requests": gpu}}]}}


def whole_card_pod(name: str, cards: int) -> dict:
    """A pod of team vision asking `cards` whole cards of the nodes only `test_whole_cards_fill_one_node…`
    adds, with no CPU or memory requests (binpack then scores nodes by their cards; nodeorder still counts
    Kubernetes' default requests and prefers the emptier node)."""
    gpu = {"nvidia.com/gpu": str(cards)}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {
                "name": name, "namespace": NAMESPACE,
                "annotations": {"scheduling.volcano.sh/queue-name": "vision", "volcano.sh/preemptable": "false"}},
            "spec": {"schedulerName": kc.VOLCANO_SCHEDULER, "priorityClassName": "gpupool-vision",
                     "nodeSelector": {"gpupool.io/test-node": "pack"}, "terminationGracePeriodSeconds": 0,
                     "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                     "containers": [{"name": "train", "image": "quay.io/jupyterhub/singleuser:5.3",
                                     "resources": {"limits": gpu, "requests": gpu}}]}}


def test_whole_cards_fill_one_node_so_that_a_job_of_a_whole_node_still_starts(cluster, tmp_path):
    """The chart's `binpack` counts `nvidia.com/gpu`: four one-card pods go on one node of two, and a pod of
    eight cards then runs on the other. Without `binpack.resources` binpack counted CPU and memory only and
    nodeorder spread the four over both nodes (the Philly replay's check against the engine: a 4-card job
    waited half an hour at 31% utilisation), and the eight-card pod waited with eight cards free."""
    policies = volcano_policy_copy(tmp_path, queue_timeout=120)
    cluster.kubectl("apply", "--server-side", "-f", "-",
                    input=gpupool("render", "--policies", str(policies), "--namespace", NAMESPACE, cwd=tmp_path))
    for n in range(2):
        cluster.add_node(f"pack-h200-{n}", {"nvidia.com/gpu.product": "NVIDIA-H200", "gpupool.io/test-node": "pack"},
                         {**kc.NODE_BASICS, "nvidia.com/gpu": "8"}, [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}])
    pods = f"{cluster.url}/api/v1/namespaces/{NAMESPACE}/pods"
    session = cluster.api()
    names = [f"one-card-{n}" for n in range(4)]
    try:
        for name in names:
            assert session.post(pods, json=whole_card_pod(name, 1), timeout=10).status_code == 201
        kc._wait("the four one-card pods running", lambda: all(
            cluster.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")["status"].get("phase") == "Running"
            for name in names), 60)
        nodes = {cluster.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")["spec"]["nodeName"] for name in names}
        assert len(nodes) == 1, nodes
        assert session.post(pods, json=whole_card_pod("eight-cards", 8), timeout=10).status_code == 201
        kc._wait("the eight-card pod running", lambda: cluster.get(
            f"/api/v1/namespaces/{NAMESPACE}/pods/eight-cards")["status"].get("phase") == "Running", 60)
        assert cluster.get(f"/api/v1/namespaces/{NAMESPACE}/pods/eight-cards")["spec"]["nodeName"] not in nodes
    finally:
        for name in [*names, "eight-cards"]:
            session.delete(f"{pods}/{name}", json={"gracePeriodSeconds": 0}, timeout=10)
        kc._wait("the pods gone", lambda: not [p for p in session.get(pods, timeout=10).json()["items"]
                                                if p["metadata"]["name"] in {*names, "eight-cards"}], 60)


@pytest.mark.asyncio
async def test_the_rendered_priority_classes_let_a_teams_notebook_preempt_deprioritized_work_and_not_back(
        cluster, kubeconfig, reflectors, ledger, tmp_path):
    """Work past its budget runs in `gpupool-deprioritized` (preemptionPolicy Never, lowest value): Volcano's
    preempt action (the chart's scheduler configuration) evicts it for its team's notebook that does not fit,
    and a deprioritized pod that does not fit pushes nobody out."""
    policies = volcano_policy_copy(tmp_path, queue_timeout=120)
    cluster.kubectl("apply", "--server-side", "-f", "-",
                    input=gpupool("render", "--policies", str(policies), "--namespace", NAMESPACE, cwd=tmp_path))
    # A node with room for two quarters (one card with half an H200's memory, as Volcano's vGPU device plugin
    # registers it), that only this test's pods select.
    annotations, resources = kc.device_registration("volcano-vgpu", "tiny-h200", 1, 2 * int(141 * 1024 * 0.25),
                                                    "NVIDIA-H200")
    cluster.add_node("tiny-h200", {"nvidia.com/gpu.product": "NVIDIA-H200", "gpupool.io/test-node": "tiny"},
                     {**kc.NODE_BASICS, **resources}, [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}],
                     annotations)
    pods = f"{cluster.url}/api/v1/namespaces/{NAMESPACE}/pods"
    session = cluster.api()
    try:
        for n in range(3):
            assert session.post(pods, json=quarter_pod(f"over-budget-{n}", "gpupool-deprioritized"),
                                timeout=10).status_code == 201
            if n < 2:  # running, its card taken by the vGPU device plugin (a real pod's is before it runs)
                kc._wait(f"over-budget-{n} running", lambda n=n: (pod := cluster.get(
                    f"/api/v1/namespaces/{NAMESPACE}/pods/over-budget-{n}"))["status"].get("phase") == "Running"
                    and kc.vgpu_bound(pod), 60)
        # The third does not fit, and being deprioritized it preempts nobody: the scheduler says so and waits.
        kc._wait("the third deprioritized pod to be found unschedulable", lambda: any(
            c["type"] == "PodScheduled" and c["status"] == "False" for c in cluster.get(
                f"/api/v1/namespaces/{NAMESPACE}/pods/over-budget-2")["status"].get("conditions", [])), 60)

        config = real_spawner_config(policies, cluster)
        config.GPUKubeSpawner.node_selector = {"gpupool.io/test-node": "tiny"}
        spawner = kube.HubDB(config).spawner("alice", ("vision",))
        await spawner._run_apply_user_options({"profile": "h200-quarter"})
        await asyncio.wait_for(spawner.start(), 120)  # vision's notebook: it did not fit, and now it runs
        notebook = cluster.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{spawner.pod_name}")
        assert notebook["spec"]["nodeName"] == "tiny-h200" and notebook["spec"]["priority"] > 0
        left = {p["metadata"]["name"]: p for p in session.get(pods, timeout=10).json()["items"]
                if p["metadata"]["name"].startswith("over-budget-") and not p["metadata"].get("deletionTimestamp")}
        # One of the two running deprioritized pods was preempted for it; the waiting one still waits.
        assert sorted(left) in (["over-budget-0", "over-budget-2"], ["over-budget-1", "over-budget-2"]), sorted(left)
        assert left["over-budget-2"]["status"]["phase"] == "Pending"
        spawner._spawn_pending = spawner._start_pending = False
        await asyncio.wait_for(spawner.stop(), 120)
    finally:
        for n in range(3):
            session.delete(f"{pods}/over-budget-{n}", params={"gracePeriodSeconds": 0}, timeout=10)
        cluster.kubectl("delete", "node", "tiny-h200", "--wait=false")


# --- training jobs as Volcano Jobs (gpupool.spawner.jobs.volcano) ---------------------------------------------
# Volcano's job controller (vc-controller-manager) makes each Job's PodGroup and pod and applies its policies;
# Volcano's scheduler binds the pods, KWOK runs and fails them, and gpupool's job runner reads all of it through
# the real API server.


@pytest_asyncio.fixture
async def job_cluster(cluster, tmp_path, ledger):
    """The example policies rendered and applied, and the job runner's kubernetes_asyncio clients (the hub's
    kind: from a kubeconfig)."""
    from kubernetes_asyncio import client as k8s
    from kubernetes_asyncio import config as k8s_config

    policies = volcano_policy_copy(tmp_path, queue_timeout=60)
    cluster.kubectl("apply", "--server-side", "-f", "-",
                    input=gpupool("render", "--policies", str(policies), "--namespace", NAMESPACE, cwd=tmp_path))
    api = await k8s_config.new_client_from_config(config_file=str(cluster.kubeconfig))
    yield SimpleNamespace(policy=load_policy(policies), custom=k8s.CustomObjectsApi(api),
                          core=k8s.CoreV1Api(api), store=JobStore(ledger.engine), ledger=ledger)
    # What a failed test left goes: the Volcano Jobs, and their pods with them (the garbage collector)
    for job in cluster.get(f"/apis/batch.volcano.sh/v1alpha1/namespaces/{NAMESPACE}/jobs")["items"]:
        cluster.api().delete(f"{cluster.url}/apis/batch.volcano.sh/v1alpha1/namespaces/{NAMESPACE}/jobs/"
                             f"{job['metadata']['name']}", timeout=10)
    await until("no job pods left", lambda: not cluster.get(
        f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector={JOB_ID_LABEL}")["items"])
    await api.close()


def runner_for(jobs) -> JobRunner:
    backend = VolcanoBackend(jobs.custom, jobs.core, NAMESPACE, Release(), "quay.io/jupyterhub/singleuser:5.3")
    return JobRunner(jobs.store, jobs.ledger, lambda: jobs.policy, backend, logging.getLogger("test-kube-jobs"),
                     tick=0.2)


def submit(jobs, user: str = "alice", **options) -> Job:
    submission = JobSubmission(profile="h200-quarter", team="vision", command=["python", "train.py"], **options)
    resolved = resolve(jobs.policy, user, ["vision"], submission)
    return jobs.store.submit(user, resolved, submission, periods.utcnow())


async def until(what: str, check, timeout: float = 60):
    """Wait (on the event loop, where the runner works) until `check()` is true; its value."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not (value := await asyncio.to_thread(check)):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)
    return value


def job_pod(cluster, job_id: str) -> dict | None:
    pods = cluster.get(f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector={JOB_ID_LABEL}%3D{job_id}")["items"]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return live[0] if live else None


def running_pod(cluster, job_id: str, retry: int):
    pod = job_pod(cluster, job_id)
    ok = (pod is not None and pod["status"].get("phase") == "Running"
          and pod["metadata"]["annotations"]["volcano.sh/job-retry-count"] == str(retry))
    return pod if ok else None


def fail_through_kwok(cluster, pod: dict, exit_code: int) -> None:
    """KWOK's chaos stage fails the pod's container with `exit_code` (about a second later)."""
    patch = {"metadata": {"labels": {"pod-container-running-failed.stage.kwok.x-k8s.io": "true"},
                          "annotations": {"pod-container-running-failed.stage.kwok.x-k8s.io/exit-code": str(exit_code)}}}
    cluster.kubectl("patch", "pod", "-n", NAMESPACE, pod["metadata"]["name"], "--type", "merge", "-p", json.dumps(patch))


def job_log_text(jobs, job_id: str) -> str:
    return jobs.store.read_log(job_id, 0, 1 << 20).decode()


def pod_header(pod: dict) -> str:
    return (f"--- gpupool: pod {pod['metadata']['name']} on node {pod['spec']['nodeName']}, started at "
            f"{running_since(pod)} ---\n")


def pod_footer(pod: dict, how: str) -> str:
    return f"--- gpupool: pod {pod['metadata']['name']} ended ({how}) ---\n"


def volcano_job_of(cluster, job_id: str) -> dict | None:
    reply = cluster.api().get(f"{cluster.url}/apis/batch.volcano.sh/v1alpha1/namespaces/{NAMESPACE}/jobs/"
                              f"{job_name(job_id)}", timeout=10)
    return reply.json() if reply.ok else None


def all_closed(ledger, job_id: str, count: int) -> list | None:
    """The job's ledger intervals if they are `count` and all closed: the runner records a run's end in the jobs
    table, then closes its interval (the job may read as ended a moment before its bill does)."""
    runs = billed_runs(ledger, job_id)
    return runs if len(runs) == count and all(i.end is not None for i in runs) else None


async def closed_runs(ledger, job_id: str, count: int) -> list:
    """The job's `count` ledger intervals, once all are closed (`all_closed`)."""
    return await until(f"{count} runs billed to their ends", lambda: all_closed(ledger, job_id, count))


def billed_runs(ledger, job_id: str) -> list:
    """The job's ledger intervals, in order: one per run, none overlapping."""
    intervals = sorted((i for i in ledger.intervals_overlapping(periods.utcnow() - timedelta(days=1),
                                                                periods.utcnow() + timedelta(days=1))
                        if i.key.startswith(f"job:{job_id}@")), key=lambda i: i.start)
    for before, after in zip(intervals, intervals[1:]):
        assert before.end is not None and before.end <= after.start
    return intervals


@pytest.mark.asyncio
async def test_a_job_is_a_volcano_job_whose_failures_restart_it_until_its_restarts_are_used_up(
        cluster, kubeconfig, job_cluster, ledger):
    jobs = job_cluster
    job = submit(jobs, max_restarts=1)
    runner = runner_for(jobs)
    await runner.start()
    try:
        pod = await until("the first run's pod Running", lambda: running_pod(cluster, job.id, 0))
        stored_job = volcano_job_of(cluster, job.id)
        assert stored_job["spec"]["queue"] == "vision" and stored_job["spec"]["maxRetry"] == 1 + EVICTION_HEADROOM
        assert pod["spec"]["schedulerName"] == kc.VOLCANO_SCHEDULER and pod["spec"]["nodeName"].startswith("gpu-h200")
        # Billed from Running: the reservation made at admission became a running interval.
        (first,) = await until("run 1 billed", lambda: [i for i in billed_runs(ledger, job.id)
                                                        if i.state == State.RUNNING] or None)
        assert (first.user, first.team, first.model, first.share) == ("alice", "vision", "H200", Fraction(1, 4))
        # What the container prints, read through the API server from KWOK's kubelet server into the job's log.
        cluster.container_log(pod, "train", ["step 1 loss 0.9", "step 2 loss 0.8"])
        await until("run 1's output kept", lambda: "step 2 loss 0.8" in job_log_text(jobs, job.id))

        fail_through_kwok(cluster, pod, 3)
        pod2 = await until("Volcano's restart as run 2", lambda: running_pod(cluster, job.id, 1))
        cluster.container_log(pod2, "train", ["resumed from step 2"])
        now = await until("run 2 running", lambda: (j := jobs.store.get(job.id)).runs == 2 and j.state == "running"
                          and j)
        assert now.restarts == 1
        run1 = jobs.store.runs(job.id)[0]
        assert (run1.event, run1.exit_code, run1.counted) == ("failed", 3, True)

        await until("run 1's end noted", lambda: " ended (" in job_log_text(jobs, job.id))
        # A restart of the hub: a new runner follows run 2 where the last one stopped.
        await runner.stop()
        runner = runner_for(jobs)
        await runner.start()
        await until("run 2 billed", lambda: len([i for i in billed_runs(ledger, job.id)
                                                  if i.state == State.RUNNING]) == 2)
        assert jobs.store.get(job.id).runs == 2
        cluster.container_log(pod2, "train", ["step 3 loss 0.7"])
        await until("run 2's output kept", lambda: "step 3 loss 0.7" in job_log_text(jobs, job.id))

        fail_through_kwok(cluster, running_pod(cluster, job.id, 1), 3)
        ended = await until("the job failed", lambda: (j := jobs.store.get(job.id)).state == "failed" and j)
        assert ended.reason == "failed (exit code 3) after 1 restart" and ended.exit_code == 3
        # gpupool's count ended it; Volcano (maxRetry 101) would have gone on: its Job is deleted.
        await until("the Volcano Job deleted", lambda: volcano_job_of(cluster, job.id) is None)
        runs = billed_runs(ledger, job.id)
        assert len(runs) == 2 and all(i.end is not None and i.how == HowEnded.FAILED for i in runs)
        # Both runs' output, each byte once (the restarted hub read run 2's log again and kept only what was new),
        # with which pod and node each was and how it ended, after Volcano deleted both pods.
        await until("its pods gone", lambda: job_pod(cluster, job.id) is None)
        await until("the pods' logs all kept",
                    lambda: all(task.done() for _, task in runner.backend.pod_logs.tasks.values()))
        expected = (f"{pod_header(pod)}step 1 loss 0.9\nstep 2 loss 0.8\n{pod_footer(pod, 'failed, exit code 3')}"
                    f"{pod_header(pod2)}resumed from step 2\nstep 3 loss 0.7\n{pod_footer(pod2, 'failed, exit code 3')}")
        text = job_log_text(jobs, job.id)
        assert text.startswith(expected)
        # Volcano may have started its next restart before gpupool deleted the Job: a pod that printed nothing here
        assert re.fullmatch(r"(--- gpupool: pod \S+ on node \S+, started at \S+ ---\n"
                            r"--- gpupool: pod \S+ stopped \(node-lost\) ---\n)?", text[len(expected):])
        assert jobs.store.read_log(job.id, 20, 16) == job_log_text(jobs, job.id).encode()[20:36]
    finally:
        await runner.stop()


@pytest.mark.asyncio
async def test_a_preempted_job_resumes_without_a_retry_counted_succeeds_and_a_cancel_deletes_its_volcano_job(
        cluster, kubeconfig, job_cluster, ledger):
    jobs = job_cluster
    never = submit(jobs)
    jobs.store.cancel(never.id, periods.utcnow())  # cancelled while queued: never becomes a Volcano Job
    job = submit(jobs, max_restarts=0, preemptible=True)
    runner = runner_for(jobs)
    await runner.start()
    try:
        pod = await until("the first run's pod Running", lambda: running_pod(cluster, job.id, 0))
        assert volcano_job_of(cluster, job.id)["metadata"]["annotations"]["volcano.sh/preemptable"] == "true"
        # Volcano's preempt action evicts a victim by deleting its pod.
        cluster.kubectl("delete", "pod", "-n", NAMESPACE, pod["metadata"]["name"], "--wait=false")
        pod = await until("Volcano's restart as run 2", lambda: running_pod(cluster, job.id, 1))
        now = await until("run 2", lambda: (j := jobs.store.get(job.id)).runs == 2 and j.state == "running" and j)
        run1 = jobs.store.runs(job.id)[0]
        assert (run1.event, run1.counted) == ("preempted", False) and now.restarts == 0  # max_restarts 0 still

        # Its container ends a while before the hub sees it (as after the hub's downtime): the run ends when the
        # container did, not when the hub noticed.
        run2 = jobs.store.runs(job.id)[1]
        finished = max(run2.started_at, parse_time(pod["status"]["startTime"])) + timedelta(seconds=1)
        await until("2 s after that", lambda: periods.utcnow() >= finished + timedelta(seconds=2))
        succeed_as_a_kubelet_would(cluster, pod, finished)
        ended = await until("the job succeeded", lambda: (j := jobs.store.get(job.id)).state == "succeeded" and j)
        assert ended.exit_code == 0 and ended.restarts == 0
        billed = await closed_runs(ledger, job.id, 2)
        assert jobs.store.runs(job.id)[1].ended_at == finished == billed[1].end
        assert [i.how for i in billed] == [HowEnded.PREEMPTED, HowEnded.STOPPED]

        cancelled = submit(jobs, user="bob")
        await until("its pod Running", lambda: running_pod(cluster, cancelled.id, 0))
        jobs.store.cancel(cancelled.id, periods.utcnow())
        gone = await until("cancelled", lambda: (j := jobs.store.get(cancelled.id)).state == "cancelled" and j)
        assert gone.reason == "cancelled"
        assert volcano_job_of(cluster, cancelled.id) is None
        await until("its pod deleted", lambda: job_pod(cluster, cancelled.id) is None)
        assert volcano_job_of(cluster, never.id) is None and jobs.store.get(never.id).runs == 0
    finally:
        await runner.stop()


def succeed_as_a_kubelet_would(cluster, pod: dict, finished: datetime | None = None) -> None:
    """The container exits 0 (at `finished`, default now), as a kubelet reports it."""
    done = {"status": {"phase": "Succeeded", "containerStatuses": [
        {"name": "train", "ready": False, "restartCount": 0, "image": pod["spec"]["containers"][0]["image"],
         "imageID": "", "state": {"terminated": {
             "exitCode": 0, "reason": "Completed", "startedAt": pod["status"]["startTime"],
             "finishedAt": (finished or periods.utcnow()).strftime("%Y-%m-%dT%H:%M:%SZ")}}}]}}
    cluster.kubectl("patch", "pod", "-n", NAMESPACE, pod["metadata"]["name"], "--subresource", "status",
                    "--type", "merge", "-p", json.dumps(done))


@pytest.mark.asyncio
async def test_a_suspended_job_resumes_in_a_new_volcano_job_whose_pods_are_not_taken_for_the_last_ones(
        cluster, kubeconfig, job_cluster, ledger):
    jobs = job_cluster
    job = submit(jobs, max_restarts=2)
    runner = runner_for(jobs)
    await runner.start()
    try:
        fail_through_kwok(cluster, await until("run 1's pod", lambda: running_pod(cluster, job.id, 0)), 3)
        await until("Volcano's restart as run 2", lambda: running_pod(cluster, job.id, 1))
        await until("run 2", lambda: jobs.store.get(job.id).runs == 2)
        jobs.store.suspend(job.id, periods.utcnow())
        await until("suspended", lambda: jobs.store.get(job.id).state == "suspended")
        await until("its Volcano Job deleted", lambda: volcano_job_of(cluster, job.id) is None)
        jobs.store.resume(job.id, periods.utcnow())
        # A new Volcano Job of the same name, its pods counted from restart 0 again: the third submission.
        pod = await until("run 3's pod", lambda: running_pod(cluster, job.id, 0))
        assert pod["metadata"]["labels"]["gpupool.io/submission"] == "3"
        await until("run 3", lambda: (j := jobs.store.get(job.id)).runs == 3 and j.state == "running")
        succeed_as_a_kubelet_would(cluster, pod)
        ended = await until("succeeded", lambda: (j := jobs.store.get(job.id)).state == "succeeded" and j)
        assert ended.restarts == 1  # run 1's failure; the suspend is not a retry
        assert [(r.event, r.counted) for r in jobs.store.runs(job.id)] == [
            ("failed", True), ("suspended", False), ("succeeded", False)]
        assert [i.how for i in await closed_runs(ledger, job.id, 3)] == [
            HowEnded.FAILED, HowEnded.STOPPED, HowEnded.STOPPED]
        await until("the finished Volcano Job deleted", lambda: volcano_job_of(cluster, job.id) is None)
    finally:
        await runner.stop()


@pytest.mark.asyncio
async def test_a_pods_log_rotated_while_no_hub_read_it_is_read_on_from_where_it_was_kept(
        cluster, kubeconfig, job_cluster, ledger):
    """The kubelet rotated the container's log while the hub was down: the next hub sees the file is shorter than
    what it kept, says so in the job's log, and keeps the new file's lines from shortly before its last piece
    (not from the old byte count, which would skip them)."""
    jobs = job_cluster
    job = submit(jobs)
    runner = runner_for(jobs)
    await runner.start()
    try:
        pod = await until("its pod Running", lambda: running_pod(cluster, job.id, 0))
        cluster.container_log(pod, "train", ["step 1 loss 0.9", "step 2 loss 0.8", "step 3 loss 0.7"])
        await until("its output kept", lambda: "step 3 loss 0.7" in job_log_text(jobs, job.id))
        await runner.stop()
        cluster.container_log(pod, "train", ["step 4 loss 0.6"], rotate=True)
        runner = runner_for(jobs)
        await runner.start()
        await until("the rotated file's line kept", lambda: "step 4 loss 0.6" in job_log_text(jobs, job.id))
        assert re.fullmatch(
            re.escape(f"{pod_header(pod)}step 1 loss 0.9\nstep 2 loss 0.8\nstep 3 loss 0.7\n"
                      f"--- gpupool: the kubelet rotated the log of pod {pod['metadata']['name']}; what follows "
                      "starts at ") + r"\d\d:\d\d:\d\d" + re.escape(" UTC and may repeat a few lines ---\n"
                                                                "step 4 loss 0.6\n"),
            job_log_text(jobs, job.id))
        cluster.container_log(pod, "train", ["step 5 loss 0.5"])  # and followed on from there
        await until("the next line kept", lambda: job_log_text(jobs, job.id).endswith("step 4 loss 0.6\nstep 5 loss 0.5\n"))
        jobs.store.cancel(job.id, periods.utcnow())
        await until("cancelled", lambda: jobs.store.get(job.id).state == "cancelled")
    finally:
        await runner.stop()


@pytest.mark.asyncio
async def test_a_cancelled_job_whose_pod_hangs_in_terminating_ends_after_the_grace_period_and_a_wait(
        cluster, kubeconfig, job_cluster, ledger, monkeypatch):
    """A pod on a lost node stays Terminating until the node is back (here KWOK, its kubelet, leaves the pod
    alone): the cancelled run ends, and its billing with it, once the grace period and `DELETE_WAIT_S` have
    passed."""
    from gpupool.spawner.jobs import volcano as kubejobs

    jobs = job_cluster
    jobs.policy = jobs.policy.model_copy(update={"jobs": jobs.policy.jobs.model_copy(update={"grace_seconds": 1})})
    monkeypatch.setattr(kubejobs, "DELETE_WAIT_S", 2.0)
    job = submit(jobs)
    runner = runner_for(jobs)
    await runner.start()
    pod = None
    try:
        pod = await until("its pod Running", lambda: running_pod(cluster, job.id, 0))
        cluster.kubectl("label", "pod", "-n", NAMESPACE, pod["metadata"]["name"], f"{kc.KUBELET_LOST}=true")
        await until("billed", lambda: [i for i in billed_runs(ledger, job.id) if i.state == State.RUNNING])
        jobs.store.cancel(job.id, periods.utcnow())
        await until("its pod Terminating", lambda: cluster.get(
            f"/api/v1/namespaces/{NAMESPACE}/pods/{pod['metadata']['name']}")["metadata"].get("deletionTimestamp"))
        ended = await until("cancelled", lambda: (j := jobs.store.get(job.id)).state == "cancelled" and j)
        assert ended.reason == "cancelled"
        assert job_pod(cluster, job.id) is None and cluster.get(  # still there, Terminating
            f"/api/v1/namespaces/{NAMESPACE}/pods/{pod['metadata']['name']}")["metadata"]["deletionTimestamp"]
        (interval,) = await closed_runs(ledger, job.id, 1)
        assert interval.how == HowEnded.STOPPED
    finally:
        if pod is not None:  # the node is back: the pod goes, and its Volcano Job with it
            cluster.kubectl("label", "pod", "-n", NAMESPACE, pod["metadata"]["name"], f"{kc.KUBELET_LOST}-",
                            check=False)
        await until("the Volcano Job gone", lambda: volcano_job_of(cluster, job.id) is None)
        await runner.stop()


#: The jobs service in its Kubernetes mode, as the chart runs it (templates/jobs.yaml), and the users' storage as
#: z2jh's `singleuser.storage` and `uid`/`fsGid` configure KubeSpawner (a host path stands in for the home claim).
KUBE_JOBS = """
c.KubeSpawner.volumes = [{"name": "home-{username}", "hostPath": {"path": "/srv/homes/{username}"}}]
c.KubeSpawner.volume_mounts = [{"name": "home-{username}", "mountPath": "/home/jovyan"}]
c.KubeSpawner.uid = lambda spawner: 1000  # a callable, as KubeSpawner allows
c.KubeSpawner.fs_gid = 100
c.KubeSpawner.allow_privilege_escalation = False
for _service in c.JupyterHub.services:
    if _service["name"] == "jobs":
        _service["environment"]["GPUPOOL_JOBS_MODE"] = "kubernetes"
"""


def test_a_job_submitted_with_the_cli_runs_as_a_volcano_job_restarts_outlives_a_hub_restart_and_is_cancelled(
        cluster, tmp_path, monkeypatch):
    """The person's path: `gpupool jobs submit` from a folder, with the user's own token, through the hub's proxy
    to the jobs service; the real hub's job runner makes the Volcano Job (Volcano's job controller runs it)."""
    from harness import Hub, platform_command

    policies = volcano_policy_copy(tmp_path, queue_timeout=240)
    cluster.kubectl("apply", "--server-side", "-f", "-",
                    input=gpupool("render", "--policies", str(policies), "--namespace", NAMESPACE, cwd=tmp_path))
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    singleuser = str(Path(sys.executable).with_name("jupyterhub-singleuser"))
    hub = Hub(tmp_path / "hub", {p.name: p.read_text() for p in policies.glob("*.yaml")},
              KUBE_HUB.format(namespace=NAMESPACE, singleuser=singleuser) + KUBE_JOBS, mlflow=False)
    folder = tmp_path / "project"
    folder.mkdir()

    def cli(*args: str) -> str:
        env = {**os.environ, "JUPYTERHUB_API_TOKEN": token, "GPUPOOL_HUB_URL": hub.url + "/"}
        done = subprocess.run([str(platform_command(None)), "jobs", *args], cwd=folder, env=env, capture_output=True,
                              text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr + done.stdout
        return done.stdout

    def shown(job_id: str) -> dict:
        return json.loads(cli("show", job_id, "--json"))

    def wait(what: str, check, timeout: float = 120):
        deadline = time.monotonic() + timeout
        while not (value := check()):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{hub.log.read_text()[-3000:]}")
            time.sleep(0.5)
        return value

    hub.start()
    try:
        hub.add_user("alice", "vision")
        token = hub.user_token("alice")
        said = cli("submit", "--profile", "h200-quarter", "--max-restarts", "1", "--workdir",
                   "/home/jovyan/project", "--", "python", "train.py")
        job_id = said.split()[1]
        assert "no checkpoint folder" in said  # the example policy names no checkpoint claim
        pod = wait("the job's pod Running", lambda: running_pod(cluster, job_id, 0))
        cluster.container_log(pod, "train", ["epoch 1 of 3"])
        assert pod["metadata"]["labels"]["gpupool.io/user"] == "alice"
        assert {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}["GPUPOOL_JOB_ID"] == job_id
        # alice's storage as her servers get it: the job works in her home, as her user
        assert pod["spec"]["volumes"][0] == {"name": "home-alice", "hostPath": {"path": "/srv/homes/alice",
                                                                                "type": ""}}
        assert pod["spec"]["containers"][0]["volumeMounts"][0]["mountPath"] == "/home/jovyan"
        assert pod["spec"]["containers"][0]["workingDir"] == "/home/jovyan/project"
        assert pod["spec"]["securityContext"] == {"runAsUser": 1000, "fsGroup": 100}
        assert pod["spec"]["containers"][0]["securityContext"] == {"allowPrivilegeEscalation": False}
        wait("running", lambda: shown(job_id)["state"] == "running")
        assert job_id in cli("list") and "running" in cli("list")
        wait("the pod's output in `gpupool jobs logs`", lambda: "epoch 1 of 3\n" in cli("logs", job_id))

        fail_through_kwok(cluster, pod, 3)
        job = wait("run 2", lambda: len((j := shown(job_id))["runs"]) == 2 and j["state"] == "running" and j)
        assert job["restarts"] == 1
        assert [(r["event"], r["exit_code"], r["counted"]) for r in job["runs"]] == [("failed", 3, True),
                                                                                    (None, None, False)]

        # Run 2 is on record as soon as Volcano restarts the job; its pod comes when Volcano's controller makes it
        # (once 20 s later on a busy machine). The crash below is meant to happen while that pod runs.
        wait("run 2's pod Running", lambda: running_pod(cluster, job_id, 1))
        hub.kill()  # the hub crashes while the job runs, and comes back: the job goes on, its run the same
        hub.start()
        job = shown(job_id)
        assert (job["state"], len(job["runs"])) == ("running", 2) and running_pod(cluster, job_id, 1) is not None

        # `gpupool jobs logs --follow` prints run 1's output (its pod deleted by Volcano's restart), then run
        # 2's as it comes, and ends when the job has ended, with how its last pod ended.
        pod2 = running_pod(cluster, job_id, 1)
        follow = subprocess.Popen([str(platform_command(None)), "jobs", "logs", job_id, "--follow"], cwd=folder,
                                  env={**os.environ, "JUPYTERHUB_API_TOKEN": token,
                                       "GPUPOOL_HUB_URL": hub.url + "/"},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            cluster.container_log(pod2, "train", ["resumed: epoch 2 of 3"])
            wait("run 2's output", lambda: "resumed: epoch 2 of 3" in cli("logs", job_id))
            assert "epoch 1 of 3\n--- gpupool: pod " in shown(job_id)["log_tail"]  # the job's page and `show`

            cli("cancel", job_id)
            printed, errors = follow.communicate(timeout=120)
        finally:
            follow.kill()
        assert follow.returncode == 0, errors
        assert printed == cli("logs", job_id)
        assert printed.endswith(f"resumed: epoch 2 of 3\n--- gpupool: pod {pod2['metadata']['name']} "
                                "stopped (node-lost) ---\n")
        assert printed.count("epoch 1 of 3") == 1 and "ended (failed, exit code 3)" in printed
        job = wait("cancelled", lambda: (j := shown(job_id))["state"] == "cancelled" and j)
        wait("the Volcano Job deleted", lambda: volcano_job_of(cluster, job_id) is None)
        wait("its pod deleted", lambda: job_pod(cluster, job_id) is None)
        ledger = get_ledger(hub.ledger_url)
        runs = wait("both runs billed to their ends", lambda: all_closed(ledger, job_id, 2))
        assert [i.how for i in runs] == [HowEnded.FAILED, HowEnded.STOPPED]
    finally:
        hub.stop()
