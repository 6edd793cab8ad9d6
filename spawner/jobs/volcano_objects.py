"""A gpupool training job as a Volcano Job (`batch.volcano.sh/v1alpha1`), and a Volcano Job's status in
gpupool's words. Pure functions, no I/O: submitting and watching are the Kubernetes job watcher's.

The pod asks for the share exactly as a notebook of the same profile does (`kube.choice_pod`), in the team's
queue with the team's PriorityClass (`kube.volcano_binding`); what Volcano does on each event is a table
(`restart_policies`) made from the job's `max_restarts` and the policy's exit-code rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from gpupool.hub.accounting.jobs import DEFAULT_CHECKPOINT_MOUNT, JOB_ID_LABEL, Job, env_problem
from gpupool.policies.choice import check_choice
from gpupool.policies.identity import username_problem
from gpupool.policies.model import DNS_LABEL, Policy, Restarts
from gpupool.policies.resources import profile_gpu
from gpupool.policies.restarts import Ended, Event
from gpupool.spawner.kube import PREEMPTABLE_ANNOTATION, choice_pod, volcano_binding
from gpupool.spawner.mixin import choice_env
from gpupool.spawner.volcano import Release, job_priority_class, labels, team_queue
from gpupool.train import CHECKPOINT_DIR_ENV

JOB_API_VERSION = "batch.volcano.sh/v1alpha1"
JOB_PREFIX = "gpupool-job-"
#: Volcano labels every pod with the Job's name (`volcano.sh/job-name`): a label value, at most 63 characters.
MAX_JOB_NAME = 63
TASK = "train"
CHECKPOINT_VOLUME = "checkpoints"

USER_LABEL = "gpupool.io/user"
#: Which Volcano Job of its job this is (the run that made it): a job suspended and resumed, or restarted by
#: gpupool, gets a new Volcano Job of the same name, whose pods must not be taken for the last one's.
SUBMISSION_LABEL = "gpupool.io/submission"
JOB_ID_ENV = "GPUPOOL_JOB_ID"
#: Volcano's count of the Job's restarts when the pod was made (every cause: evictions too), from the
#: annotation Volcano's controller writes on each pod; empty with a Volcano that does not write it.
RETRY_COUNT_ENV = "GPUPOOL_VOLCANO_RETRY_COUNT"
RETRY_COUNT_ANNOTATION = "volcano.sh/job-retry-count"

#: Volcano restarts beyond the user's `max_restarts` that `maxRetry` leaves for evictions (preemption, a
#: drained or lost node) and always-retried exit codes, which Volcano counts as retries and gpupool does not.
#: A bound, not a budget: gpupool counts the failures itself (`policies.restarts`) and ends a job that
#: used up its restarts; this only stops a crash loop while nothing of the platform is watching.
EVICTION_HEADROOM = 100
#: A container's exit code, as Volcano matches `exitCode` policies (a signal N gives 128+N); Volcano refuses 0.
CONTAINER_EXIT_CODES = range(1, 256)


@dataclass(frozen=True)
class JobSpec:
    """One training job as the cluster runs it: who, what, on which profile, and how it restarts."""

    job_id: str
    user: str
    team: str
    profile: str
    command: tuple[str, ...]
    #: A key of the profile's images; None: the profile's default one, or the platform's for a profile without.
    image: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    workdir: str | None = None
    max_restarts: int = 0
    #: Preemptible work by the job's own choice (a preemptible profile makes every job of it preemptible).
    preemptible: bool = False
    #: Admitted beyond an exhausted budget (`on_exhausted: deprioritize`): lowest priority, preemptable.
    deprioritized: bool = False
    #: The job priority (`low`, `normal`, `high`; one of the team's `job_priorities`): its PriorityClass.
    priority: str = "normal"
    #: Which Volcano Job of the job this is (`SUBMISSION_LABEL`): the attempt of the run that makes it.
    submission: int = 1
    grace_seconds: int = 60
    #: The PersistentVolumeClaim the checkpoints live on; None: the job has no checkpoint folder.
    checkpoint_claim: str | None = None
    checkpoint_mount: str = DEFAULT_CHECKPOINT_MOUNT
    #: The user's storage as the hub's spawner mounts it in their servers (KubeSpawner's `volumes` and
    #: `volume_mounts`, expanded for the user: z2jh's home claim), so a job sees the files of its notebooks.
    volumes: tuple[Mapping[str, Any], ...] = ()
    volume_mounts: tuple[Mapping[str, Any], ...] = ()
    #: The pod's securityContext as the spawner sets it for servers (runAsUser, runAsGroup, fsGroup, groups),
    #: and the container's (allowPrivilegeEscalation).
    security_context: Mapping[str, Any] = field(default_factory=dict)
    container_security_context: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_job(cls, job: Job, policy: Policy, *, deprioritized: bool, image: str | None = None,
                 storage: Mapping[str, Any] | None = None, submission: int = 1) -> JobSpec:
        """The spec of a job of the ledger's database: grace period and checkpoint claim from `policy.jobs`;
        `storage`: the user's `volumes`, `volume_mounts` and `security_context` as their servers get them."""
        storage = storage or {}
        return cls(job_id=job.id, user=job.user, team=job.team, profile=job.profile, command=tuple(job.command),
                   image=image, env=dict(job.env), workdir=job.workdir, max_restarts=job.max_restarts,
                   preemptible=job.preemptible, deprioritized=deprioritized, priority=job.priority,
                   submission=submission,
                   grace_seconds=policy.jobs.grace_seconds,
                   checkpoint_claim=policy.jobs.checkpoint_claim,
                   checkpoint_mount=job.checkpoint_dir or DEFAULT_CHECKPOINT_MOUNT,
                   volumes=tuple(storage.get("volumes") or ()), volume_mounts=tuple(storage.get("volume_mounts") or ()),
                   security_context=dict(storage.get("security_context") or {}),
                   container_security_context=dict(storage.get("container_security_context") or {}))


