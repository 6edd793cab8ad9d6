"""The Kubernetes objects gpupool owns, built from policies: Volcano Queues, PriorityClasses, the NVIDIA
device-plugin time-slicing config, the policy ConfigMap and the Zero-to-JupyterHub values. Pure functions.

`gpupool render` (hub/render.py) writes what these return; the Helm chart in helm/gpupool emits the same
objects unchanged, so the policy → cluster translation exists once, here, behind the strict policy loader.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpupool.policies.model import DNS_LABEL, Policy
from gpupool.spawner import kubeyaml
from gpupool.spawner.wiring import (ACCOUNTING_SERVICE, CULLER_SERVICE, JOBS_SERVICE, MLFLOW_SERVICE, mlflow_url,
                                    service_roles, team_groups)

QUEUE_API_VERSION = "scheduling.volcano.sh/v1beta1"
#: Volcano's root queue (vc-controller-manager makes it), the parent of every top-level team queue.
ROOT_QUEUE = "root"
PRIORITY_CLASS_API_VERSION = "scheduling.k8s.io/v1"

#: The PriorityClass of work admitted beyond an exhausted budget (`on_exhausted: deprioritize`).
DEPRIORITIZED_CLASS = "gpupool-deprioritized"
#: Below every team: team priorities are ≥ 0, and 0 is also what pods without a class get.
DEPRIORITIZED_PRIORITY = -1

SPAWNER_CLASS = "gpupool.spawner.kube.GPUKubeSpawner"
#: The hub container's command: `gpupool-hub` (JupyterHub with gpupool's pages, routes and job runner) on the
#: configuration file Zero-to-JupyterHub writes, instead of its plain `jupyterhub`.
HUB_ARGS = ["gpupool-hub", "--config", "/usr/local/etc/jupyterhub/jupyterhub_config.py"]
#: Where the hub and the accounting service find the policy files (the policy ConfigMap, mounted).
POLICY_DIR = "/etc/gpupool/policies"
POLICY_VOLUME = "gpupool-policies"
#: The port of the accounting service's Deployment (helm/gpupool/templates/accounting.yaml); its name and
#: roles are the embedded mode's (gpupool.spawner.wiring).
ACCOUNTING_PORT = 8080
#: The port of the idle culler's Deployment (helm/gpupool/templates/culler.yaml); its name and roles are the
#: embedded mode's too.
CULLER_PORT = 8080
#: The port of the jobs service's Deployment (helm/gpupool/templates/jobs.yaml): the training jobs' REST API and
#: page; the hub's job runner (`gpupool.spawner.jobs.volcano`) runs what it queues.
JOBS_PORT = 8080
#: The port of the MLflow Service (helm/gpupool values `mlflow.port`).
MLFLOW_PORT = 5000
#: Where user pods reach MLflow: through z2jh's proxy Service, behind the hub login.
MLFLOW_URL = mlflow_url("http://proxy-public/")

DEVICE_PLUGIN_CONFIG_LABEL = "nvidia.com/device-plugin.config"
DEFAULT_DEVICE_PLUGIN_NAMESPACE = "gpu-operator"
#: ConfigMap data keys and label values: a time-sliced model's name is both.
_CONFIG_KEY = re.compile(r"[-._a-zA-Z0-9]+")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
#: The API server refuses a ConfigMap whose data exceeds 1 MiB.
MAX_CONFIGMAP_BYTES = 1 << 20


@dataclass(frozen=True)
class Release:
    """Where the objects go: the Helm release (or name prefix) and the namespaces of namespaced objects."""

    name: str = "gpupool"
    namespace: str = "default"
    device_plugin_namespace: str = DEFAULT_DEVICE_PLUGIN_NAMESPACE

    def __post_init__(self) -> None:
        # Helm's own limit for release names; our object names append at most "-time-slicing".
        for what, value, limit in (("release", self.name, 53), ("namespace", self.namespace, 63),
                                   ("device plugin namespace", self.device_plugin_namespace, 63)):
            if not DNS_LABEL.fullmatch(value) or len(value) > limit:
                raise ValueError(
                    f"{what} {value!r} is not DNS-safe (accepted: lower-case letters, digits and '-', "
                    f"starting and ending with a letter or digit, at most {limit} characters)"
                )

    @property
    def policies_configmap(self) -> str:
        return f"{self.name}-policies"

    @property
    def dataset_secret_pattern(self) -> str:
        """The Secret of each team's S3 keys (helm/gpupool/templates/datasets-secrets.yaml), `{team}` left open."""
        return f"{self.name}-datasets-{{team}}"

    @property
    def mlflow_service(self) -> str:
        """The Kubernetes Service of the MLflow Deployment (helm/gpupool/templates/mlflow.yaml)."""
        return f"{self.name}-mlflow"

    @property
    def accounting_service(self) -> str:
        """The Kubernetes Service of the accounting Deployment (helm/gpupool/templates/accounting.yaml)."""
        return f"{self.name}-accounting"

    @property
    def jobs_service(self) -> str:
        """The Kubernetes Service of the jobs service's Deployment (helm/gpupool/templates/jobs.yaml)."""
        return f"{self.name}-jobs"

    @property
    def culler_service(self) -> str:
        """The Kubernetes Service of the idle culler's Deployment (helm/gpupool/templates/culler.yaml)."""
        return f"{self.name}-culler"

    @property
    def hub_env_configmap(self) -> str:
        """What the hub's environment takes from the chart (helm/gpupool/templates/hub-access.yaml)."""
        return f"{self.name}-hub-env"

    @property
    def time_slicing_configmap(self) -> str:
        return f"{self.name}-time-slicing"


