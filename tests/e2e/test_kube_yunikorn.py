"""The YuniKorn mode (issue 37) against the real control plane (tests/kube_cluster.py) and the real Apache
YuniKorn 1.8 scheduler, built by `make kube-tools` from its release source and run out of cluster (NAMESPACE,
KUBECONFIG) against the suite's API server and KWOK's fake GPU nodes; no Volcano runs in this module.

What is checked for real here: the `yunikorn-configs` ConfigMap that `gpupool render` writes for a policy whose
`settings.engine` is `yunikorn` is applied server-side, loaded by YuniKorn as the policy says (its REST API
shows the queues, their `guaranteed` and `max`, no priority offset) and a second apply changes nothing; a pod
bound to its team's queue as the Kubernetes mode binds it (`schedulerName: yunikorn`, the
`yunikorn.apache.org/queue` and `yunikorn.apache.org/app-id` annotations, the profile's GPU resources, node selector and tolerations) reaches Running on a fake
GPU node of its model; YuniKorn's own validator (`/ws/v1/validate-conf`) allows the queues rendered for a few
policies (fractional cpu and memory, a three-level tree) and refuses what gpupool no longer writes; a queue at
its `max` holds the next pod with YuniKorn's own reason in its events, and a
raised `max`, rendered and applied again, lets it run (YuniKorn reads the ConfigMap live) and leaves the
child of a non-reclaimable team out of preemption; a pod naming a parent team's queue is rejected, one in a
queue path longer than a label value runs; the NetworkPolicy docs/kubernetes.md shows for YuniKorn's REST API
is accepted by the API server.

Not here yet (docs/kubernetes.md, "Choosing an engine"): `GPUKubeSpawner` still binds notebooks to Volcano's
queues, so no hub runs in this module; its Volcano counterparts are in tests/e2e/test_kube_cluster.py.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import requests
import yaml

from gpupool.policies import load_policy
from gpupool.policies.resources import profile_gpu
from gpupool.spawner import yunikorn
from gpupool.spawner.volcano import team_priority_class


def _load(name: str):
    # pytest's importlib mode puts no test folder on sys.path: load the support module by its path.
    path = Path(__file__).resolve().parents[1] / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"gpupool_yunikorn_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


kc = _load("kube_cluster")
NAMESPACE = "gpupool-users"

#: A policy for the YuniKorn mode: whole H200 cards and MIG slices (the backends YuniKorn can place), a parent
#: team with a child, vision held to one card by its queue's `max` (`queue.capability`).
CLUSTER = {
    "models": {"H200": {"vendor": "nvidia", "memory_gib": 141, "product": "NVIDIA-H200", "backends": ["mig", "whole"],
                        "mig": {"strategy": "single", "profiles": ["1g.18gb"]}}},
    "settings": {"engine": "yunikorn"},
}
LONG_PARENT, LONG_CHILD = "research-and-development-divisio", "computer-vision-and-imaging-grp1"
TEAMS = {"teams": {
    "research": {"priority": 100, "queue": {"capability": {"nvidia.com/gpu": 8},
                                            "deserved": {"nvidia.com/gpu": 4}}},
    "vision": {"priority": 100, "members": ["alice"], "queue": {
        "parent": "research", "capability": {"nvidia.com/gpu": 1}, "deserved": {"nvidia.com/gpu": 1}}},
    "nlp": {"priority": 50, "members": ["bob"], "queue": {"reclaimable": False}},
    # a non-reclaimable parent: its child must stay out of preemption after YuniKorn reloads its configuration
    "platform": {"queue": {"reclaimable": False}},
    "infra": {"queue": {"parent": "platform"}},
    # two team names of the longest kind: their queue path (70 characters) fits no label value
    LONG_PARENT: {},
    LONG_CHILD: {"queue": {"parent": LONG_PARENT}},
}}
PROFILES = {"profiles": {
    "h200": {"display_name": "1 × H200", "gpu": {"model": "H200", "count": 1}, "teams": ["vision", "nlp"],
             "cpu": {"guarantee": 1}, "memory": {"guarantee": "1Gi"}},
    "h200-mig": {"display_name": "MIG 1g.18gb", "gpu": {"model": "H200", "mig": "1g.18gb"}, "teams": ["nlp"]},
}}


def write_policy(folder: Path, teams: dict = TEAMS) -> Path:
    """The module's policy with `teams`; its profiles go to the teams that hold no other team (all, for teams
    other than the module's)."""
    folder.mkdir(parents=True, exist_ok=True)
    profiles = PROFILES
    if set(teams["teams"]) != set(TEAMS["teams"]):
        parents = {team["queue"].get("parent") for team in teams["teams"].values()}
        leaves = [name for name in teams["teams"] if name not in parents]
        profiles = {"profiles": {slug: {**profile, "teams": leaves} for slug, profile in PROFILES["profiles"].items()}}
    for name, content in (("cluster.yaml", CLUSTER), ("teams.yaml", teams), ("profiles.yaml", profiles)):
        (folder / name).write_text(yaml.safe_dump(content, sort_keys=False))
    return folder