def job_name(job_id: str) -> str:
    """The Volcano Job of gpupool job `job_id`: one name per id, a DNS label (its pods are `<name>-train-0`)."""
    longest = MAX_JOB_NAME - len(JOB_PREFIX)
    if not isinstance(job_id, str) or not DNS_LABEL.fullmatch(job_id) or len(job_id) > longest:
        raise ValueError(f"job id {job_id!r} cannot name a Volcano Job (accepted: lower-case letters, digits and "
                         f"'-', starting and ending with a letter or digit, at most {longest} characters)")
    return JOB_PREFIX + job_id


def restart_policies(max_restarts: int, rules: Restarts) -> list[dict[str, Any]]:
    """What Volcano does on each event, first match wins (exit codes before `PodFailed`, which they refine).

    A pod evicted (preempted, its node drained or lost) restarts the Job and never counts against
    `max_restarts`. A failed run restarts when restarts are allowed; with `max_restarts` 0 no `PodFailed`
    entry is there, and Volcano ends the Job `Failed` when its one pod fails: `maxRetry` cannot say "no
    retries" (Volcano reads 0 as its default, 3). Exit codes the policy never retries end the Job at once
    (`TerminateJob`: the failed pod is kept, its exit code readable); always-retried ones restart it.
    Volcano restarts at once: the policy's back-off (`jobs.restarts.backoff_seconds`) has no Volcano
    equivalent. A kubelet's node-pressure eviction ends the pod `Failed` (reason `Evicted`), which Volcano
    reports as `PodFailed`: only the pod's `status.reason` tells it from a failure.
    """
    policies: list[dict[str, Any]] = [{"event": "PodEvicted", "action": "RestartJob"}]
    policies += [{"exitCode": code, "action": "TerminateJob"}
                 for code in sorted(set(rules.never_retry_exit_codes)) if code in CONTAINER_EXIT_CODES]
    policies += [{"exitCode": code, "action": "RestartJob"}
                 for code in sorted(set(rules.always_retry_exit_codes)) if code in CONTAINER_EXIT_CODES]
    if max_restarts > 0:
        policies.append({"event": "PodFailed", "action": "RestartJob"})
    policies.append({"event": "TaskCompleted", "action": "CompleteJob"})
    return policies


