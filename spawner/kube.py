"""`GPUKubeSpawner`: KubeSpawner with a GPU share from the policy, bound to the team's Volcano queue.

Each server is a pod scheduled by Volcano in its team's queue, with the team's PriorityClass; the share
becomes HAMi / NVIDIA device plugin resources (`resources.profile_gpu`). While Volcano holds the pod back the
spawn page says where it stands in the queue and why (`podgroups`), and `start_timeout` counts only from the
moment the queue admits it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import json
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from gpupool.hub.accounting import notify
from gpupool.hub.accounting.ledger import HowEnded
from gpupool.policies import periods
from gpupool.policies.admission import LOWEST_PRIORITY, AdmissionRequest, Decision, Reason, decide
from gpupool.policies.choice import Choice
from gpupool.policies.model import Policy, parse_quantity
from gpupool.policies.resources import GPUResources, profile_gpu, profile_share
from gpupool.spawner import podgroups
from gpupool.spawner.datasets import KUBE_POST_START, KUBE_TEAM_ROOT, kube_env
from gpupool.spawner.metrics import count_decision
from gpupool.spawner.mixin import Availability, GPUPoolSpawnerMixin, ProfileAvailability, refusal
from gpupool.spawner.volcano import (
    DEPRIORITIZED_CLASS,
    Release,
    priority_classes,
    team_priority_class,
    team_queue,
)
from kubernetes_asyncio.client import ApiException, V1Pod
from jupyterhub.utils import maybe_future
from kubespawner import KubeSpawner
from kubespawner.reflector import ResourceReflector
from kubespawner.slugs import is_valid_label, safe_slug
from kubespawner.spawner import EventReflector
from tornado import web
from traitlets import Bool, Enum, Float, Unicode, default

QUEUE_ANNOTATION = "scheduling.volcano.sh/queue-name"
PREEMPTABLE_ANNOTATION = "volcano.sh/preemptable"
SCHEDULER_NAME = "volcano"

TEAM_LABEL = "gpupool.io/team"
PROFILE_LABEL = "gpupool.io/profile"
MODEL_LABEL = "gpupool.io/gpu-model"
SHARE_ANNOTATION = "gpupool.io/share"

#: Environment variables no user pod may carry: HAMi-core turns its limits off when it sees this one.
FORBIDDEN_ENV = frozenset({"CUDA_DISABLE_CONTROL"})
#: HAMi keeps its device bookkeeping in these annotations; a pod that sets them can claim devices it was
#: not given, so only the ones gpupool itself wrote survive.
HAMI_ANNOTATION_PREFIX = "hami.io/"

#: Traits `apply_choice` sets; their configured values are the baseline every new choice starts from.
CHOICE_TRAITS = (
    "extra_resource_limits", "extra_resource_guarantees", "node_selector", "tolerations", "cpu_limit",
    "cpu_guarantee", "mem_limit", "mem_guarantee", "image", "extra_labels", "extra_annotations",
    "scheduler_name", "priority_class_name", "start_timeout", "lifecycle_hooks",
)


# --- the Volcano binding and the final pass over the pod (pure) -------------------------------------------


#: What this module relies on of KubeSpawner (and of JupyterHub's Spawner) beyond their configuration traits: the
#: class, the member, and its parameters where it is called or overridden. `tests/unit/spawner/test_kube_spawner.py` checks each against the installed releases, so a release
#: that renames, removes or re-signs one fails there, by name, instead of at a user's first spawn.
UPSTREAM_INTERNALS: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    ("kubespawner.KubeSpawner", "_start", ("self",)),  # overridden: admission runs before the pod
    ("kubespawner.KubeSpawner", "_make_create_pod_request", ("self", "pod", "request_timeout")),  # sanitizes
    ("kubespawner.KubeSpawner", "_get_reflector_key", ("self", "kind")),  # PodGroup reflectors beside its own
    ("kubespawner.KubeSpawner", "_expand_all", ("self", "src")),  # the hub mounts a user's storage in their jobs
    ("kubespawner.KubeSpawner", "reflectors", None),  # the class-level reflector registry
    ("kubespawner.KubeSpawner", "pod_reflector", None),
    ("kubespawner.KubeSpawner", "event_reflector", None),
    ("kubespawner.KubeSpawner", "load_user_options", ("self",)),  # overridden: the mixin's checked choice
    ("kubespawner.reflector.ResourceReflector", "kind", None),
    ("kubespawner.reflector.ResourceReflector", "api_group_name", None),
    ("kubespawner.reflector.ResourceReflector", "list_method_name", None),
    ("kubespawner.reflector.ResourceReflector", "first_load_future", None),
    ("kubespawner.reflector.ResourceReflector", "resources", None),
    ("kubespawner.reflector.ResourceReflector", "start", ("self",)),
    ("kubespawner.spawner.EventReflector", "events", None),
    ("jupyterhub.spawner.Spawner", "_spawn_pending", None),
    ("jupyterhub.spawner.Spawner", "_stop_pending", None),
    ("jupyterhub.spawner.Spawner", "_log_name", None),
    ("kubespawner.KubeSpawner", "_start_future", None),  # the running `_start`, which progress() outlives
    ("kubespawner.KubeSpawner", "_render_options_form_dynamically", ("self", "current_spawner")),
    ("kubespawner.KubeSpawner", "_sorted_dict_values", ("self", "src")),  # its tolerations, merged with ours
)


@dataclass(frozen=True)
class VolcanoBinding:
    """What ties a pod to its team's queue: scheduler, PriorityClass and Volcano's annotations."""

    scheduler_name: str
    priority_class_name: str
    annotations: dict[str, str] = field(default_factory=dict)


def volcano_binding(team: str, preemptible: bool, deprioritized: bool) -> VolcanoBinding:
    """A notebook inside its team's quota is not preemptable; preemptible profiles and deprioritized work are."""
    return VolcanoBinding(
        scheduler_name=SCHEDULER_NAME,
        priority_class_name=DEPRIORITIZED_CLASS if deprioritized else team_priority_class(team),
        annotations={
            QUEUE_ANNOTATION: team_queue(team),
            PREEMPTABLE_ANNOTATION: "true" if preemptible or deprioritized else "false",
        },
    )