def render(policies: Path) -> str:
    """`gpupool render` as an administrator runs it (the installed entry point), for YuniKorn's namespace."""
    done = subprocess.run([str(Path(sys.executable).with_name("gpupool")), "render", "--policies", str(policies),
                           "--namespace", NAMESPACE, "--yunikorn-namespace", kc.YUNIKORN_NAMESPACE],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def apply(cluster, manifest: str) -> None:
    cluster.kubectl("apply", "--server-side", "--field-manager", "gpupool", "-f", "-", input=manifest)


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory):
    """The control plane with KWOK's fake GPU nodes for the policy, the rendered objects applied, then YuniKorn
    (one scheduler for the module)."""
    kc.require(kc.missing_yunikorn())
    failures = request.session.testsfailed
    policies = write_policy(tmp_path_factory.mktemp("yunikorn") / "policies")
    with kc.running_cluster(keep=lambda: request.session.testsfailed > failures, engines=("yunikorn",)) as running:
        for node in kc.fake_nodes(load_policy(policies), per_model=1):
            running.add_node(node["name"], node["labels"], node["allocatable"], node["taints"], node["annotations"])
        for namespace in (NAMESPACE, "gpu-operator", kc.YUNIKORN_NAMESPACE):
            running.kubectl("create", "namespace", namespace)
        running.manifest = render(policies)
        apply(running, running.manifest)
        began = time.monotonic()
        running.start_yunikorn()
        running.yunikorn_started_in = time.monotonic() - began
        print(f"\ncontrol plane started in {running.started_in:.1f} s, YuniKorn in {running.yunikorn_started_in:.1f} s")
        running.policies = policies
        yield running


def queue_info(cluster, path: str) -> dict:
    reply = requests.get(f"{cluster.yunikorn_url}/ws/v1/partition/default/queue/{path}", timeout=10)
    reply.raise_for_status()
    return reply.json()


def wait(what: str, ready, timeout: float = 60):
    return kc._wait(what, ready, timeout)


def test_yunikorn_loads_the_rendered_queues_and_a_second_apply_changes_nothing(cluster):
    configs = cluster.get(f"/api/v1/namespaces/{kc.YUNIKORN_NAMESPACE}/configmaps/{yunikorn.CONFIGMAP}")
    rendered = next(o for o in yaml.safe_load_all(cluster.manifest) if o["metadata"]["name"] == yunikorn.CONFIGMAP)
    assert configs["data"] == rendered["data"]
    # YuniKorn took it as the policy says (its own view of the queues, from its REST API)
    vision = queue_info(cluster, "root.research.vision")
    assert vision["maxResource"] == {"nvidia.com/gpu": 1} and vision["guaranteedResource"] == {"nvidia.com/gpu": 1}
    # no priority offset: the team's PriorityClass alone ranks its pods (YuniKorn would add an offset to it)
    assert "priority.offset" not in (vision.get("properties") or {})
    assert cluster.get("/apis/scheduling.k8s.io/v1/priorityclasses/gpupool-vision")["value"] == 100
    assert queue_info(cluster, "root.research")["maxResource"] == {"nvidia.com/gpu": 8}
    assert queue_info(cluster, "root.nlp")["properties"]["preemption.policy"] == "disabled"

    versions = {(o["kind"], o["metadata"]["name"]): cluster.get(path(o))["metadata"]["resourceVersion"]
                for o in yaml.safe_load_all(cluster.manifest)}
    apply(cluster, render(cluster.policies))  # rendered again from the same policy
    assert {(o["kind"], o["metadata"]["name"]): cluster.get(path(o))["metadata"]["resourceVersion"]
            for o in yaml.safe_load_all(cluster.manifest)} == versions  # nothing was written


