"""The Kubernetes objects gpupool owns when Apache YuniKorn is the engine (`settings.engine: yunikorn`, issue 37):
YuniKorn's queue configuration, the `yunikorn-configs` ConfigMap, in place of Volcano's Queues; the
PriorityClasses, the time-slicing config and the policy ConfigMap are the Volcano mode's (`gpupool.spawner.
volcano`). Pure functions.

One policy, two engines: each team is a queue `root.<team>` (a team with a `queue.parent` sits under its
parent's queue), with the same meaning as its Volcano Queue (docs/kubernetes.md has the field-by-field table):
- `queue.capability` → `resources.max`;
- `queue.deserved` and `queue.guarantee`, per resource the larger of the two (as Volcano's capacity plugin reads
  a queue's deserved) → `resources.guaranteed`: YuniKorn's preemption is driven by the guarantees (a pod in a
  queue under its `guaranteed` evicts from a queue over its own), as Volcano's reclaim is by `deserved`;
- quantities in YuniKorn's integer units (it parses digits only): cpu as `vcore` in millicores (`1500m`), memory
  in bytes, every other resource as a whole count; what cannot be written so is refused by
  `gpupool.policies.engines.yunikorn_problems`, as is a tree YuniKorn's validator refuses;
- `priority` → nothing in the queues: the team's PriorityClass (`gpupool-<team>`, which its pods name) alone
  ranks its pods. YuniKorn adds every queue's `priority.offset` on a pod's path to the pod's own priority
  (core queue.go), so an offset of the team's priority would count it twice;
- `queue.reclaimable: false` → the property `preemption.policy: disabled` (its pods are never victims), written
  on the team's queue and on every queue below it: YuniKorn copies a parent's property to a child only when it
  creates the child, and replaces a queue's properties on each reload (core queue.go, ApplyConf), so a child
  left without it would become a victim after the next change of the ConfigMap;
- `jobs.preemption.enabled` → the partition's `preemption.enabled`.
YuniKorn's service settings (`service.schedulingInterval`, …) are not queue configuration: they belong in the
`yunikorn-defaults` ConfigMap, which the operator's YuniKorn install owns, and gpupool does not write it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpupool.policies import engines
from gpupool.policies.model import Policy
from gpupool.spawner import kubeyaml, volcano

#: The scheduler name YuniKorn serves (pods name it in `schedulerName`).
SCHEDULER_NAME = "yunikorn"
#: What YuniKorn reads from its namespace: the queue configuration (gpupool's) and the service defaults.
CONFIGMAP = "yunikorn-configs"
DEFAULTS_CONFIGMAP = "yunikorn-defaults"
#: The key of `CONFIGMAP` that holds the queue configuration.
QUEUES_KEY = "queues.yaml"
#: The namespace YuniKorn runs in by default (its Helm chart's).
DEFAULT_NAMESPACE = "yunikorn"
PARTITION = "default"
ROOT_QUEUE = "root"
#: The pod annotations YuniKorn takes the queue and the application from (k8shim 1.8's current keys,
#: `constants.AnnotationQueueName` and `constants.AnnotationApplicationID`; the `queue` and `applicationId` labels
#: are its legacy ones). An annotation, not a label: a label value is at most 63 characters, and a queue path
#: `root.<team>.<team>` of two 32-character team names is 70.
QUEUE_ANNOTATION = "yunikorn.apache.org/queue"
APPLICATION_ANNOTATION = "yunikorn.apache.org/app-id"


def queue_path(policy: Policy, team: str) -> str:
    """The full name of `team`'s queue: `root.<team>`, or `root.<parent>.<team>` under a parent team."""
    parts = [volcano.team_queue(team)]
    parent = policy.teams[team].queue.parent
    while parent is not None:  # the policy checks refuse cycles and unknown parents
        parts.append(volcano.team_queue(parent))
        parent = policy.teams[parent].queue.parent
    return ".".join([ROOT_QUEUE, *reversed(parts)])


def _resources(resources: Mapping[str, int]) -> dict[str, str]:
    """YuniKorn's text for integer amounts: vcore with the millicore suffix, the rest as plain digits."""
    return {name: f"{value}m" if name == "vcore" else str(value) for name, value in sorted(resources.items())}