@dataclass(frozen=True)
class ChoicePod:
    """What a checked choice puts on any pod of gpupool's, a notebook's or a training job's, before the
    configured baseline is merged in: the share's resources and placement, the labels and annotations."""

    #: The share's extended resources as quantities, for the limits and, equal to them, the requests.
    resources: dict[str, str]
    node_selector: dict[str, str]
    tolerations: list[dict[str, str]]
    labels: dict[str, str]
    annotations: dict[str, str]


def choice_pod(choice: Choice, policy: Policy, gpu: GPUResources | None, binding: VolcanoBinding) -> ChoicePod:
    """The pod side of `choice` whose share is `gpu` (`resources.profile_gpu`), bound by `binding`."""
    profile = choice.profile
    labels = {TEAM_LABEL: choice.team, PROFILE_LABEL: choice.slug}
    if profile.gpu is not None:
        labels[MODEL_LABEL] = safe_slug(profile.gpu.model, is_valid=is_valid_label)
    return ChoicePod(
        resources={name: str(value) for name, value in (gpu.limits if gpu else {}).items()},
        node_selector=dict(gpu.node_selector) if gpu else {},
        tolerations=[dict(toleration) for toleration in gpu.tolerations] if gpu else [],
        labels=labels,
        annotations={**(gpu.annotations if gpu else {}), **binding.annotations,
                     SHARE_ANNOTATION: str(profile_share(profile, policy))},
    )


def policy_priorities(policy: Policy) -> dict[str, int]:
    """The values of the PriorityClasses rendered from `policy`, to order a queue's PodGroups as Volcano does.

    Read from the objects `gpupool render` and the chart create, not from the cluster: the hub needs no
    cluster-wide read permission for it, and the two cannot disagree while the chart follows the policy.
    """
    return {pc["metadata"]["name"]: pc["value"] for pc in priority_classes(policy, Release())}


def _env_name(item: Any) -> str | None:
    return item.get("name") if isinstance(item, Mapping) else getattr(item, "name", None)


def sanitize_pod(pod: V1Pod, binding: VolcanoBinding, own_annotations: Mapping[str, str]) -> V1Pod:
    """The last word on a user pod, whatever config, hooks or overrides did before: edits `pod` in place.

    Removes `CUDA_DISABLE_CONTROL` from every container and `hami.io/*` annotations gpupool did not write
    (`own_annotations`), and re-applies the Volcano binding so no setting moves a pod into another queue.
    """
    metadata = pod.metadata
    annotations = dict(metadata.annotations or {})
    for key in list(annotations):
        if key.startswith(HAMI_ANNOTATION_PREFIX) and own_annotations.get(key) != annotations[key]:
            del annotations[key]
    annotations.update(binding.annotations)
    metadata.annotations = annotations
    spec = pod.spec
    spec.scheduler_name = binding.scheduler_name
    spec.priority_class_name = binding.priority_class_name
    for container in [*(spec.containers or []), *(spec.init_containers or [])]:
        if container.env:
            container.env = [item for item in container.env if _env_name(item) not in FORBIDDEN_ENV]
    return pod