#: Policies whose rendered queues YuniKorn's own validator must allow: fractional cpu and memory (YuniKorn parses
#: integers only), a guarantee above deserved (guaranteed is the larger), a three-level tree, a non-reclaimable
#: parent.
VALIDATED = {
    "fractions": {"teams": {
        "students": {"queue": {"capability": {"cpu": "2.5", "memory": "1.5Gi", "nvidia.com/gpu": 4},
                               "deserved": {"cpu": "0.5", "memory": "500Mi", "nvidia.com/gpu": 1},
                               "guarantee": {"nvidia.com/gpu": 2, "cpu": "1.5"}}}}},
    "tree": {"teams": {
        "lab": {"queue": {"reclaimable": False, "capability": {"cpu": 64, "nvidia.com/gpu": 8},
                          "deserved": {"cpu": 16, "nvidia.com/gpu": 4}, "guarantee": {"memory": "64Gi"}}},
        "group": {"queue": {"parent": "lab", "deserved": {"cpu": "15.5", "nvidia.com/gpu": 3},
                            "guarantee": {"memory": "32Gi"}}},
        "project": {"members": ["carol"], "queue": {"parent": "group", "capability": {"nvidia.com/gpu": 2},
                                                    "deserved": {"cpu": "0.25", "nvidia.com/gpu": 2}}}}},
}


@pytest.mark.parametrize("name", ["module", *VALIDATED])
def test_yunikorns_validator_allows_the_rendered_queues(cluster, name, tmp_path):
    teams = TEAMS if name == "module" else VALIDATED[name]
    rendered = next(o for o in yaml.safe_load_all(render(write_policy(tmp_path / name, teams)))
                    if o["metadata"]["name"] == yunikorn.CONFIGMAP)
    reply = requests.post(f"{cluster.yunikorn_url}/ws/v1/validate-conf", data=rendered["data"]["queues.yaml"],
                          timeout=10)
    reply.raise_for_status()
    assert reply.json() == {"allowed": True}, (reply.json(), rendered["data"]["queues.yaml"])


def test_yunikorns_validator_refuses_what_the_policy_check_refuses(cluster):
    # the same endpoint says no to what gpupool no longer writes: a fractional cpu, a guaranteed above max
    for text, reason in (("1.5", "invalid quantity"), ("3", "larger than maximum resource")):
        queues = {"partitions": [{"name": "default", "queues": [{"name": "root", "queues": [
            {"name": "t", "resources": {"guaranteed": {"vcore": text}, "max": {"vcore": "2"}}}]}]}]}
        reply = requests.post(f"{cluster.yunikorn_url}/ws/v1/validate-conf", data=yaml.safe_dump(queues), timeout=10)
        assert reply.json()["allowed"] is False and reason in reply.json()["reason"], reply.json()


def test_the_documented_network_policy_for_yunikorns_rest_api_is_accepted_by_the_api_server(cluster):
    # docs/kubernetes.md tells an operator to keep YuniKorn's open REST API to its namespace with this object
    docs = (Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md").read_text()
    section = docs[docs.index("**YuniKorn's REST API is open.**"):]
    block = section[section.index("```yaml\n") + len("```yaml\n"):section.index("```\n", section.index("```yaml"))]
    policy = yaml.safe_load("\n".join(line[2:] for line in block.splitlines()))
    assert policy["kind"] == "NetworkPolicy" and policy["metadata"]["namespace"] == kc.YUNIKORN_NAMESPACE
    assert policy["spec"]["podSelector"]["matchLabels"]["component"] == "yunikorn-scheduler"
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {}}]}]  # this namespace's pods only
    cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(policy))