def _absolute_path(what: str, path: str) -> None:
    if not isinstance(path, str) or not path.startswith("/") or ":" in path or "\0" in path:
        raise ValueError(f"{what} {path!r} is not an absolute path without ':' (accepted: e.g. /checkpoints)")


def _check(spec: JobSpec, namespace: str) -> None:
    """ValueError naming what of `spec` the cluster would refuse (or gpupool must not pass on)."""
    if not DNS_LABEL.fullmatch(namespace) or len(namespace) > 63:
        raise ValueError(f"namespace {namespace!r} is not a DNS label (accepted: lower-case letters, digits and "
                         "'-', starting and ending with a letter or digit, at most 63 characters)")
    problem = username_problem(spec.user)
    if problem:
        raise ValueError(problem)
    if not spec.command or not all(isinstance(part, str) for part in spec.command) or not spec.command[0].strip():
        raise ValueError(f"a job's command is its program and arguments, strings, the program first; "
                         f"got {spec.command!r}")
    for name, value in spec.env.items():
        problem = env_problem(name, value)
        if problem:
            raise ValueError(problem)
    if spec.workdir is not None:
        _absolute_path("working directory", spec.workdir)
    for what, number in (("max_restarts", spec.max_restarts), ("grace_seconds", spec.grace_seconds),
                         ("submission", spec.submission)):
        if not isinstance(number, int) or isinstance(number, bool) or number < 0:
            raise ValueError(f"{what} is a whole number ≥ 0, not {number!r}")
    if spec.checkpoint_claim is not None:
        if not DNS_LABEL.fullmatch(spec.checkpoint_claim) or len(spec.checkpoint_claim) > 63:
            raise ValueError(f"checkpoint claim {spec.checkpoint_claim!r} is not a PersistentVolumeClaim name "
                             "(accepted: lower-case letters, digits and '-', at most 63 characters)")
        _absolute_path("checkpoint folder", spec.checkpoint_mount)
    names = [v.get("name") for v in spec.volumes] + ([CHECKPOINT_VOLUME] if spec.checkpoint_claim else [])
    if len(names) != len(set(names)) or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"the job's volumes need distinct names ({CHECKPOINT_VOLUME!r} is the checkpoint claim's); "
                         f"got {names}")