def gpupool_profile_list(spawner: GPUKubeSpawner) -> list[dict]:
    """The policy's profiles for the user's teams in KubeSpawner's `profile_list` format, for its form.

    Entries carry no `kubespawner_override`: what a choice does to the pod is decided by `apply_choice`
    from the policy, never by a dictionary a form could name.
    """
    entries = []
    for slug, profile in spawner.available_profiles().items():
        entry: dict[str, Any] = {
            "slug": slug, "display_name": profile.display_name, "description": profile.description,
            "default": profile.default,
        }
        if profile.images:
            entry["profile_options"] = {"image": {"display_name": "Image", "choices": {
                key: {"display_name": image.display_name, "default": image.default}
                for key, image in profile.images.items()
            }}}
        entries.append(entry)
    return entries


# --- reflectors of Volcano's PodGroups and their events ---------------------------------------------------


def first_load(reflector: ResourceReflector) -> Awaitable[None]:
    """Wait for a shared reflector's first list without owning it: a spawn whose wait is cancelled (its pod
    started first, or it was stopped) must not cancel the future every later spawn of the hub waits on."""
    return asyncio.shield(reflector.first_load_future)


class _PodGroupAPI:
    """`list_podgroups(namespace=..., **kw)`: the list-or-watch call the reflector machinery expects."""

    def __init__(self, custom_objects):
        self.custom_objects = custom_objects

    def list_podgroups(self, namespace: str | None = None, **kwargs):
        """List or watch Volcano PodGroups (scheduling.volcano.sh/v1beta1)."""
        if namespace is None:
            return self.custom_objects.list_cluster_custom_object(
                podgroups.GROUP, podgroups.VERSION, podgroups.PLURAL, **kwargs)
        return self.custom_objects.list_namespaced_custom_object(
            podgroups.GROUP, podgroups.VERSION, namespace, podgroups.PLURAL, **kwargs)


class PodGroupReflector(ResourceReflector):
    """A local, watched copy of Volcano's PodGroups (per namespace, or cluster-wide with user namespaces)."""

    kind = "podgroups"
    api_group_name = Unicode("CustomObjectsApi")
    list_method_name = Unicode("list_podgroups")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.api = _PodGroupAPI(self.api)


class PodGroupEventReflector(EventReflector):
    """Events about PodGroups: Volcano's enqueue decisions ("queue resource quota insufficient") land here."""


# --- the spawner ---------------------------------------------------------------------------------------------


#: True inside `GPUKubeSpawner._make_create_pod_request` (in the spawn's own task only): a `stop()` it makes is
#: KubeSpawner replacing a left-over pod, while the user's Stop comes from another task and is a stop.
_CREATING_POD: contextvars.ContextVar[bool] = contextvars.ContextVar("gpupool_creating_pod", default=False)


