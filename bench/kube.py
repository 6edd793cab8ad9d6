"""The Kubernetes mode on the real control plane (tests/kube_cluster.py: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, KWOK's fake GPU nodes and the real Volcano v1.14.4 with the chart's
scheduler configuration; built by `make kube-tools`).

1. Seconds from a spawn's start to a Running pod, for notebook spawns of 0.25 × H200 as a Volcano vGPU share:
   GPUKubeSpawner (admission through the ledger's door, the pod's PodGroup in its team's queue, bound by
   Volcano's scheduler and its vGPU device plugin) against KubeSpawner with the same pod and no scheduler name
   (the default kube-scheduler, counting the same resources), interleaved, in one run. Ratio gpupool / plain.
2. Pods bound per second by Volcano's scheduler for a burst of fractional pods (Volcano vGPU quarters) on fake
   nodes registered as Volcano's vGPU device plugin registers them (re-reported every 30 s, as the plugin does).
3. The same burst under Apache YuniKorn (issue 37), on a cluster of its own with the `yunikorn-configs` that
   `gpupool render` writes for a policy of `settings.engine: yunikorn`: whole H200 cards (YuniKorn places no
   fractional share but time-slicing replicas), each pod in its team's queue as the Kubernetes mode binds it,
   against the default kube-scheduler with the same pods on the same nodes, one after the other. Ratio
   YuniKorn / default scheduler (pods per second).

    .venv/bin/python bench/kube.py [--spawns 10] [--burst 200] [--nodes 100] [--no-yunikorn]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from testhelpers import load

kc = load("kube_cluster")
kube = load("test_kube_spawner")  # JupyterHub's real user objects around a spawner
NAMESPACE = "bench"
#: A 0.25 × H200 Volcano vGPU share, as GPUKubeSpawner asks it (gpupool.policies.resources).
H200_MIB = 141 * 1024
QUARTER = {"volcano.sh/vgpu-number": "1", "volcano.sh/vgpu-memory": str(H200_MIB // 4),
           "volcano.sh/vgpu-cores": "25"}


async def time_start(spawner) -> float:
    began = time.perf_counter()
    await asyncio.wait_for(spawner.start(), 300)
    elapsed = time.perf_counter() - began
    spawner._spawn_pending = spawner._start_pending = False
    await asyncio.wait_for(spawner.stop(), 300)
    return elapsed


async def spawns(cluster, policies: Path, count: int) -> dict[str, list[float]]:
    from kubespawner import KubeSpawner
    from kubernetes_asyncio.config import kube_config

    kube_config.KUBE_CONFIG_DEFAULT_LOCATION = str(cluster.kubeconfig)
    config = kube.spawner_config(policies, cluster.url, start_timeout=120)
    config.GPUKubeSpawner.namespace = config.KubeSpawner.namespace = NAMESPACE
    config.GPUKubeSpawner.queue_poll_interval = 0.2
    config.KubeSpawner.cmd = ["jupyterhub-singleuser"]
    gpupool = kube.HubDB(config)
    plain = kube.HubDB(config)
    plain.settings["spawner_class"] = KubeSpawner
    times: dict[str, list[float]] = {"GPUKubeSpawner": [], "KubeSpawner": []}

    async def one_pair(i: int, record: bool) -> None:
        spawner = gpupool.spawner(f"g{i}", ("vision",))
        await spawner._run_apply_user_options({"profile": "h200-quarter"})
        plain_spawner = plain.spawner(f"p{i}")
        # The same pod as gpupool's, scheduled by the default scheduler (no schedulerName).
        plain_spawner.extra_resource_limits = plain_spawner.extra_resource_guarantees = dict(QUARTER)
        plain_spawner.tolerations = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        plain_spawner.node_selector = {"nvidia.com/gpu.product": "NVIDIA-H200"}
        first, second = (spawner, plain_spawner) if i % 2 else (plain_spawner, spawner)
        for s in (first, second):
            elapsed = await time_start(s)
            if record:
                times["GPUKubeSpawner" if s is spawner else "KubeSpawner"].append(elapsed)

    await one_pair(0, record=False)  # warm-up: reflectors, imports, the ledger's tables
    for i in range(1, count + 1):
        await one_pair(i, record=True)
    await KubeSpawner._stop_all_reflectors()
    return times


def burst(cluster, pods: int) -> tuple[float, int]:
    """Create `pods` Volcano vGPU quarter pods at once; seconds until every one is bound to a node, and how many were."""
    def pod(i: int) -> dict:
        gpu = dict(QUARTER)
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"burst-{i}", "labels": {"bench": "burst"}},
                "spec": {"schedulerName": kc.VOLCANO_SCHEDULER, "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
                         "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                         "containers": [{"name": "notebook", "image": "quay.io/jupyterhub/singleuser:5.3",
                                         "resources": {"limits": gpu, "requests": gpu}}]}}

    return bound_within(cluster, pod, pods, "bench=burst")


def bound_within(cluster, make_pod, pods: int, selector: str) -> tuple[float, int]:
    """Create `pods` pods (`make_pod(i)`) at once in NAMESPACE; seconds until every one is bound, how many were."""
    session = cluster.api()
    url = f"{cluster.url}/api/v1/namespaces/{NAMESPACE}/pods"
    began = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for reply in pool.map(lambda i: session.post(url, json=make_pod(i), timeout=30), range(pods)):
            assert reply.status_code == 201, reply.text
    while True:
        items = session.get(url, params={"labelSelector": selector}, timeout=30).json()["items"]
        bound = sum(1 for item in items if item["spec"].get("nodeName"))
        if bound == pods or time.perf_counter() - began > 600:
            return time.perf_counter() - began, bound
        time.sleep(0.1)


#: A policy of the YuniKorn mode: whole H200 cards, one team without a cap.
YUNIKORN_POLICY = {
    "cluster.yaml": {"models": {"H200": {"vendor": "nvidia", "memory_gib": 141, "product": "NVIDIA-H200",
                                         "backends": ["whole"]}},
                     "settings": {"engine": "yunikorn"}},
    "teams.yaml": {"teams": {"bench": {"members": ["bench"]}}},
    "profiles.yaml": {"profiles": {"h200": {"display_name": "1 × H200", "gpu": {"model": "H200", "count": 1},
                                            "teams": ["bench"]}}},
}


def yunikorn_bursts(folder: Path, pods: int, nodes: int) -> dict[str, tuple[float, int]]:
    """The burst of whole-card pods under the default kube-scheduler, then under YuniKorn, on one cluster."""
    import yaml

    from gpupool.policies import load_policy
    from gpupool.policies.resources import profile_gpu
    from gpupool.spawner import yunikorn

    policies = folder / "yunikorn-policies"
    policies.mkdir()
    for name, content in YUNIKORN_POLICY.items():
        (policies / name).write_text(yaml.safe_dump(content, sort_keys=False))
    policy = load_policy(policies)
    gpu = profile_gpu(policy.profiles["h200"], policy)
    results = {}
    with kc.running_cluster(engines=("yunikorn",)) as cluster:
        for node in kc.fake_nodes(policy, per_model=nodes):
            cluster.add_node(node["name"], node["labels"], node["allocatable"], node["taints"], node["annotations"])
        for namespace in (NAMESPACE, "gpu-operator", kc.YUNIKORN_NAMESPACE):
            cluster.kubectl("create", "namespace", namespace)
        render = Path(sys.executable).with_name("gpupool")
        manifest = subprocess.run([str(render), "render", "--policies", str(policies), "--namespace", NAMESPACE,
                                   "--yunikorn-namespace", kc.YUNIKORN_NAMESPACE],
                                  capture_output=True, text=True, check=True).stdout
        cluster.kubectl("apply", "--server-side", "-f", "-", input=manifest)
        cluster.start_yunikorn()
        for scheduler in ("default-scheduler", yunikorn.SCHEDULER_NAME):
            def pod(i: int, scheduler=scheduler) -> dict:
                name = f"{scheduler[:7]}-{i}"
                annotations = ({yunikorn.QUEUE_ANNOTATION: yunikorn.queue_path(policy, "bench"),
                                yunikorn.APPLICATION_ANNOTATION: name} if scheduler == yunikorn.SCHEDULER_NAME else {})
                return {"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": name, "labels": {"bench": scheduler}, "annotations": annotations},
                        "spec": {"schedulerName": scheduler, "nodeSelector": gpu.node_selector,
                                 "tolerations": gpu.tolerations,
                                 "containers": [{"name": "notebook", "image": "quay.io/jupyterhub/singleuser:5.3",
                                                 "resources": {"limits": {k: str(v) for k, v in gpu.limits.items()},
                                                               "requests": {k: str(v) for k, v in gpu.limits.items()}}}]}}

            results[scheduler] = bound_within(cluster, pod, pods, f"bench={scheduler}")
            cluster.kubectl("delete", "pods", "-n", NAMESPACE, "-l", f"bench={scheduler}", "--wait")
    return results


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spawns", type=int, default=10)
    parser.add_argument("--burst", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--no-yunikorn", action="store_true", help="leave out the YuniKorn burst")
    args = parser.parse_args()
    problem = kc.missing_tools()
    if problem:
        sys.exit(problem)
    from gpupool.policies import defaults, load_policy

    with tempfile.TemporaryDirectory() as tmp, kc.running_cluster() as cluster:
        os.environ["GPUPOOL_LEDGER_URL"] = defaults.ledger_url(tmp)
        cluster.vgpu_report_period = 30.0  # as Volcano's vGPU device plugin: the burst's 100 nodes, not 2 s each
        policies = kc.under_volcano(kube.policy_copy(Path(tmp), queue_timeout=300))
        (h200,) = [n for n in kc.fake_nodes(load_policy(policies)) if n["name"] == "gpu-h200-volcano-vgpu-0"]
        for node in kc.fake_nodes(load_policy(policies)):
            cluster.add_node(node["name"], node["labels"], node["allocatable"], node["taints"], node["annotations"])
        for namespace in (NAMESPACE, "gpu-operator"):  # the second: where the time-slicing ConfigMap goes
            cluster.kubectl("create", "namespace", namespace)
        render = Path(sys.executable).with_name("gpupool")
        manifest = subprocess.run([str(render), "render", "--policies", str(policies), "--namespace", NAMESPACE],
                                  capture_output=True, text=True, check=True).stdout
        cluster.kubectl("apply", "--server-side", "-f", "-", input=manifest)
        times = asyncio.run(spawns(cluster, policies, args.spawns))

        for i in range(args.nodes - 2):  # the burst's nodes: as many H200 nodes of Volcano's vGPU plugin in all
            annotations, resources = kc.device_registration("volcano-vgpu", f"burst-h200-{i}", 8, H200_MIB,
                                                            "NVIDIA-H200")
            cluster.add_node(f"burst-h200-{i}", h200["labels"], {**kc.NODE_BASICS, **resources}, h200["taints"],
                             annotations)
        seconds, bound = burst(cluster, args.burst)
    # YuniKorn's cluster once Volcano's is gone: one control plane at a time on the machine
    yunikorn_problem = "--no-yunikorn" if args.no_yunikorn else kc.missing_yunikorn()
    bursts = {}
    if not yunikorn_problem:
        with tempfile.TemporaryDirectory() as tmp:
            bursts = yunikorn_bursts(Path(tmp), args.burst, args.nodes)

    print(f"{'start → Running (0.25 × H200)':<34}{'spawns':>8}{'median s':>11}{'p95 s':>9}")
    for name, values in times.items():
        print(f"{name:<34}{len(values):>8}{statistics.median(values):>11.3f}{p95(values):>9.3f}")
    ratio = statistics.median(times["GPUKubeSpawner"]) / statistics.median(times["KubeSpawner"])
    print(f"ratio GPUKubeSpawner / KubeSpawner: median {ratio:.3f}, "
          f"p95 {p95(times['GPUKubeSpawner']) / p95(times['KubeSpawner']):.3f}")
    print(f"burst: {bound} of {args.burst} fractional pods bound on {args.nodes} nodes in {seconds:.2f} s: "
          f"{bound / seconds:.1f} pods/s (Volcano's scheduler)")
    if not bursts:
        print(f"no YuniKorn burst: {yunikorn_problem}")
        return
    print(f"{'burst of whole-card pods':<34}{'bound':>8}{'seconds':>11}{'pods/s':>9}")
    for name, (took, count) in bursts.items():
        print(f"{name:<34}{f'{count}/{args.burst}':>8}{took:>11.2f}{count / took:>9.1f}")
    (d_s, d_n), (y_s, y_n) = bursts["default-scheduler"], bursts["yunikorn"]
    print(f"ratio YuniKorn / default scheduler (pods/s): {(y_n / y_s) / (d_n / d_s):.3f}")


if __name__ == "__main__":
    main()