def volcano_job(spec: JobSpec, policy: Policy, release: Release, namespace: str, *,
                default_image: str) -> dict[str, Any]:
    """The Volcano Job that runs `spec` in `namespace`, as JSON-able data; ValueError naming what is wrong.

    The profile is checked as a server's choice is (`check_choice`: it must be offered to the team, the image
    one of the profile's); `default_image` runs profiles without image choices (the hub's notebook image).
    `maxRetry` is `max_restarts` plus `EVICTION_HEADROOM`: Volcano counts every restart (evictions, suspends,
    always-retried exit codes) in `status.retryCount`, so preemption must not be able to use up the user's
    restarts there; gpupool counts failures itself, with their causes, and ends a job past `max_restarts`.
    With a checkpoint claim the pod mounts the claim's folder `<user>/<job id>` (created by the kubelet) at
    `checkpoint_mount`, which `GPUPOOL_CHECKPOINT_DIR` names: a job sees its own checkpoints only, and they
    outlive its pods. Without one there is no checkpoint folder (`gpupool.train` then asks for one): a folder
    in the container would not survive a restart.
    """
    name = job_name(spec.job_id)
    _check(spec, namespace)
    if spec.team not in policy.teams:
        raise ValueError(f"no team {spec.team!r} in the policy (teams: {', '.join(policy.teams)})")
    options = {"profile": spec.profile, "team": spec.team, **({"image": spec.image} if spec.image else {})}
    choice = check_choice(policy, spec.user, [spec.team], options)  # ChoiceRefused is a ValueError
    profile = choice.profile
    if spec.priority not in policy.teams[spec.team].job_priorities:
        raise ValueError(f"team {spec.team!r} may not use job priority {spec.priority!r} (allowed: "
                         f"{', '.join(policy.teams[spec.team].job_priorities)})")
    binding = volcano_binding(spec.team, profile.preemptible or spec.preemptible, spec.deprioritized)
    if not spec.deprioritized:  # at its job priority (over-budget work stays the lowest whatever it asked for)
        binding = replace(binding, priority_class_name=job_priority_class(spec.team, spec.priority))
    pod = choice_pod(choice, policy, profile_gpu(profile, policy), binding)

    limits = {**({"cpu": profile.cpu.limit} if profile.cpu.limit else {}),
              **({"memory": profile.memory.limit} if profile.memory.limit else {}), **pod.resources}
    requests = {**({"cpu": profile.cpu.guarantee} if profile.cpu.guarantee else {}),
                **({"memory": profile.memory.guarantee} if profile.memory.guarantee else {}), **pod.resources}
    # The platform's variables first: the user's may refer to them as $(GPUPOOL_CHECKPOINT_DIR).
    platform = {JOB_ID_ENV: spec.job_id, **choice_env(choice, policy)}
    if spec.checkpoint_claim is not None:
        platform[CHECKPOINT_DIR_ENV] = spec.checkpoint_mount
    env: list[dict[str, Any]] = [{"name": key, "value": value} for key, value in platform.items()]
    env.append({"name": RETRY_COUNT_ENV,
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{RETRY_COUNT_ANNOTATION}']"}}})
    env += [{"name": key, "value": value} for key, value in spec.env.items()]

    container: dict[str, Any] = {
        "name": TASK,
        "image": profile.images[choice.image].image if choice.image else default_image,
        "command": list(spec.command),
        "env": env,
        "resources": {**({"limits": limits} if limits else {}), **({"requests": requests} if requests else {})},
    }
    if spec.workdir is not None:
        container["workingDir"] = spec.workdir
    if spec.container_security_context:
        container["securityContext"] = dict(spec.container_security_context)
    pod_spec: dict[str, Any] = {
        "schedulerName": binding.scheduler_name,
        "priorityClassName": binding.priority_class_name,
        # Volcano replaces the whole pod on a restart; the kubelet restarting a container in place would
        # hide the failure from Volcano's policies and from gpupool's count.
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": spec.grace_seconds,
        # A job, like a notebook, holds no Kubernetes credentials.
        "automountServiceAccountToken": False,
        "containers": [container],
    }
    if pod.node_selector:
        pod_spec["nodeSelector"] = pod.node_selector
    if pod.tolerations:
        pod_spec["tolerations"] = pod.tolerations
    if spec.security_context:
        pod_spec["securityContext"] = dict(spec.security_context)
    volumes = [dict(v) for v in spec.volumes]
    mounts = [dict(m) for m in spec.volume_mounts]
    if spec.checkpoint_claim is not None:
        # In the pod template rather than Volcano's `spec.volumes`, which cannot mount a folder of a claim.
        mounts.append({"name": CHECKPOINT_VOLUME, "mountPath": spec.checkpoint_mount,
                       "subPath": f"{spec.user}/{spec.job_id}"})
        volumes.append({"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": spec.checkpoint_claim}})
    if mounts:
        container["volumeMounts"] = mounts
    if volumes:
        pod_spec["volumes"] = volumes

    job_labels = {**labels(release, "job", spec.team), **pod.labels, JOB_ID_LABEL: spec.job_id,
                  USER_LABEL: spec.user, SUBMISSION_LABEL: str(spec.submission)}
    return {
        "apiVersion": JOB_API_VERSION,
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": job_labels,
            # Volcano copies it to the pods and reads it for the whole Job's PodGroup when it preempts.
            "annotations": {PREEMPTABLE_ANNOTATION: binding.annotations[PREEMPTABLE_ANNOTATION]},
        },
        "spec": {
            "schedulerName": binding.scheduler_name,
            "queue": team_queue(spec.team),
            "priorityClassName": binding.priority_class_name,
            "minAvailable": 1,
            "maxRetry": spec.max_restarts + EVICTION_HEADROOM,
            "policies": restart_policies(spec.max_restarts, policy.jobs.restarts),
            "tasks": [{
                "name": TASK,
                "replicas": 1,
                "minAvailable": 1,
                "template": {"metadata": {"labels": dict(job_labels), "annotations": pod.annotations},
                             "spec": pod_spec},
            }],
        },
    }