class GPUKubeSpawner(GPUPoolSpawnerMixin, KubeSpawner):
    """Spawns each server as a pod holding a GPU share, queued by Volcano in its team's queue."""

    profile_form = Enum(
        ["gpupool", "kubespawner"], "gpupool",
        help="""
        Which spawn form users see: `gpupool` (the same form as the embedded mode: shares, teams, images) or
        `kubespawner` (KubeSpawner's profile cards, filled from the policy through `profile_list`). Either
        way the choice is checked on the server against the policy.

            c.GPUKubeSpawner.profile_form = "kubespawner"
        """,
    ).tag(config=True)

    queue_poll_interval = Float(
        1.0,
        help="""
        Seconds between looks at the queue while a server waits (position, reason, timeouts).

            c.GPUKubeSpawner.queue_poll_interval = 2
        """,
    ).tag(config=True)

    check_node_capacity = Bool(
        True,
        help="""
        Before creating a pod, list the nodes and refuse at once a profile that no node could ever hold
        (e.g. 2 × H200 when no node has more than one). Needs `list` on `nodes` (a ClusterRole); without it
        the check is skipped and the pod waits in the queue like any other.

            c.GPUKubeSpawner.check_node_capacity = False
        """,
    ).tag(config=True)

    #: Set by the accounting's admission before the pod is made when the team's budget is exhausted and its
    #: `on_exhausted` is `deprioritize`: the pod then runs as lowest-priority, preemptable work.
    gpupool_deprioritized: bool = False
    _gpupool_baseline: dict[str, Any] | None = None
    _gpupool_admitted_at = None  # when Volcano's queue admitted the pod (UTC): its queue wait ends there
    _gpupool_status: str | None = None
    _gpupool_waiting: Reason | None = None  # the code of the wait `_gpupool_status` tells of
    _gpupool_stopping = False
    #: Set when KubeSpawner deleted a pod of this server's name left over from before (its create's 409 path):
    #: the queue watch then waits for the new pod instead of taking the old one's going for a deletion.
    _gpupool_replaced_leftover = False

    @default("automount_service_account_token")
    def _default_automount_service_account_token(self):
        # A notebook has no business with the Kubernetes API: no token in user pods unless configured.
        return False

    @default("profile_list")
    def _default_profile_list(self):
        return gpupool_profile_list

    @default("options_form")
    def _default_options_form(self):
        if self.profile_form == "kubespawner":
            return self._render_options_form_dynamically
        return GPUPoolSpawnerMixin._form_with_availability  # each profile's line: start, wait or refuse, and why

    @default("options_from_form")
    def _default_options_from_form(self):
        return self._kube_options_from_form

    def _kube_options_from_form(self, formdata):
        options = GPUPoolSpawnerMixin._profile_options_from_form(formdata)
        # KubeSpawner's form names the image choice `profile-option-<profile>--image`.
        slug = options.get("profile")
        image = formdata.get(f"profile-option-{slug}--image") if slug else None
        if image and "image" not in options:
            options["image"] = image[0]
        return options

    async def load_user_options(self):
        """The mixin's checks replace KubeSpawner's profile_list validation and overrides.

        KubeSpawner would merge `kubespawner_override` dictionaries into the spawner; here the checked choice
        alone sets the traits, so nothing from `user_options` reaches the pod but profile, team and image.
        """
        if self.profile_list is not gpupool_profile_list:
            self.log.warning("profile_list is configured, but GPUKubeSpawner's profiles come from the policy in %s: "
                             "its entries only fill the kubespawner form, their kubespawner_override is ignored",
                             self.policy_dir)
        self.ensure_choice()

    # --- traits from the checked choice ---------------------------------------------------------------

    def _baseline(self) -> dict[str, Any]:
        if self._gpupool_baseline is None:
            self._gpupool_baseline = {name: copy.deepcopy(getattr(self, name)) for name in CHOICE_TRAITS}
        return copy.deepcopy(self._gpupool_baseline)

    def gpu_resources(self, choice: Choice) -> GPUResources | None:
        return profile_gpu(choice.profile, self.policy)

    def binding(self, choice: Choice) -> VolcanoBinding:
        return volcano_binding(choice.team, choice.profile.preemptible, self.gpupool_deprioritized)

    def apply_choice(self, choice: Choice) -> None:
        # Every choice starts from the configured values, so a second spawn with another profile keeps
        # nothing of the first; the baseline is a deep copy and the traits get new objects.
        base = self._baseline()
        profile = choice.profile
        binding = self.binding(choice)
        pod = choice_pod(choice, self.policy, self.gpu_resources(choice), binding)
        self.extra_resource_limits = {**base["extra_resource_limits"], **pod.resources}
        # Extended resources cannot be overcommitted: Kubernetes wants requests equal to limits.
        self.extra_resource_guarantees = {**base["extra_resource_guarantees"], **pod.resources}
        self.node_selector = {**base["node_selector"], **pod.node_selector}
        tolerations = list(self._sorted_dict_values(base["tolerations"]) or [])
        for toleration in pod.tolerations:
            if toleration not in tolerations:
                tolerations.append(toleration)
        self.tolerations = tolerations
        self.cpu_limit = float(parse_quantity(profile.cpu.limit)) if profile.cpu.limit else base["cpu_limit"]
        self.cpu_guarantee = (float(parse_quantity(profile.cpu.guarantee)) if profile.cpu.guarantee
                              else base["cpu_guarantee"])
        self.mem_limit = int(parse_quantity(profile.memory.limit)) if profile.memory.limit else base["mem_limit"]
        self.mem_guarantee = (int(parse_quantity(profile.memory.guarantee)) if profile.memory.guarantee
                              else base["mem_guarantee"])
        self.image = profile.images[choice.image].image if choice.image else base["image"]

        self.scheduler_name = binding.scheduler_name
        self.priority_class_name = binding.priority_class_name
        self.extra_labels = {**base["extra_labels"], **pod.labels}
        self.extra_annotations = {**base["extra_annotations"], **pod.annotations}
        # The hub waits `start_timeout` for start() as a whole, queue included; the queue's own limit comes
        # from policy and `_watch_queue` enforces both, counting start_timeout from admission only. The
        # margin covers the pod creation KubeSpawner may retry before the queue even sees the pod.
        # Every pod can queue in Volcano (CPU-only ones too, for the queue's cpu and memory capability).
        self.start_timeout = (self.queued_start_timeout(base["start_timeout"], choice, can_queue=True)
                              + self.k8s_api_request_retry_timeout)
        # DVC's user-level config (the team remote) is written in the pod from GPUPOOL_DVC_CONFIG.
        self.lifecycle_hooks = {"postStart": {"exec": {"command": KUBE_POST_START}}, **base["lifecycle_hooks"]}

    def get_env(self):
        env = super().get_env()
        if self.gpupool_choice is not None:  # (the GPUPOOL_* of the choice are the mixin's)
            env.update(kube_env(self.server_datasets(KUBE_TEAM_ROOT, kubernetes=True)))
        for name in FORBIDDEN_ENV:
            env.pop(name, None)
        return env

    def sanitize(self, pod: V1Pod) -> V1Pod:
        choice = self.gpupool_choice
        gpu = self.gpu_resources(choice)
        return sanitize_pod(pod, self.binding(choice), gpu.annotations if gpu else {})

    async def get_pod_manifest(self):
        await self.load_user_options()
        return self.sanitize(await super().get_pod_manifest())

    async def _make_create_pod_request(self, pod, request_timeout):
        # `modify_pod_hook` runs between get_pod_manifest() and here: sanitize once more before it is sent.
        # On a 409 (a pod of this name is left over: a hub that lost track of it) KubeSpawner deletes that pod
        # with `stop(now=True)` and creates again; inside this call, that stop is not the user's (`stop`).
        replacing = _CREATING_POD.set(True)
        try:
            return await super()._make_create_pod_request(self.sanitize(pod), request_timeout)
        finally:
            _CREATING_POD.reset(replacing)

    # --- the queue ---------------------------------------------------------------------------------------

    def wanted(self, choice: Choice) -> podgroups.Wanted:
        profile = choice.profile
        gpu = self.gpu_resources(choice)
        request = profile.gpu
        return podgroups.Wanted(
            display_name=profile.display_name, queue=team_queue(choice.team),
            model=request.model if request else None,
            amount=podgroups.amount_text(profile_share(profile, self.policy), request.mig if request else None,
                                         request.count if request else None),
            gpu_resources=frozenset(gpu.limits) if gpu else frozenset(),
        )

    def pod_requests(self) -> dict[str, Any]:
        """What the notebook container requests of a node (a limit stands in where no guarantee is set)."""
        requests: dict[str, Any] = {}
        cpu = self.cpu_guarantee or self.cpu_limit
        memory = self.mem_guarantee or self.mem_limit
        if cpu:
            requests["cpu"] = cpu
        if memory:
            requests["memory"] = memory
        requests.update(self.extra_resource_guarantees or self.extra_resource_limits)
        return requests

    async def capacity_problem(self, choice: Choice) -> str | None:
        """Why no node could ever hold this pod, from the nodes' allocatable resources; None if one could."""
        if not self.check_node_capacity:
            return None
        try:
            response = await asyncio.wait_for(self.api.list_node(_preload_content=False),
                                              self.k8s_api_request_timeout)
            if not response.ok:
                raise ApiException(status=response.status, reason=response.reason)
            nodes = json.loads(await response.read())["items"]
        except (TimeoutError, ApiException, KeyError, ValueError) as error:
            self.log.info("Not checking node capacity for %s (nodes cannot be listed: %s)", self._log_name,
                          getattr(error, "status", None) or type(error).__name__)
            return None
        return podgroups.never_fits(self.pod_requests(), self.node_selector, nodes, choice.profile.display_name)

    async def _gpupool_reflector(self, kind: str, reflector_class, **kwargs):
        """A shared reflector kept with KubeSpawner's; None (and a log line) when it cannot list."""
        key = self._get_reflector_key(kind)
        reflector = self.__class__.reflectors.get(key)
        if reflector is None:
            reflector = reflector_class(parent=self, namespace=self.namespace,
                                        omit_namespace=self.enable_user_namespaces, **kwargs)
            self.__class__.reflectors[key] = reflector
            try:
                await reflector.start()
            except asyncio.CancelledError:
                # This spawn's wait ended during the first list: the reflector is not left half-started for the
                # next spawns, which would wait on its first load for ever.
                self.__class__.reflectors.pop(key, None)
                if not reflector.first_load_future.done():
                    cancelled = RuntimeError(f"the {kind} reflector's start was cancelled")
                    reflector.first_load_future.set_exception(cancelled)
                    reflector.first_load_future.exception()  # seen: whoever waits on it gets it
                raise
            # Anything: Volcano's CRD missing or no RBAC (KubeSpawner's reflector then fails in its own error
            # logging, not with an ApiException). Queue details are a comfort, the spawn goes on without them.
            except Exception as error:  # noqa: BLE001
                self.__class__.reflectors.pop(key, None)
                if reflector.first_load_future.done():
                    reflector.first_load_future.exception()  # seen: nobody else waits for this one now
                self.log.warning("Cannot watch %s (%s): the spawn page will not show queue positions", kind, error)
                return None
        try:
            await first_load(reflector)
        except Exception:  # noqa: BLE001 - started by another spawn and failed there (logged there)
            return None
        return reflector

    async def _watch_queue(self, choice: Choice) -> None:
        """Follow the pod through Volcano's queue until admitted and running; raises when a limit is hit.

        Returns never: the spawn's other half (KubeSpawner's `_start`) finishes first when all goes well.
        """
        loop = asyncio.get_running_loop()
        began = loop.time()
        start_timeout = self._baseline()["start_timeout"]
        queue_timeout = self.policy.queue_timeout(choice.team)
        wanted = self.wanted(choice)
        priorities = policy_priorities(self.policy)
        # KubeSpawner's half starts the pod reflector; starting it here too could race it into two.
        while self.pod_reflector is None:
            await asyncio.sleep(self.queue_poll_interval)
        pods = self.pod_reflector
        await first_load(pods)
        groups = await self._gpupool_reflector("podgroups", PodGroupReflector)
        group_events = await self._gpupool_reflector(
            "podgroup-events", PodGroupEventReflector, fields={"involvedObject.kind": "PodGroup"})
        ref_key = f"{self.namespace}/{self.pod_name}"
        seen = None  # the uid of the pod of this name the wait has seen
        admitted_at = None
        reason = "waiting for Volcano to take it into the queue"
        while True:
            if self._gpupool_stopping:
                raise self._refuse(f'{wanted.display_name}: stopped while waiting in queue "{wanted.queue}"',
                                  Reason.CANCELLED)
            pod = pods.resources.get(ref_key)
            uid = ((pod or {}).get("metadata") or {}).get("uid")
            if seen is not None and uid != seen and self._gpupool_replaced_leftover:
                # The pod seen was one left over from before, which KubeSpawner replaced: what was seen of it
                # (its queue admission) is not this spawn's; ours comes next.
                seen = admitted_at = self._gpupool_admitted_at = None
                self._gpupool_replaced_leftover = False
            elif pod is None and seen is not None:
                raise self._refuse(f"{wanted.display_name}: the pod was deleted while it waited in queue "
                                  f'"{wanted.queue}"', Reason.CANCELLED)
            seen = seen or uid
            name = podgroups.podgroup_name(uid) if uid else None
            all_groups = list(groups.resources.values()) if groups else []
            group = next((g for g in all_groups if (g.get("metadata") or {}).get("name") == name
                          and (g.get("metadata") or {}).get("namespace") == self.namespace), None)
            now = loop.time()
            if podgroups.admitted(pod, group):
                if admitted_at is None:
                    admitted_at = now
                    self._gpupool_admitted_at = periods.utcnow()
                    self._gpupool_waiting = None
                    self._gpupool_status = f'{wanted.display_name}: admitted by queue "{wanted.queue}", starting'
                elif now - admitted_at > start_timeout and not self.is_pod_running(pod):
                    # (a running, ready pod has started: KubeSpawner notices at its next look)
                    raise TimeoutError(f'{wanted.display_name} was admitted by queue "{wanted.queue}" but did not '
                                       f"start within {start_timeout:g} seconds (start_timeout)")
            else:
                if pod is not None:
                    events = [*(self.event_reflector.events if self.event_reflector else []),
                              *(group_events.events if group_events else [])]
                    messages = podgroups.scheduling_messages(pod, group, events)
                    reason = podgroups.explain(messages, wanted, podgroups.phase(group))
                    position = (podgroups.queue_position(all_groups, name, wanted.queue, priorities)
                                if name else None)
                    self._gpupool_status = podgroups.waiting_message(wanted, position, reason)
                    self._waiting_for(Reason.VOLCANO_PENDING)
                if now - began > queue_timeout:
                    raise self._refuse(f'{wanted.display_name} waited {queue_timeout} seconds in queue '
                                      f'"{wanted.queue}" without a place ({reason}); try again later '
                                      "or pick a smaller profile", Reason.QUEUE_TIMEOUT)
            await asyncio.sleep(self.queue_poll_interval)

    # --- accounting: admission before the pod, usage while it runs ------------------------------------

    def _waiting_for(self, code: Reason) -> None:
        """The spawn waits for reason `code`: on the progress stream, and counted once per new reason."""
        if self._gpupool_waiting != code:
            self._gpupool_waiting = code
            count_decision(code)

    def _refuse(self, message: str, code: Reason):
        """The exception for a spawn refused, or whose wait ended, with reason `code` (counted)."""
        count_decision(code)
        return refusal(message, code)

    #: z2jh's `hub.namedServerLimitPerUser` is one number for everyone: each user's teams' limit is counted here.
    counts_named_servers = True

    async def profile_availability(self) -> Availability:
        """What a spawn of each profile the user may pick would do now, as far as gpupool decides it: the ledger's
        decision (quota and budget, the same `admission.decide` the door takes, nothing held); where it admits,
        whether the cluster has room is Volcano's to decide, and the line says so. The queue: this namespace's
        gpupool pods still pending."""
        teams = self.user_teams()
        if not teams or not self.ledger_url:
            return Availability()
        policy, ledger, at = self.policy, self.ledger, periods.utcnow()
        holdings, usage = await asyncio.gather(asyncio.to_thread(ledger.holdings),
                                               asyncio.to_thread(ledger.usage, periods.period_of(at), at))
        seen, candidates = self.availability_candidates(teams)
        for slug, _profile, team in candidates:
            decision = decide(policy, AdmissionRequest(user=self.user.name, team=team, at=at, profile=slug),
                              holdings, usage)
            if decision.action == "deny":
                seen[slug] = ProfileAvailability("refuse", decision.reason, str(decision.code))
            elif not decision.admitted:
                seen[slug] = ProfileAvailability("wait", decision.reason, str(decision.code))
            else:
                seen[slug] = ProfileAvailability(
                    "start", f"within quota and budget; Volcano starts it when the cluster has room in queue "
                             f'"{team}"', str(decision.code))
        pods = list(self.pod_reflector.resources.values()) if self.pod_reflector is not None else ()
        waiting = [pod for pod in pods if (pod.get("status") or {}).get("phase") == "Pending"
                   and QUEUE_ANNOTATION in ((pod.get("metadata") or {}).get("annotations") or {})]
        mine = sum(1 for pod in waiting if pod["metadata"]["annotations"][QUEUE_ANNOTATION] in teams)
        return Availability(seen, len(waiting), mine)

    async def admit(self, choice: Choice) -> Decision:
        """The accounting's decision, as in the embedded mode: a budget `deny` refuses with 403, a full
        quota waits (with the reason on the spawn page) until shares free up or the queue timeout, a
        budget `deprioritize` turns the pod into lowest-priority, preemptable work.

        Through the ledger's one door (`Ledger.admit`, in a thread: SQL under the team's lock, off the event
        loop): the decision and the holding are one transaction, so spawns of any number of hub processes
        cannot exceed a quota between them. The holding is the run's (`usage_run`), `reserved` until the pod
        runs (held against the quotas while it waits in Volcano's queue, not billed); `open_usage` then makes
        it `running`. Volcano's queue capability bounds the pods that wait in the cluster.
        """
        if not self.ledger_url:
            raise web.HTTPError(503, "gpupool accounting is not configured: set GPUKubeSpawner.ledger_url "
                                     "(or GPUPOOL_LEDGER_URL in the hub's environment; the Helm chart does)")
        loop = asyncio.get_running_loop()
        began = loop.time()
        queue_timeout = self.policy.queue_timeout(choice.team)
        ledger = self.ledger
        run = self.new_usage_run(holds_gpu=choice.profile.gpu is not None)
        held = self.usage_run
        while not self._gpupool_stopping:
            policy = self.policy
            request = AdmissionRequest(user=self.user.name, team=choice.team, at=periods.utcnow(), profile=choice.slug)
            result = await asyncio.to_thread(notify.admit, policy, ledger, request, run, self.log)
            decision = result.decision
            if self._gpupool_stopping:
                # Stopped while the door decided: `stop()` closed the run before the door could have recorded
                # its holding; the start's end closes it (once more) now that the door is done.
                self.usage_run, self.usage_running = held, False
                break
            if decision.action == "deny":
                raise self._refuse(decision.reason, decision.code)
            if decision.admitted:
                count_decision(decision.code)
                return decision
            self._gpupool_status = f"Waiting for {choice.profile.display_name}: {decision.reason}"
            self._waiting_for(decision.code)
            if loop.time() - began > queue_timeout:
                raise self._refuse(f"{choice.profile.display_name} waited {queue_timeout} seconds for quota "
                                  f"({decision.reason}); try again later or pick a smaller profile",
                                  Reason.QUEUE_TIMEOUT)
            await asyncio.sleep(self.queue_poll_interval)
        raise self._refuse(f"{choice.profile.display_name}: stopped while waiting for quota", Reason.CANCELLED)

    async def _start(self):
        await self.load_user_options()  # an invalid choice is refused here, before any API call
        choice = self.gpupool_choice
        self._gpupool_stopping = self._gpupool_replaced_leftover = False
        self._gpupool_admitted_at = None
        self._gpupool_waiting = None
        asked = periods.utcnow()
        start = watch = None
        running = False
        try:
            decision = await self.admit(choice)
            deprioritized = decision.priority == LOWEST_PRIORITY
            if deprioritized != self.gpupool_deprioritized:
                self.gpupool_deprioritized = deprioritized
                self.apply_choice(choice)  # the PriorityClass and the preemptable annotation follow
            problem = await self.capacity_problem(choice)
            if problem:
                # Not a user error and not temporary: the policy offers a profile this cluster cannot hold.
                raise self._refuse(problem, Reason.NEVER_FITS_POOL)
            if self._gpupool_stopping:  # stopped while the capacity was looked up: no pod is created
                raise self._refuse(f"{choice.profile.display_name}: stopped before its pod was created",
                                   Reason.CANCELLED)
            self._gpupool_status = self._gpupool_waiting = None
            start = asyncio.ensure_future(super()._start())
            watch = asyncio.ensure_future(self._watch_queue(choice))
            await asyncio.wait({start, watch}, return_when=asyncio.FIRST_COMPLETED)
            if start.done():
                url = start.result()
            else:
                watch.result()  # raises why the wait ended
                url = await start
            # Usage counts from the moment the pod runs, not while it waited for quota or in Volcano's queue:
            # the reserved holding runs from now on.
            self.open_usage(max(timedelta(0), (self._gpupool_admitted_at or periods.utcnow()) - asked))
            running = True
            return url
        finally:
            if not running:  # refused, timed out, stopped or failed before the pod ran: its holding ends unbilled
                # (stopped by its user: as `stop()` itself would book it, whichever of the two gets there first)
                self.close_usage(HowEnded.STOPPED if self._gpupool_stopping else HowEnded.FAILED)
            for task in (start, watch):
                if task is not None and not task.done():
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task

    async def stop(self, now=False):
        if _CREATING_POD.get():
            # KubeSpawner replacing a pod of this server's name left over from before, not a stop of this spawn:
            # its wait, its holding and its usage go on once the old pod is gone.
            self.log.info("gpupool: replacing the pod %s left over from an earlier server", self.pod_name)
            self._gpupool_replaced_leftover = True
            await super().stop(now=now)
            return
        self._gpupool_stopping = True  # a spawn still waiting in the queue ends with a clear message
        self.see_usage()  # seen running as the stop begins: a slow deletion is not mistaken for a lost pod
        try:
            await super().stop(now=now)
        finally:
            self.close_usage(HowEnded.STOPPED)

    async def poll(self):
        status = await super().poll()
        if status is None:
            self.see_usage()
        elif self.usage_run and not self._spawn_pending and not self._stop_pending:
            # The pod is gone (JupyterHub will not call stop()): it counts until it was last seen running.
            self.close_usage(HowEnded.FAILED, at_last_seen=True)
        return status

    async def progress(self):
        """KubeSpawner's pod events, with the queue position and reason whenever they change.

        Messages about the queue carry no `progress` value: waiting does not move the bar.
        """
        events = super().progress()
        upcoming: asyncio.Future | None = asyncio.ensure_future(anext(events))
        shown = None
        try:
            while True:
                if upcoming is not None:
                    await asyncio.wait({upcoming}, timeout=self.queue_poll_interval)
                else:  # KubeSpawner's events are off or over: keep telling about the queue until start ends
                    await asyncio.sleep(self.queue_poll_interval)
                status, waiting = self._gpupool_status, self._gpupool_waiting
                if status and status != shown:
                    shown = status
                    # `reason`: the wait's code (admission.Reason), for scripts reading the progress stream
                    yield {"message": status, **({"reason": str(waiting)} if waiting else {})}
                if upcoming is not None and upcoming.done():
                    try:
                        event = upcoming.result()
                    except StopAsyncIteration:
                        upcoming = None
                    else:
                        yield event
                        upcoming = asyncio.ensure_future(anext(events))
                if upcoming is None and (self._start_future is None or self._start_future.done()):
                    break
        finally:
            if upcoming is not None and not upcoming.done():
                upcoming.cancel()
                with contextlib.suppress(BaseException):
                    await upcoming
            await events.aclose()

    async def user_storage(self) -> dict[str, Any]:
        """The user's storage as their servers get it (`volumes`, `volume_mounts`: z2jh's home claim, expanded
        for this spawner's user), the pod's user and groups and the container's privilege escalation, resolved
        as KubeSpawner resolves them for a server (callables included): what a training job of theirs gets."""
        async def resolved(value):
            return await maybe_future(value(self)) if callable(value) else value

        uid, gid, fs_gid, groups = [await resolved(v) for v in (self.uid, self.gid, self.fs_gid,
                                                                 self.supplemental_gids)]
        security = {key: value for key, value in (("runAsUser", uid), ("runAsGroup", gid), ("fsGroup", fs_gid))
                    if isinstance(value, int)}
        if groups:
            security["supplementalGroups"] = list(groups)
        container = ({"allowPrivilegeEscalation": self.allow_privilege_escalation}
                     if self.allow_privilege_escalation is not None else {})
        return {"volumes": self._expand_all(self.volumes), "volume_mounts": self._expand_all(self.volume_mounts),
                "security_context": security, "container_security_context": container}

    # --- state across hub restarts ---------------------------------------------------------------------

    def get_state(self):
        state = super().get_state()
        if self.gpupool_deprioritized:
            state["deprioritized"] = True
        return state

    def clear_state(self):
        super().clear_state()
        # JupyterHub clears state before applying a new spawn's user_options: no choice outlives its spawn.
        self.gpupool_choice = None
        self.gpupool_deprioritized = False

    def load_state(self, state):
        super().load_state(state)
        self.gpupool_deprioritized = bool(state.get("deprioritized"))