def _queue(policy: Policy, team: str, under_unreclaimable: bool = False) -> dict[str, Any]:
    settings = policy.teams[team].queue
    unreclaimable = under_unreclaimable or not settings.reclaimable
    config: dict[str, Any] = {"name": volcano.team_queue(team)}
    resources = {}
    if guaranteed := _resources(engines.yunikorn_guaranteed(policy, team)):
        resources["guaranteed"] = guaranteed
    if most := _resources(engines.yunikorn_resources(settings.capability)):
        resources["max"] = most
    if resources:
        config["resources"] = resources
    properties = {}
    if unreclaimable:
        properties["preemption.policy"] = "disabled"
    if properties:
        config["properties"] = properties
    children = sorted(name for name, other in policy.teams.items() if other.queue.parent == team)
    if children:
        config["parent"] = True
        config["queues"] = [_queue(policy, child, unreclaimable) for child in children]
    return config


def queues_config(policy: Policy) -> dict[str, Any]:
    """YuniKorn's queue configuration (`queues.yaml`) for `policy`: one partition, `root` open to every
    submitter (gpupool admits before a pod exists) and a queue per team; a pod names its queue (the `provided`
    placement rule creates none: a pod naming no queue of these is rejected). ValueError naming the team's
    field for what YuniKorn's validator would refuse (`engines.yunikorn_problems`)."""
    if problems := engines.yunikorn_problems(policy):
        raise ValueError("; ".join(f"{'.'.join(path)}: {message}" for path, message in problems))
    tops = sorted(name for name, team in policy.teams.items() if team.queue.parent is None)
    return {"partitions": [{
        "name": PARTITION,
        "placementrules": [{"name": "provided", "create": False}],
        "preemption": {"enabled": policy.jobs.preemption.enabled},
        "queues": [{"name": ROOT_QUEUE, "submitacl": "*", "parent": True,
                    "queues": [_queue(policy, team) for team in tops]}],
    }]}


def queues_yaml(policy: Policy) -> str:
    """`queues_config` as the text of the ConfigMap key: the same bytes for the same policy."""
    return kubeyaml.dump(queues_config(policy))


def configs_configmap(policy: Policy, release: volcano.Release, namespace: str = DEFAULT_NAMESPACE) -> dict[str, Any]:
    """The `yunikorn-configs` ConfigMap in YuniKorn's `namespace`, which YuniKorn reads live."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": CONFIGMAP, "namespace": namespace, "labels": volcano.labels(release, "queues")},
        "data": {QUEUES_KEY: queues_yaml(policy)},
    }


def cluster_objects(policy: Policy, files: Mapping[str, str], release: volcano.Release,
                    namespace: str = DEFAULT_NAMESPACE) -> list[dict[str, Any]]:
    """Every object gpupool owns under YuniKorn, in the order to apply them: the Volcano mode's, with the
    `yunikorn-configs` ConfigMap in place of the Volcano Queues."""
    objects = volcano.cluster_objects(policy, files, release)
    classes = [obj for obj in objects if obj["kind"] == "PriorityClass"]
    rest = [obj for obj in objects if obj["kind"] not in ("PriorityClass", "Queue")]
    return classes + [configs_configmap(policy, release, namespace)] + rest


def helm_values(policy: Policy, files: Mapping[str, str], release: volcano.Release, culler: bool = True,
                namespace: str = DEFAULT_NAMESPACE) -> dict[str, Any]:
    """The values file for helm/gpupool under YuniKorn: the Volcano mode's, whose rendered objects are these."""
    values = volcano.helm_values(policy, files, release, culler=culler)
    values["gpupool"]["objects"] = [
        obj for obj in cluster_objects(policy, files, release, namespace)
        if obj["kind"] != "ConfigMap" or obj["metadata"]["name"] != release.policies_configmap]
    return values


def engine_notes(policy: Policy) -> list[str]:
    """What YuniKorn does not do for these policies, in words for the operator."""
    weighted = sorted(name for name, team in policy.teams.items() if team.queue.weight != 1)
    if not weighted:
        return []
    return [f"teams {', '.join(weighted)} set queue.weight, which YuniKorn has no field for: spare capacity goes "
            "by the queues' guaranteed resources instead (docs/kubernetes.md, \"Choosing an engine\")"]