def test_yunikorn_listens_on_loopback_only(cluster):
    # core hard-codes ":9080" (every interface): the build's patch binds its REST server to 127.0.0.1 instead
    process = psutil.Process(cluster.processes[kc.YUNIKORN_BINARY].pid)
    listening = [c.laddr for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening and all(address.ip in ("127.0.0.1", "::1") for address in listening), listening
    assert int(cluster.yunikorn_url.rsplit(":", 1)[1]) in {address.port for address in listening}


@pytest.mark.parametrize("name, queue", [
    # the `provided` placement rule creates no queue: what gpupool renders is the whole tree
    ("nowhere-1", "root.nowhere"),
    # why `gpupool policy check` refuses members or profiles on a team with child teams under YuniKorn
    ("parent-1", "root.research"),
], ids=["a-queue-that-does-not-exist", "a-parent-teams-queue"])
def test_a_pod_naming_a_queue_it_cannot_run_in_is_rejected_not_left_pending(cluster, name, queue):
    team_pod(cluster, name, "vision", "h200", queue=queue)
    try:
        pod = wait(f"{name} Failed", lambda: (lambda p: p if p["status"].get("phase") == "Failed" else None)(
            pod_now(cluster, name)))
        assert pod["status"].get("reason") == "ApplicationRejected" and not pod["spec"].get("nodeName")
    finally:
        cluster.kubectl("delete", "pod", "--wait", "--ignore-not-found", "-n", NAMESPACE, name)


def test_a_pod_in_a_queue_whose_path_is_longer_than_a_label_value_runs(cluster):
    path = yunikorn.queue_path(load_policy(cluster.policies), LONG_CHILD)
    assert len(path) > 63  # a label value could not hold it
    team_pod(cluster, "long-1", LONG_CHILD, "h200")
    try:
        wait("long-1 Running", lambda: running(cluster, "long-1"))
        assert queue_info(cluster, path)["allocatedResource"]["nvidia.com/gpu"] == 1
    finally:
        cluster.kubectl("delete", "pod", "--wait", "--ignore-not-found", "-n", NAMESPACE, "long-1")


def path(obj: dict) -> str:
    plural = {"PriorityClass": "priorityclasses", "ConfigMap": "configmaps"}[obj["kind"]]
    prefix = "/apis/scheduling.k8s.io/v1" if obj["kind"] == "PriorityClass" else "/api/v1"
    namespace = obj["metadata"].get("namespace")
    return f"{prefix}{f'/namespaces/{namespace}' if namespace else ''}/{plural}/{obj['metadata']['name']}"


def team_pod(cluster, name: str, team: str, profile: str, queue: str | None = None) -> dict:
    """A pod as the Kubernetes mode binds one to its team's YuniKorn queue: `schedulerName: yunikorn`, the
    `yunikorn.apache.org/queue` annotation (the queue's full path, which may be longer than a label value) and
    `yunikorn.apache.org/app-id` (one application a pod), the team's
    PriorityClass and the profile's GPU resources, node selector and tolerations (`profile_gpu`); `queue`: another
    queue path instead."""
    policy = load_policy(cluster.policies)
    gpu = profile_gpu(policy.profiles[profile], policy)
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": NAMESPACE, "annotations": {
               yunikorn.QUEUE_ANNOTATION: queue or yunikorn.queue_path(policy, team),
               yunikorn.APPLICATION_ANNOTATION: name}},
           "spec": {"schedulerName": yunikorn.SCHEDULER_NAME, "priorityClassName": team_priority_class(team),
                    "nodeSelector": gpu.node_selector, "tolerations": gpu.tolerations,
                    "containers": [{"name": "notebook", "image": "gpupool/base:0.1.0", "resources": {
                        "requests": {"cpu": "1", "memory": "1Gi", **{k: str(v) for k, v in gpu.limits.items()}},
                        "limits": {k: str(v) for k, v in gpu.limits.items()}}}]}}
    cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(pod))
    return pod


def pod_now(cluster, name: str) -> dict:
    return cluster.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")


def running(cluster, name: str):
    pod = pod_now(cluster, name)
    return pod if pod["status"].get("phase") == "Running" else None


def events_of(cluster, name: str) -> list[str]:
    found = cluster.get(f"/api/v1/namespaces/{NAMESPACE}/events?fieldSelector=involvedObject.name%3D{name}")
    return [event.get("message", "") for event in found["items"]]


def test_a_pod_in_its_teams_queue_runs_and_one_past_the_queues_max_waits_with_yunikorns_reason(cluster, tmp_path):
    team_pod(cluster, "vision-1", "vision", "h200")
    try:
        pod = wait("vision-1 Running", lambda: running(cluster, "vision-1"))
        node = cluster.get(f"/api/v1/nodes/{pod['spec']['nodeName']}")
        assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-H200"
        assert pod["metadata"]["annotations"][yunikorn.QUEUE_ANNOTATION] == "root.research.vision"

        # vision's queue is at its max (one card): YuniKorn holds the next pod and says why, in its own words
        team_pod(cluster, "vision-2", "vision", "h200")
        reason = wait("YuniKorn's reason for vision-2", lambda: next(
            (m for m in events_of(cluster, "vision-2") if "does not fit in queue" in m), None))
        assert "'root.research.vision'" in reason
        held = pod_now(cluster, "vision-2")
        assert held["status"].get("phase") == "Pending" and not held["spec"].get("nodeName")

        # a raised max, rendered and applied again, lets it run: YuniKorn reads its ConfigMap live
        teams = json.loads(json.dumps(TEAMS))
        teams["teams"]["vision"]["queue"]["capability"] = {"nvidia.com/gpu": 2}
        teams["teams"]["vision"]["queue"]["deserved"] = {"nvidia.com/gpu": 2}
        apply(cluster, render(write_policy(tmp_path / "raised", teams)))
        wait("vision-2 Running once the max is raised", lambda: running(cluster, "vision-2"))
        # that reload replaced every queue's properties: the child of a non-reclaimable team still says disabled
        # (YuniKorn copies a parent's property only when it creates the child)
        assert queue_info(cluster, "root.platform.infra")["properties"]["preemption.policy"] == "disabled"
    finally:
        apply(cluster, render(cluster.policies))
        cluster.kubectl("delete", "pod", "--wait", "--ignore-not-found", "-n", NAMESPACE, "vision-1", "vision-2")