# --- a Volcano Job's status in gpupool's words ------------------------------------------------------------


class VolcanoJobState(NamedTuple):
    """Where a Volcano Job stands: a job state of gpupool's (`db.JOB_STATES`), Volcano's restart count
    (`status.retryCount`: every restart, evictions included, not the user's counted restarts) and why."""

    state: str
    retries: int
    reason: str


#: Volcano's phases (the CRD's `status.state.phase`) → gpupool's state and words. Terminating/Terminated
#: are decided in `job_state`: by a failed pod (a never-retried exit code) or by a command (a cancel).
PHASES: dict[str, tuple[str, str]] = {
    "Pending": ("queued", "waiting in Volcano's queue"),
    "Running": ("running", "running"),
    "Restarting": ("restarting", "Volcano is replacing its pod"),
    "Completing": ("succeeded", "finished; Volcano is cleaning up"),
    "Completed": ("succeeded", "finished"),
    # A suspend (`vcctl job suspend`) aborts a Volcano Job; `vcctl job resume` resumes it.
    "Aborting": ("suspended", "suspended"),
    "Aborted": ("suspended", "suspended"),
    "Failed": ("failed", "failed"),
}
TERMINAL_BY_COMMAND = ("Terminating", "Terminated")


def job_state(job: Mapping[str, Any]) -> VolcanoJobState:
    """The state of Volcano Job `job` (as the API returns it); ValueError for a phase gpupool does not know.

    Volcano writes no cause beside a phase (its conditions are the phases it went through), so what ended
    a run comes from the pods; this says where the Job is.
    """
    status = job.get("status") or {}
    spec = job.get("spec") or {}
    if not isinstance(status, Mapping) or not isinstance(spec, Mapping):
        raise ValueError("a Volcano Job's spec and status are objects")
    state = status.get("state") or {}
    phase = state.get("phase")
    retries = int(status.get("retryCount") or 0)
    said = "; ".join(str(part) for part in (state.get("reason"), state.get("message")) if part)
    if not phase:
        return VolcanoJobState("queued", retries, said or "not yet seen by Volcano's job controller")
    if phase in TERMINAL_BY_COMMAND:
        if status.get("failed"):
            return VolcanoJobState("failed", retries, said or "failed with an exit code the policy never retries")
        return VolcanoJobState("cancelled", retries, said or "terminated by a command")
    if phase not in PHASES:
        raise ValueError(f"unknown Volcano Job phase {phase!r} (known: {', '.join([*PHASES, *TERMINAL_BY_COMMAND])})")
    gpupool_state, words = PHASES[phase]
    max_retry = spec.get("maxRetry")
    if phase == "Failed" and isinstance(max_retry, int) and retries >= max_retry:
        words = f"Volcano gave up after {retries} restarts (maxRetry {max_retry})"
    elif phase == "Restarting":
        words = f"{words} (restart {retries})"
    return VolcanoJobState(gpupool_state, retries, said or words)


# --- how a run ended, from its pod -------------------------------------------------------------------------

#: A pod's `DisruptionTarget` condition reasons (Kubernetes ≥ 1.26) that mean higher-priority work took its
#: place; the others (a drained or tainted node, a node that went away) mean the node.
PREEMPTION_REASONS = frozenset({"PreemptionByScheduler", "PreemptionByKubeScheduler", "EvictionByEvictionAPI"})


def pod_retry(pod: Mapping[str, Any]) -> int | None:
    """The Volcano restart a pod belongs to (`volcano.sh/job-retry-count`), None if it does not say."""
    value = ((pod.get("metadata") or {}).get("annotations") or {}).get(RETRY_COUNT_ANNOTATION)
    return int(value) if isinstance(value, str) and value.isdigit() else None