#: The environment variable naming the usage ledger, in the hub and in the accounting service.
LEDGER_URL_ENV = "GPUPOOL_LEDGER_URL"
#: The Helm release the hub runs in (the chart sets it): the training jobs' Volcano Jobs carry its labels.
RELEASE_ENV = "GPUPOOL_RELEASE"


def team_queue(team: str) -> str:
    """The Volcano queue of `team`: the team's own name (DNS-safe and one-to-one by the policy checks)."""
    return team


def team_priority_class(team: str) -> str:
    """The PriorityClass of `team`'s work (value: the team's priority)."""
    return f"gpupool-{team}"


def job_priority_class(team: str, priority: str) -> str:
    """The PriorityClass of `team`'s training jobs at job priority `priority` (`normal`: the team's own class)."""
    return team_priority_class(team) if priority == "normal" else f"gpupool-{team}-{priority}-jobs"


def job_class_value(policy: Policy, team: str, priority: str) -> int:
    """Its value: the team's priority moved by the job priority's offset from `normal` (servers' priority), as the
    embedded queue orders them (`Policy.job_priority`); never below 0, under which only deprioritized work is."""
    offsets = policy.jobs.priorities
    return max(0, policy.teams[team].priority + offsets[priority] - offsets["normal"])


#: The label naming the release an object of gpupool's belongs to.
INSTANCE_LABEL = "app.kubernetes.io/instance"


def labels(release: Release, component: str, team: str | None = None) -> dict[str, str]:
    result = {
        "app.kubernetes.io/name": "gpupool",
        INSTANCE_LABEL: release.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "gpupool",
    }
    if team is not None:
        result["gpupool.io/team"] = team
    return result


# --- Volcano queues ------------------------------------------------------------------------------


def _depth(policy: Policy, team: str) -> int:
    depth, parent = 0, policy.teams[team].queue.parent
    while parent is not None:  # the policy checks refuse cycles and unknown parents
        depth, parent = depth + 1, policy.teams[parent].queue.parent
    return depth


def queue(policy: Policy, team: str, release: Release) -> dict[str, Any]:
    """The `scheduling.volcano.sh/v1beta1` Queue of `team`."""
    settings = policy.teams[team].queue
    spec: dict[str, Any] = {
        "weight": settings.weight,
        "priority": policy.teams[team].priority,
        "reclaimable": settings.reclaimable,
    }
    if settings.capability:
        spec["capability"] = dict(settings.capability)
    if settings.deserved:
        spec["deserved"] = dict(settings.deserved)
    if settings.guarantee:
        spec["guarantee"] = {"resource": dict(settings.guarantee)}
    # Top-level queues name `root` themselves: vc-controller-manager otherwise writes `parent: root` and owns
    # the field, and a later render giving the team a parent fails `kubectl apply --server-side` on a conflict.
    spec["parent"] = team_queue(settings.parent) if settings.parent is not None else ROOT_QUEUE
    return {
        "apiVersion": QUEUE_API_VERSION,
        "kind": "Queue",
        "metadata": {"name": team_queue(team), "labels": labels(release, "queue", team)},
        "spec": spec,
    }