def _terminated(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        if container.get("name") == TASK:
            return (container.get("state") or {}).get("terminated") or {}
    return {}


def pod_exit_code(pod: Mapping[str, Any]) -> int | None:
    """The exit code of the job's container, once it has terminated."""
    code = _terminated(pod).get("exitCode")
    return code if isinstance(code, int) else None


def finished_at(pod: Mapping[str, Any]) -> str | None:
    """When the job's container terminated (RFC 3339, as the API gives it); None while it has not."""
    return _terminated(pod).get("finishedAt") or None


def pod_end(pod: Mapping[str, Any], *, deleted: bool = False) -> Ended | None:
    """How the run in `pod` ended, as the restart rules count it; None while it waits or runs.

    The container's exit code decides a failure; a pod evicted by the kubelet (node pressure) or disrupted
    (its `DisruptionTarget` condition) ended for its node or for higher-priority work, which never counts
    against the job's restarts. `deleted`: the pod was deleted (a watch's DELETED event) while it ran:
    Volcano's preemption, a drain or a lost node took it. A pod that ended while being deleted ended by the
    deletion unless its container finished before the deletion was asked for.
    """
    status = pod.get("status") or {}
    phase = status.get("phase")
    disruption = next((c for c in status.get("conditions") or [] if c.get("type") == "DisruptionTarget"
                       and c.get("status") == "True"), None)
    code = pod_exit_code(pod)
    if phase in ("Succeeded", "Failed"):
        # ended by itself, or by its deletion: the kubelet ends a deleted pod's container (exit 143, or 0 after a
        # save) before it goes, and Volcano counts any deleted pod as evicted
        deleted = _ended_by_deletion(pod)
    if deleted and disruption is None:
        preemptable = ((pod.get("metadata") or {}).get("annotations") or {}).get(PREEMPTABLE_ANNOTATION) == "true"
        return Ended(Event.PREEMPTED if preemptable else Event.NODE_LOST, code)
    if phase == "Succeeded":
        return Ended(Event.SUCCEEDED, 0 if code is None else code)
    if disruption is not None and (phase == "Failed" or deleted):
        preempted = disruption.get("reason") in PREEMPTION_REASONS
        return Ended(Event.PREEMPTED if preempted else Event.NODE_LOST, code)
    if phase == "Failed":
        if status.get("reason") == "Evicted":  # the kubelet's node-pressure eviction: the node's, not the job's
            return Ended(Event.NODE_LOST, code)
        return Ended(Event.FAILED, code)
    return None


def _ended_by_deletion(pod: Mapping[str, Any]) -> bool:
    """Whether an ended pod that is being deleted ended because of it: its container finished when or after the
    deletion was asked for (`deletionTimestamp` less the grace period), or it does not say when."""
    meta = pod.get("metadata") or {}
    deleting = meta.get("deletionTimestamp")
    if not deleting:
        return False
    asked = datetime.fromisoformat(deleting.replace("Z", "+00:00")) - timedelta(
        seconds=int(meta.get("deletionGracePeriodSeconds") or 0))
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        finished = (((container.get("state") or {}).get("terminated") or {}).get("finishedAt")
                    if container.get("name") == TASK else None)
        if finished:
            return datetime.fromisoformat(finished.replace("Z", "+00:00")) >= asked
    return True


def running_since(pod: Mapping[str, Any]) -> str | None:
    """When the pod's container started running (RFC 3339, as the API gives it), also once it has ended; None if
    it never ran."""
    status = pod.get("status") or {}
    if status.get("phase") not in ("Running", "Succeeded", "Failed"):
        return None
    for container in status.get("containerStatuses") or []:
        if container.get("name") == TASK:
            state = container.get("state") or {}
            started = (state.get("running") or state.get("terminated") or {}).get("startedAt")
            if started:
                return started
    return status.get("startTime")  # when the kubelet took the pod: its container's start, near enough