def queues(policy: Policy, release: Release) -> list[dict[str, Any]]:
    """One Queue per team, parents before children: Volcano's webhook refuses a child whose parent is missing."""
    order = sorted(policy.teams, key=lambda team: (_depth(policy, team), team))
    return [queue(policy, team, release) for team in order]


# --- priority classes --------------------------------------------------------------------------------


def priority_classes(policy: Policy, release: Release) -> list[dict[str, Any]]:
    """One PriorityClass per team from its priority, one per other job priority the team may use (`low`, `high`:
    the team's priority moved by the `jobs.priorities` offsets), and the lowest class for deprioritized work."""
    result = []
    owners: dict[str, str] = {DEPRIORITIZED_CLASS: "gpupool's class for deprioritized work"}
    for team in sorted(policy.teams):
        name = team_priority_class(team)
        classes = [(name, policy.teams[team].priority,
                    f"gpupool team {team}: its notebooks and jobs (policy teams.{team}.priority)")]
        for priority in policy.teams[team].job_priorities:
            if priority != "normal":
                classes.append((job_priority_class(team, priority), job_class_value(policy, team, priority),
                                f"gpupool team {team}: its {priority}-priority training jobs (teams.{team}.priority "
                                f"and jobs.priorities.{priority})"))
        for name, value, description in classes:
            if name in owners:
                raise ValueError(f"team {team!r} would get the PriorityClass {name}, which is {owners[name]}: "
                                 "rename the team")
            owners[name] = f"team {team}'s"
            result.append({
                "apiVersion": PRIORITY_CLASS_API_VERSION,
                "kind": "PriorityClass",
                "metadata": {"name": name, "labels": labels(release, "priority-class", team)},
                "value": value,
                "globalDefault": False,
                "preemptionPolicy": "PreemptLowerPriority",
                "description": description,
            })
    result.append({
        "apiVersion": PRIORITY_CLASS_API_VERSION,
        "kind": "PriorityClass",
        "metadata": {"name": DEPRIORITIZED_CLASS, "labels": labels(release, "priority-class")},
        "value": DEPRIORITIZED_PRIORITY,
        "globalDefault": False,
        # Work running past its team's budget must never push anyone else out.
        "preemptionPolicy": "Never",
        "description": "gpupool: work admitted beyond an exhausted budget (on_exhausted: deprioritize); "
        "lowest priority, preempted first",
    })
    return result


# --- NVIDIA device plugin time-slicing ----------------------------------------------------------------


def time_slicing_config(policy: Policy, release: Release) -> dict[str, Any] | None:
    """The device plugin's per-node configs, one per time-sliced model, or None when no model is time-sliced.

    Nodes pick theirs with the label `nvidia.com/device-plugin.config=<model>`. `renameByDefault` advertises
    the replicas as `nvidia.com/gpu.shared`, the name `resources.gpu_resources` asks for, so time-sliced
    replicas are never handed out where a whole card was requested.
    """
    data = {}
    for name in sorted(policy.models):
        model = policy.models[name]
        if "timeslice" not in model.backends:
            continue
        assert model.timeslice is not None  # the policy model requires it for this backend
        if not _CONFIG_KEY.fullmatch(name) or not _LABEL_VALUE.fullmatch(name) or len(name) > 63:
            raise ValueError(
                f"model name {name!r} cannot key a device plugin config: it is a ConfigMap key and the value of "
                f"the node label {DEVICE_PLUGIN_CONFIG_LABEL} (accepted: letters, digits, '-', '_' and '.', "
                "starting and ending with a letter or digit, at most 63 characters)"
            )
        config = {
            "version": "v1",
            "sharing": {
                "timeSlicing": {
                    "renameByDefault": True,
                    "resources": [{"name": "nvidia.com/gpu", "replicas": model.timeslice.replicas}],
                }
            },
        }
        data[name] = kubeyaml.dump(config, sort_keys=False)
    if not data:
        return None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": release.time_slicing_configmap,
            "namespace": release.device_plugin_namespace,
            "labels": labels(release, "device-plugin-config"),
        },
        "data": data,
    }


# --- the policy files, for the hub and the accounting service ----------------------------------------------


def policy_configmap(files: Mapping[str, str], release: Release) -> dict[str, Any]:
    """The policy files (name → text) as the ConfigMap mounted at `POLICY_DIR` in the hub."""
    for name in files:
        if not _CONFIG_KEY.fullmatch(name):
            raise ValueError(
                f"policy file {name!r} cannot be a ConfigMap key (accepted: letters, digits, '-', '_' and '.'): "
                "rename it"
            )
    size = sum(len(name.encode()) + len(text.encode()) for name, text in files.items())
    if size > MAX_CONFIGMAP_BYTES:
        raise ValueError(
            f"the policy files hold {size} bytes; a ConfigMap holds at most {MAX_CONFIGMAP_BYTES}: "
            "move long comments or unused profiles out of the policy directory"
        )
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": release.policies_configmap,
            "namespace": release.namespace,
            "labels": labels(release, "policies"),
        },
        "data": {name: files[name] for name in sorted(files)},
    }


def policies_digest(files: Mapping[str, str]) -> str:
    """A digest of the policy files that the chart recomputes (helm/gpupool/templates/_helpers.tpl).

    It catches policy files edited in a values file without re-rendering the objects made from them; it
    is a consistency check, not a signature. Go templates range over map keys in byte order, which for
    UTF-8 text is Python's code point order.
    """
    text = "".join(f"{name}\n{files[name]}\n" for name in sorted(files))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


# --- everything, and the Zero-to-JupyterHub wiring -------------------------------------------------------


def cluster_objects(policy: Policy, files: Mapping[str, str], release: Release) -> list[dict[str, Any]]:
    """Every object gpupool owns, in the order to apply them: classes and queues before anything uses them."""
    objects = priority_classes(policy, release) + queues(policy, release)
    time_slicing = time_slicing_config(policy, release)
    if time_slicing is not None:
        objects.append(time_slicing)
    objects.append(policy_configmap(files, release))
    return objects


def _authenticator_teams(policy: Policy) -> list[str]:
    return [name for name, team in policy.teams.items() if team.group_source == "authenticator"]


def jupyterhub_values(policy: Policy, release: Release, culler: bool = True) -> dict[str, Any]:
    """Zero-to-JupyterHub chart values that run the hub with `GPUKubeSpawner` on these policies.

    Static YAML only (`hub.config` is z2jh's pass-through to traitlets): no templated Python in the hub.
    `culler`: whether the chart runs the idle culler (its `culler.enabled`), which these values then register
    as a hub service with its role; the chart refuses values that disagree with it.
    """
    config: dict[str, Any] = {"JupyterHub": {"spawner_class": SPAWNER_CLASS}}
    if _authenticator_teams(policy):
        # Teams whose members come from the login provider's groups claim; JupyterHub then refuses
        # load_groups, so policy member lists cannot be loaded as well (see `wiring_notes`).
        config["Authenticator"] = {"manage_groups": True}
    else:
        # As in the embedded mode (hub/config.py): teams are groups, created with their policy members.
        config["JupyterHub"]["load_groups"] = team_groups(policy)
    # A notebook holds no Kubernetes credentials: KubeSpawner would mount a token whenever a service
    # account is set, and z2jh has no singleuser key for this trait.
    config["KubeSpawner"] = {"automount_service_account_token": False}
    config["GPUKubeSpawner"] = {"mlflow_url": MLFLOW_URL}
    if policy.datasets.storage == "s3":
        # The chart's per-team Secrets (templates/datasets-secrets.yaml) hold the S3 keys of the team remotes.
        config["GPUKubeSpawner"]["dataset_secret_name"] = release.dataset_secret_pattern
    # The services the chart runs beside the hub, each reached through its Kubernetes Service.
    services = {
        ACCOUNTING_SERVICE: {"url": f"http://{release.accounting_service}:{ACCOUNTING_PORT}"},
        MLFLOW_SERVICE: {"url": f"http://{release.mlflow_service}:{MLFLOW_PORT}"},
        JOBS_SERVICE: {"url": f"http://{release.jobs_service}:{JOBS_PORT}"},
    }
    if culler:
        services[CULLER_SERVICE] = {"url": f"http://{release.culler_service}:{CULLER_PORT}"}
    for service in services.values():
        service.update(oauth_no_confirm=True, display=True)
    # Named servers (`/user/NAME/SERVER`, each its own pod and profile), as in the embedded mode: z2jh takes one
    # static limit for everyone, the largest of the teams'; the spawner refuses a named server beyond the limit of
    # its user's own teams (`GPUPoolSpawnerMixin.check_named_server`). JupyterHub reads a limit of 0 as "none".
    most_named = max((team.named_servers for team in policy.teams.values()), default=0)
    return {
        "hub": {
            # gpupool's hub, as in the embedded mode: its templates (the progress page's Stop of that page's
            # server), the spawn page that makes no server, the availability route and the training jobs' runner.
            "args": list(HUB_ARGS),
            "config": config,
            "allowNamedServers": most_named > 0,
            "namedServerLimitPerUser": most_named,
            # The ledger GPUKubeSpawner admits against and records usage in; the chart makes the ConfigMap
            # from its postgresql values (the password, PGPASSWORD, is the operator's: see the chart's check).
            "extraEnv": {
                "GPUPOOL_POLICIES": POLICY_DIR,
                # The training jobs' Volcano Jobs carry the release's labels (`gpupool.spawner.jobs.volcano`).
                RELEASE_ENV: release.name,
                LEDGER_URL_ENV: {"valueFrom": {"configMapKeyRef": {"name": release.hub_env_configmap,
                                                                    "key": LEDGER_URL_ENV}}},
            },
            "extraVolumes": [{"name": POLICY_VOLUME, "configMap": {"name": release.policies_configmap}}],
            "extraVolumeMounts": [{"name": POLICY_VOLUME, "mountPath": POLICY_DIR, "readOnly": True}],
            "services": services,
            # The same roles as the embedded mode's (hub/config.py): the service gets exactly the scopes it
            # declares, and every user may open its pages, where the service decides what each one sees.
            "loadRoles": service_roles(culler=culler),
        },
        # Volcano places user pods; z2jh's user scheduler, its placeholders and its own PriorityClasses
        # would compete with the team queues and priorities.
        "scheduling": {
            "userScheduler": {"enabled": False},
            "userPlaceholder": {"enabled": False},
            "podPriority": {"enabled": False},
        },
    }


def wiring_notes(policy: Policy) -> list[str]:
    """What the rendered objects cannot do for these policies, in words for the operator."""
    notes = []
    from_authenticator = _authenticator_teams(policy)
    listed = [name for name, team in policy.teams.items() if team.group_source == "policy" and team.members]
    sharing = [name for name, team in policy.teams.items() if team.sharing]
    if sharing:
        notes.append(
            f"teams {', '.join(sharing)} allow sharing servers (teams.TEAM.sharing), which only the embedded "
            "platform's hub keeps within a team: in the Kubernetes mode nobody is given JupyterHub's shares scope"
        )
    if from_authenticator and listed:
        notes.append(
            f"teams {', '.join(from_authenticator)} take their members from the authenticator "
            f"(Authenticator.manage_groups), so JupyterHub cannot also load the member lists of "
            f"{', '.join(listed)}: give those users the groups in the login provider instead"
        )
    return notes


def engine_notes(policy: Policy) -> list[str]:
    """What Volcano's scheduler, as the chart configures it (helm/gpupool/files/volcano-scheduler.conf), will not
    do for these policies, in words for the operator."""
    parents = {team.queue.parent for team in policy.teams.values()}
    leaves = [name for name in policy.teams if name not in parents]
    without = [name for name in leaves if not policy.teams[name].queue.deserved]
    if len(leaves) < 2 or not without:
        return []
    return [
        f"teams {', '.join(without)} have no queue.deserved: under Volcano's capacity plugin their servers "
        "never reclaim other teams' deprioritized or preemptible work, and all of their own is reclaimable; "
        "give each a deserved that covers its quota (docs/kubernetes.md, \"Volcano's scheduler configuration\")"
    ]


def helm_values(policy: Policy, files: Mapping[str, str], release: Release, culler: bool = True) -> dict[str, Any]:
    """The values file for helm/gpupool: the rendered objects, the policy files and the z2jh wiring.

    `culler`: whether the chart is to run the idle culler (the chart's `culler.enabled` must agree)."""
    objects = cluster_objects(policy, files, release)
    # The chart builds the policy ConfigMap itself from `policies`, in the release's namespace.
    rendered = [o for o in objects if o["metadata"]["name"] != release.policies_configmap or o["kind"] != "ConfigMap"]
    return {
        "gpupool": {
            "release": release.name,
            "accountingService": ACCOUNTING_SERVICE,
            "accountingPort": ACCOUNTING_PORT,
            "cullerService": CULLER_SERVICE,
            "cullerPort": CULLER_PORT,
            "jobsService": JOBS_SERVICE,
            "jobsPort": JOBS_PORT,
            "policyDir": POLICY_DIR,
            "policiesDigest": policies_digest(files),
            "policies": {name: files[name] for name in sorted(files)},
            "objects": rendered,
        },
        "jupyterhub": jupyterhub_values(policy, release, culler=culler),
    }
