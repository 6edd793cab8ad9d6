"""A training job as a Volcano Job (`gpupool.spawner.jobs.volcano_objects`): a literal manifest, every profile
of both policy sets against Volcano's CRD schema, its webhook's rules and kubernetes-validate (strict), the pod
side equal to the pod a real GPUKubeSpawner renders for the same profile, the restart table, and Volcano's
status read back.

The Volcano CRDs come from shared/ beside the repository (test_render.py's checks); without it those skip.
"""

from __future__ import annotations

import copy
import importlib.util
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gpupool.hub.accounting.jobs import Job
from gpupool.policies import DEFAULT_POLICY_DIR, EXAMPLES_DIR, load_policy
from gpupool.policies.model import DNS_LABEL, Restarts, parse_quantity
from gpupool.policies.restarts import Ended, Event
from gpupool.spawner.jobs.volcano_objects import (
    EVICTION_HEADROOM,
    JobSpec,
    VolcanoJobState,
    job_name,
    job_state,
    pod_end,
    running_since,
    restart_policies,
    volcano_job,
)
from gpupool.spawner.volcano import Release, priority_classes
from kubernetes_asyncio.config import kube_config


def _load(name: str):
    # pytest's importlib mode puts no test module on sys.path: load the checks of the tests that own them.
    spec = importlib.util.spec_from_file_location(f"gpupool_jobs_{name}", next(Path(__file__).resolve().parents[2].rglob(f"{name}.py")))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


checks = _load("test_render")  # strict CRD validators, kubernetes-validate's version
kube = _load("test_kube_spawner")  # a real GPUKubeSpawner from JupyterHub's objects, and its pods per backend

NAMESPACE = "gpupool-users"
IMAGE = "quay.io/jupyterhub/singleuser:5.3"
JOB_ID = "0123456789ab"
POLICY_SETS = pytest.mark.parametrize("policies", [DEFAULT_POLICY_DIR, EXAMPLES_DIR], ids=["default", "examples"])
LABELS = {"app.kubernetes.io/name": "gpupool", "app.kubernetes.io/instance": "gpupool",
          "app.kubernetes.io/component": "job", "app.kubernetes.io/part-of": "gpupool"}
TOLERATE_NVIDIA = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


@pytest.fixture(scope="module")
def crds():
    return checks.volcano_validators()


@pytest.fixture(scope="module")
def examples():
    return load_policy(EXAMPLES_DIR)


def spec(**changes: Any) -> JobSpec:
    values = {"job_id": JOB_ID, "user": "alice", "team": "vision", "profile": "h200-quarter",
              "command": ("python", "train.py")}
    return JobSpec(**{**values, **changes})


def render(policy, **changes: Any) -> dict[str, Any]:
    return volcano_job(spec(**changes), policy, Release(), NAMESPACE, default_image=IMAGE)


def template(job: dict[str, Any]) -> dict[str, Any]:
    (task,) = job["spec"]["tasks"]
    return task["template"]


def container(job: dict[str, Any]) -> dict[str, Any]:
    (train,) = template(job)["spec"]["containers"]
    return train


def env(job: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(job)["env"]}


def webhook_problems(job: dict[str, Any]) -> list[str]:
    """What Volcano's admission webhook refuses beyond the CRD schema (pkg/webhooks/admission/jobs/validate)."""
    problems = []
    events, codes = set(), set()
    for policy in job["spec"]["policies"]:
        named = ([policy["event"]] if "event" in policy else []) + policy.get("events", [])
        if named and "exitCode" in policy:
            problems.append(f"event and exitCode together: {policy}")
        elif not named and "exitCode" not in policy:
            problems.append(f"neither event nor exitCode: {policy}")
        elif named:
            if policy["action"] not in ("AbortJob", "RestartJob", "RestartTask", "TerminateJob", "CompleteJob",
                                        "ResumeJob"):
                problems.append(f"action not allowed: {policy}")
            problems += [f"duplicate event {e}" for e in named if e in events]
            events |= set(named)
        elif policy["exitCode"] == 0 or policy["exitCode"] in codes:
            problems.append(f"exit code 0 or duplicated: {policy}")
        else:
            codes.add(policy["exitCode"])
    for task in job["spec"]["tasks"]:
        if not DNS_LABEL.fullmatch(task["name"]) or task.get("minAvailable", 0) > task["replicas"]:
            problems.append(f"task {task['name']!r}")
    if len(job["metadata"]["name"]) > 63:  # its pods' volcano.sh/job-name label
        problems.append("job name longer than 63")
    return problems


# --- a literal manifest ---------------------------------------------------------------------------------------


def test_a_hami_job_with_checkpoints_renders_as_this_volcano_job(examples):
    job = render(examples, env={"SEED": "1"}, workdir="/home/jovyan", max_restarts=2,
                 checkpoint_claim="gpupool-checkpoints")
    labels = {**LABELS, "gpupool.io/team": "vision", "gpupool.io/profile": "h200-quarter",
              "gpupool.io/gpu-model": "H200", "gpupool.io/job-id": JOB_ID, "gpupool.io/user": "alice",
              "gpupool.io/submission": "1"}
    gpu = {"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "25", "nvidia.com/gpucores": "25"}
    assert job == {
        "apiVersion": "batch.volcano.sh/v1alpha1",
        "kind": "Job",
        "metadata": {"name": "gpupool-job-0123456789ab", "namespace": NAMESPACE, "labels": labels,
                     "annotations": {"volcano.sh/preemptable": "false"}},
        "spec": {
            "schedulerName": "volcano",
            "queue": "vision",
            "priorityClassName": "gpupool-vision",
            "minAvailable": 1,
            "maxRetry": 2 + EVICTION_HEADROOM,
            "policies": [{"event": "PodEvicted", "action": "RestartJob"},
                         {"event": "PodFailed", "action": "RestartJob"},
                         {"event": "TaskCompleted", "action": "CompleteJob"}],
            "tasks": [{
                "name": "train",
                "replicas": 1,
                "minAvailable": 1,
                "template": {
                    "metadata": {
                        "labels": labels,
                        "annotations": {"nvidia.com/use-gputype": "H200", "scheduling.volcano.sh/queue-name": "vision",
                                        "volcano.sh/preemptable": "false", "gpupool.io/share": "1/4"},
                    },
                    "spec": {
                        "schedulerName": "volcano",
                        "priorityClassName": "gpupool-vision",
                        "restartPolicy": "Never",
                        "terminationGracePeriodSeconds": 60,
                        "automountServiceAccountToken": False,
                        "containers": [{
                            "name": "train",
                            "image": "quay.io/jupyter/pytorch-notebook:cuda12-2026-11-30",
                            "command": ["python", "train.py"],
                            "env": [
                                {"name": "GPUPOOL_JOB_ID", "value": JOB_ID},
                                {"name": "GPUPOOL_TEAM", "value": "vision"},
                                {"name": "GPUPOOL_PROFILE", "value": "h200-quarter"},
                                {"name": "GPUPOOL_SHARE", "value": "1/4"},
                                {"name": "GPUPOOL_GPU_MODEL", "value": "H200"},
                                {"name": "GPUPOOL_IMAGE", "value": "pytorch"},
                                {"name": "GPUPOOL_CHECKPOINT_DIR", "value": "/checkpoints"},
                                {"name": "GPUPOOL_VOLCANO_RETRY_COUNT", "valueFrom": {"fieldRef": {
                                    "fieldPath": "metadata.annotations['volcano.sh/job-retry-count']"}}},
                                {"name": "SEED", "value": "1"},
                            ],
                            "resources": {"limits": {"cpu": "8", "memory": "32Gi", **gpu}, "requests": gpu},
                            "workingDir": "/home/jovyan",
                            "volumeMounts": [{"name": "checkpoints", "mountPath": "/checkpoints",
                                              "subPath": "alice/0123456789ab"}],
                        }],
                        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
                        "tolerations": TOLERATE_NVIDIA,
                        "volumes": [{"name": "checkpoints",
                                     "persistentVolumeClaim": {"claimName": "gpupool-checkpoints"}}],
                    },
                },
            }],
        },
    }


# --- every profile: Volcano's CRD and webhook, and kubernetes-validate -------------------------------------------


def every_profile(policies: Path):
    policy = load_policy(policies)
    for slug, profile in policy.profiles.items():
        for image in [None, *profile.images]:
            for team in profile.teams:
                yield policy, slug, team, image


@POLICY_SETS
def test_every_profile_renders_a_job_volcano_and_kubernetes_accept(policies, crds):
    seen = set()
    for policy, slug, team, image in every_profile(policies):
        for changes in ({}, {"max_restarts": 3, "checkpoint_claim": "ckpt", "workdir": "/work", "preemptible": True},
                        {"deprioritized": True, "env": {"A": "1"}}, HOME_STORAGE):
            job = render(policy, team=team, profile=slug, image=image, **changes)
            checks.validate(job, crds)  # the CRD's schema, strict, and the name
            assert webhook_problems(job) == []
            pod_template = {"apiVersion": "v1", "kind": "PodTemplate",
                            "metadata": {"name": f"{job['metadata']['name']}-train", "namespace": NAMESPACE},
                            "template": template(job)}
            kubernetes_validate.validate(pod_template, checks.KUBERNETES_VERSION, strict=True)
            backend = policy.profiles[slug].gpu.backend_for(policy.models[policy.profiles[slug].gpu.model]) \
                if policy.profiles[slug].gpu else "cpu"
            seen.add(backend)
    wanted = {"cpu", "hami", "mig", "whole"} | ({"volcano-vgpu", "timeslice"} if policies == EXAMPLES_DIR else set())
    assert seen == wanted


def test_the_checks_catch_what_volcano_and_kubernetes_refuse(examples, crds):
    """The checks themselves: a misspelled field, a bad policy table, a container field that does not exist."""
    job = render(examples)
    wrong = copy.deepcopy(job)
    wrong["spec"]["maxRetries"] = 3
    with pytest.raises(Exception, match="maxRetries"):
        checks.validate(wrong, crds)
    wrong = copy.deepcopy(job)
    wrong["spec"]["policies"] += [{"event": "PodFailed", "action": "SyncJob"}, {"exitCode": 0, "action": "RestartJob"}]
    assert len(webhook_problems(wrong)) == 2
    wrong = copy.deepcopy(job)
    container(wrong)["workdir"] = "/x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"},
                                      "template": template(wrong)}, checks.KUBERNETES_VERSION, strict=True)


# --- the pod side equals the pod GPUKubeSpawner renders for the same profile -------------------------------------


@pytest.fixture
def kubeconfig(tmp_path, monkeypatch):
    """As test_kube_spawner's: KubeSpawner loads a kubeconfig outside a cluster (no API call is made here)."""
    path = tmp_path / "config"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "none",
        "clusters": [{"name": "none", "cluster": {"server": "http://127.0.0.1:9"}}],
        "users": [{"name": "nobody", "user": {}}],
        "contexts": [{"name": "none", "context": {"cluster": "none", "user": "nobody"}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("GPUPOOL_LEDGER_URL", f"sqlite:///{tmp_path / 'ledger.sqlite'}")


def same_quantities(resources: dict[str, Any] | None) -> dict[str, Any]:
    """Resources by value: KubeSpawner writes cpu and memory as numbers, the job as the policy's quantities."""
    return {name: parse_quantity(str(int(value)) if isinstance(value, float) and value.is_integer() else str(value))
            for name, value in (resources or {}).items()}


@pytest.mark.parametrize("key", list(kube.MANIFESTS), ids=[k[2] for k in kube.MANIFESTS])
@pytest.mark.parametrize("deprioritized", [False, True], ids=["normal", "deprioritized"])
@pytest.mark.asyncio
async def test_the_job_pod_asks_for_what_gpukubespawner_asks_for_the_same_profile(key, deprioritized, kubeconfig,
                                                                                  examples):
    user, team, slug, image = key
    spawner = kube.HubDB(kube.spawner_config(EXAMPLES_DIR)).spawner(user, kube.GROUPS[user])
    await spawner._run_apply_user_options({"profile": slug, **({"image": image} if image else {})})
    spawner.gpupool_deprioritized = deprioritized  # as the admission decides it
    pod = kube.relevant(await kube.serialized(await spawner.get_pod_manifest()))

    job = volcano_job(spec(user=user, team=team, profile=slug, image=image, deprioritized=deprioritized),
                      examples, Release(), NAMESPACE, default_image=spawner.image)
    pod_spec = template(job)["spec"]
    resources = container(job)["resources"]
    assert same_quantities(resources.get("limits")) == same_quantities(pod["limits"])
    # KubeSpawner leaves cpu and memory requests out where the profile has no guarantee; so does the job.
    assert same_quantities(resources.get("requests")) == same_quantities(pod["requests"])
    assert pod_spec.get("nodeSelector") == pod["nodeSelector"]
    assert pod_spec.get("tolerations") == pod["tolerations"]
    assert pod_spec["priorityClassName"] == pod["priorityClassName"] == job["spec"]["priorityClassName"]
    assert template(job)["metadata"]["annotations"] == pod["annotations"]
    assert job["metadata"]["annotations"]["volcano.sh/preemptable"] == pod["annotations"]["volcano.sh/preemptable"]
    labels = {k: v for k, v in template(job)["metadata"]["labels"].items() if k.startswith("gpupool.io/")}
    assert labels == {**pod["labels"], "gpupool.io/job-id": JOB_ID, "gpupool.io/user": user,
                      "gpupool.io/submission": "1"}
    assert {k: v for k, v in env(job).items() if k in pod["env"]} == pod["env"]
    assert container(job)["image"] == pod["image"]


# --- queue, priority, preemption, restarts, grace, checkpoints -------------------------------------------------


@pytest.mark.parametrize(("profile", "team", "changes", "klass", "preemptable"), [
    ("h200-quarter", "vision", {}, "gpupool-vision", "false"),
    ("h200-quarter", "nlp", {}, "gpupool-nlp", "false"),
    ("h200-quarter", "vision", {"preemptible": True}, "gpupool-vision", "true"),
    ("a100-quarter-vgpu", "nlp", {}, "gpupool-nlp", "true"),  # a preemptible profile
    ("a100-quarter-vgpu", "nlp", {"preemptible": False}, "gpupool-nlp", "true"),  # cannot be turned off
    ("cpu", "students", {"deprioritized": True}, "gpupool-deprioritized", "true"),
    ("h200-quarter", "vision", {"deprioritized": True, "preemptible": True}, "gpupool-deprioritized", "true"),
])
def test_queue_priority_class_and_preemptable(examples, profile, team, changes, klass, preemptable):
    job = render(examples, profile=profile, team=team, **changes)
    assert job["spec"]["queue"] == template(job)["metadata"]["annotations"]["scheduling.volcano.sh/queue-name"] == team
    assert job["spec"]["priorityClassName"] == template(job)["spec"]["priorityClassName"] == klass
    assert job["metadata"]["annotations"] == {"volcano.sh/preemptable": preemptable}
    assert template(job)["metadata"]["annotations"]["volcano.sh/preemptable"] == preemptable
    assert job["spec"]["schedulerName"] == template(job)["spec"]["schedulerName"] == "volcano"
    assert template(job)["spec"]["restartPolicy"] == "Never"
    assert job["spec"]["minAvailable"] == 1 and [t["replicas"] for t in job["spec"]["tasks"]] == [1]


RULES = Restarts(never_retry_exit_codes=[2, 0, 300], always_retry_exit_codes=[75, 2 + 256])


@pytest.mark.parametrize(("max_restarts", "expected"), [
    # No restarts: no PodFailed entry, so a failed pod ends the Job Failed (maxRetry 0 would read as 3).
    (0, [{"event": "PodEvicted", "action": "RestartJob"},
         {"exitCode": 2, "action": "TerminateJob"},
         {"exitCode": 75, "action": "RestartJob"},
         {"event": "TaskCompleted", "action": "CompleteJob"}]),
    (3, [{"event": "PodEvicted", "action": "RestartJob"},
         {"exitCode": 2, "action": "TerminateJob"},
         {"exitCode": 75, "action": "RestartJob"},
         {"event": "PodFailed", "action": "RestartJob"},
         {"event": "TaskCompleted", "action": "CompleteJob"}]),
])
def test_the_restart_table_follows_max_restarts_and_the_exit_code_rules(max_restarts, expected):
    # Exit codes a container cannot have (0, above 255) are left out: Volcano refuses 0, nothing matches the rest.
    assert restart_policies(max_restarts, RULES) == expected
    assert webhook_problems({"metadata": {"name": "x"}, "spec": {"policies": expected, "tasks": []}}) == []


@pytest.mark.parametrize("max_restarts", [0, 1, 5])
def test_max_retry_leaves_room_for_evictions_and_is_never_zero(examples, max_restarts):
    job = render(examples, max_restarts=max_restarts)
    assert job["spec"]["maxRetry"] == max_restarts + EVICTION_HEADROOM
    assert ({"event": "PodFailed", "action": "RestartJob"} in job["spec"]["policies"]) == (max_restarts > 0)


def test_the_default_policies_never_retry_a_usage_error():
    job = render(load_policy(DEFAULT_POLICY_DIR), max_restarts=3)
    assert job["spec"]["policies"][:2] == [{"event": "PodEvicted", "action": "RestartJob"},
                                           {"exitCode": 2, "action": "TerminateJob"}]


def test_grace_period_checkpoint_volume_and_environment(examples):
    job = render(examples, profile="h200-mig-1g", grace_seconds=120, checkpoint_claim="team-ckpt",
                 checkpoint_mount="/srv/ckpt", env={"EPOCHS": "3", "OUT": "$(GPUPOOL_CHECKPOINT_DIR)/out"})
    assert template(job)["spec"]["terminationGracePeriodSeconds"] == 120
    assert template(job)["spec"]["volumes"] == [{"name": "checkpoints",
                                                 "persistentVolumeClaim": {"claimName": "team-ckpt"}}]
    assert container(job)["volumeMounts"] == [{"name": "checkpoints", "mountPath": "/srv/ckpt",
                                               "subPath": f"alice/{JOB_ID}"}]
    assert env(job) == {
        "GPUPOOL_JOB_ID": JOB_ID, "GPUPOOL_TEAM": "vision", "GPUPOOL_PROFILE": "h200-mig-1g", "GPUPOOL_SHARE": "1/7",
        "GPUPOOL_GPU_MODEL": "H200", "GPUPOOL_CHECKPOINT_DIR": "/srv/ckpt",
        "GPUPOOL_VOLCANO_RETRY_COUNT": {
            "fieldRef": {"fieldPath": "metadata.annotations['volcano.sh/job-retry-count']"}},
        "EPOCHS": "3", "OUT": "$(GPUPOOL_CHECKPOINT_DIR)/out",
    }
    # The platform's variables come first, so the user's may refer to them.
    names = [e["name"] for e in container(job)["env"]]
    assert names.index("GPUPOOL_CHECKPOINT_DIR") < names.index("OUT")
    assert container(job)["image"] == IMAGE  # a profile without image choices runs the platform's image
    assert "workingDir" not in container(job)


#: z2jh's default user storage as KubeSpawner's configuration expands it for alice (`singleuser.storage`).
HOME_STORAGE = {
    "volumes": ({"name": "volume-alice", "persistentVolumeClaim": {"claimName": "claim-alice"}},),
    "volume_mounts": ({"name": "volume-alice", "mountPath": "/home/jovyan"},),
    "security_context": {"runAsUser": 1000, "fsGroup": 100},
    "container_security_context": {"allowPrivilegeEscalation": False},
    "checkpoint_claim": "team-ckpt",
}


def test_a_job_mounts_its_users_storage_as_their_servers_do_beside_the_checkpoint_claim(examples):
    job = render(examples, workdir="/home/jovyan/project", **HOME_STORAGE)
    assert template(job)["spec"]["volumes"] == [
        {"name": "volume-alice", "persistentVolumeClaim": {"claimName": "claim-alice"}},
        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "team-ckpt"}}]
    assert container(job)["volumeMounts"] == [
        {"name": "volume-alice", "mountPath": "/home/jovyan"},
        {"name": "checkpoints", "mountPath": "/checkpoints", "subPath": f"alice/{JOB_ID}"}]
    assert template(job)["spec"]["securityContext"] == {"runAsUser": 1000, "fsGroup": 100}
    assert container(job)["securityContext"] == {"allowPrivilegeEscalation": False}
    assert container(job)["workingDir"] == "/home/jovyan/project"  # where `gpupool jobs submit` ran, in the home
    with pytest.raises(ValueError, match="distinct names"):
        render(examples, volumes=({"name": "checkpoints", "emptyDir": {}},), checkpoint_claim="team-ckpt")


def test_without_a_claim_there_is_no_checkpoint_folder(examples):
    job = render(examples, profile="cpu", team="students")
    assert "volumes" not in template(job)["spec"] and "volumeMounts" not in container(job)
    assert "GPUPOOL_CHECKPOINT_DIR" not in env(job)
    assert "GPUPOOL_GPU_MODEL" not in env(job)
    assert container(job)["resources"] == {"limits": {"cpu": "4", "memory": "8Gi"}}
    assert "nodeSelector" not in template(job)["spec"] and "tolerations" not in template(job)["spec"]


def test_a_job_of_the_ledger_becomes_its_spec_with_the_policys_grace_and_claim(examples):
    at = datetime(2026, 12, 1, tzinfo=UTC)
    job = Job(id=JOB_ID, user="nora", team="nlp", profile="a100-mig-3g", priority="normal", preemptible=True,
              command=("python", "-m", "train"), env={"LR": "0.1"}, workdir="/home/jovyan", checkpoint_dir=None,
              max_restarts=2, state="queued", reason="in queue", restarts=0, runs=0, exit_code=None,
              cancel_requested=False, suspend_requested=False, image=None, submitted_at=at, queued_at=at, not_before=None, ended_at=None)
    policy = examples.model_copy(update={"jobs": examples.jobs.model_copy(update={"grace_seconds": 90,
                                                                                   "checkpoint_claim": "ckpt"})})
    assert JobSpec.from_job(job, policy, deprioritized=False) == JobSpec(
        job_id=JOB_ID, user="nora", team="nlp", profile="a100-mig-3g", command=("python", "-m", "train"),
        env={"LR": "0.1"}, workdir="/home/jovyan", max_restarts=2, preemptible=True, grace_seconds=90,
        checkpoint_claim="ckpt", checkpoint_mount="/checkpoints")
    placed = JobSpec.from_job(job.__class__(**{**job.__dict__, "checkpoint_dir": "/home/jovyan/ckpt"}), policy,
                              deprioritized=True)
    assert (placed.checkpoint_mount, placed.deprioritized) == ("/home/jovyan/ckpt", True)


# --- Volcano's status in gpupool's words ------------------------------------------------------------------------


def vcjob(phase: str | None = None, max_retry: int = 103, **status: Any) -> dict[str, Any]:
    state = {"phase": phase} if phase else {}
    return {"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job", "spec": {"maxRetry": max_retry},
            "status": {"state": state, **status} if phase or status else {}}


@pytest.mark.parametrize(("job", "expected"), [
    ({"metadata": {"name": "gpupool-job-x"}}, ("queued", 0, "not yet seen by Volcano's job controller")),
    (vcjob("Pending"), ("queued", 0, "waiting in Volcano's queue")),
    (vcjob("Running", running=1), ("running", 0, "running")),
    (vcjob("Restarting", retryCount=2, terminating=1), ("restarting", 2, "Volcano is replacing its pod (restart 2)")),
    (vcjob("Pending", retryCount=2), ("queued", 2, "waiting in Volcano's queue")),
    (vcjob("Completing", succeeded=1), ("succeeded", 0, "finished; Volcano is cleaning up")),
    (vcjob("Completed", succeeded=1, retryCount=1), ("succeeded", 1, "finished")),
    (vcjob("Failed", failed=1), ("failed", 0, "failed")),
    (vcjob("Failed", max_retry=103, retryCount=103),
     ("failed", 103, "Volcano gave up after 103 restarts (maxRetry 103)")),
    (vcjob("Terminated", failed=1), ("failed", 0, "failed with an exit code the policy never retries")),
    (vcjob("Terminating", terminating=1), ("cancelled", 0, "terminated by a command")),
    (vcjob("Terminated"), ("cancelled", 0, "terminated by a command")),
    (vcjob("Aborted", retryCount=1), ("suspended", 1, "suspended")),
    (vcjob("Aborting"), ("suspended", 0, "suspended")),
    ({"status": {"state": {"phase": "Running", "reason": "PodRunning", "message": "all good"}}},
     ("running", 0, "PodRunning; all good")),
])
def test_job_state_reads_volcanos_status(job, expected):
    assert job_state(job) == VolcanoJobState(*expected)


def test_every_phase_of_the_crd_has_a_state(crds):
    crd = yaml.safe_load((checks.VOLCANO_SCHEMAS / "batch.volcano.sh_jobs.yaml").read_text())
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    phases = status["properties"]["state"]["properties"]["phase"]["enum"]
    states = {job_state(vcjob(phase)).state for phase in phases}
    assert states == {"queued", "running", "restarting", "succeeded", "failed", "cancelled", "suspended"}
    assert "retryCount" in status["properties"] and "conditions" in status["properties"]


# --- bad input --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("changes", "message"), [
    ({"job_id": "Job_1"}, r"job id 'Job_1' cannot name a Volcano Job \(accepted: lower-case letters"),
    ({"job_id": "a" * 52}, r"at most 51 characters"),
    ({"profile": "nope"}, r"No such profile: 'nope'. Options include: cpu, h200-quarter, h200-mig-1g"),
    ({"profile": "k100-half"}, r"No such profile: 'k100-half'. Options include: .*h200-quarter"),  # not vision's
    ({"team": "physics"}, r"no team 'physics' in the policy \(teams: research, vision, nlp, students\)"),
    ({"image": "jax"}, r"No such image for h200-quarter: 'jax'. Options include: pytorch, tensorflow"),
    ({"user": "Alice!"}, r"user name"),
    ({"command": ()}, r"a job's command is its program and arguments"),
    ({"env": {"CUDA_DISABLE_CONTROL": "1"}}, r"CUDA_DISABLE_CONTROL is set by the platform"),
    ({"env": {"GPUPOOL_TEAM": "nlp"}}, r"GPUPOOL_TEAM is set by the platform"),
    ({"env": {"1X": "y"}}, r"'1X' is not an environment variable name"),
    ({"env": {"X": 1}}, r"the value of X is not a string"),
    ({"workdir": "work"}, r"working directory 'work' is not an absolute path"),
    ({"max_restarts": -1}, r"max_restarts is a whole number ≥ 0, not -1"),
    ({"grace_seconds": 1.5}, r"grace_seconds is a whole number ≥ 0, not 1.5"),
    ({"checkpoint_claim": "Claim"}, r"checkpoint claim 'Claim' is not a PersistentVolumeClaim name"),
    ({"checkpoint_claim": "c", "checkpoint_mount": "ckpt"}, r"checkpoint folder 'ckpt' is not an absolute path"),
])
def test_bad_input_is_refused_naming_what_is_accepted(examples, changes, message):
    with pytest.raises(ValueError, match=message):
        render(examples, **changes)


def test_a_bad_namespace_and_an_unknown_phase_are_refused(examples):
    with pytest.raises(ValueError, match=r"namespace 'Users' is not a DNS label"):
        volcano_job(spec(), examples, Release(), "Users", default_image=IMAGE)
    with pytest.raises(ValueError, match=r"unknown Volcano Job phase 'Inqueue' \(known: Pending, Running"):
        job_state(vcjob("Inqueue"))


def test_job_names_are_one_to_one_dns_labels():
    assert job_name(JOB_ID) == "gpupool-job-0123456789ab"
    assert job_name("a" * 51) == "gpupool-job-" + "a" * 51
    assert len({job_name(i) for i in ("a", "a-1", "a1")}) == 3


# --- how a run ended, read from its pod (gpupool.spawner.jobs.volcano_objects.pod_end) ---------------------------


def _pod(phase: str, *, exit_code: int | None = None, reason: str | None = None, disruption: str | None = None,
         preemptable: bool = False, finished: str | None = None, deleting: str | None = None) -> dict:
    """A job's pod; `deleting`: its deletionTimestamp, 60 s of grace after the deletion was asked for."""
    status: dict = {"phase": phase}
    if exit_code is not None:
        terminated = {"exitCode": exit_code, **({"finishedAt": finished} if finished else {})}
        status["containerStatuses"] = [{"name": "train", "state": {"terminated": terminated}}]
    if reason:
        status["reason"] = reason
    if disruption:
        status["conditions"] = [{"type": "DisruptionTarget", "status": "True", "reason": disruption}]
    metadata = {"annotations": {"volcano.sh/preemptable": "true" if preemptable else "false"}}
    if deleting:
        metadata.update(deletionTimestamp=deleting, deletionGracePeriodSeconds=60)
    return {"metadata": metadata, "status": status}


@pytest.mark.parametrize("pod, deleted, ended", [
    (_pod("Running"), False, None),
    (_pod("Pending"), False, None),
    (_pod("Succeeded", exit_code=0), False, Ended(Event.SUCCEEDED, 0)),
    (_pod("Failed", exit_code=3), False, Ended(Event.FAILED, 3)),
    (_pod("Failed", exit_code=137), False, Ended(Event.FAILED, 137)),
    # the kubelet's node-pressure eviction: the node's doing, never the job's failure
    (_pod("Failed", reason="Evicted"), False, Ended(Event.NODE_LOST, None)),
    (_pod("Failed", exit_code=143, disruption="PreemptionByScheduler"), False, Ended(Event.PREEMPTED, 143)),
    (_pod("Running", disruption="DeletionByTaintManager"), True, Ended(Event.NODE_LOST, None)),
    # deleted while it ran, no condition: Volcano's preemption of preemptable work, else the node
    (_pod("Running", preemptable=True), True, Ended(Event.PREEMPTED, None)),
    (_pod("Running"), True, Ended(Event.NODE_LOST, None)),
    # a pod that failed and was then deleted failed
    (_pod("Failed", exit_code=1), True, Ended(Event.FAILED, 1)),
    (_pod("Failed", exit_code=1, finished="2026-12-05T09:59:50Z", deleting="2026-12-05T10:01:00Z"), True,
     Ended(Event.FAILED, 1)),
    # the kubelet ended a deleted pod's container (SIGTERM: 143, or 0 after a checkpoint): the deletion did
    (_pod("Failed", exit_code=143, finished="2026-12-05T10:00:31Z", deleting="2026-12-05T10:01:00Z"), True,
     Ended(Event.NODE_LOST, 143)),
    (_pod("Succeeded", exit_code=0, finished="2026-12-05T10:00:31Z", deleting="2026-12-05T10:01:00Z",
          preemptable=True), False, Ended(Event.PREEMPTED, 0)),
])
def test_how_a_run_ended_is_read_from_its_pod(pod, deleted, ended):
    assert pod_end(pod, deleted=deleted) == ended


def test_a_run_is_billed_from_its_containers_start_also_when_first_seen_ended():
    running = {"status": {"phase": "Running", "startTime": "2026-12-05T10:00:00Z", "containerStatuses": [
        {"name": "train", "state": {"running": {"startedAt": "2026-12-05T10:00:07Z"}}}]}}
    assert running_since(running) == "2026-12-05T10:00:07Z"
    ended = {"status": {"phase": "Failed", "startTime": "2026-12-05T10:00:00Z", "containerStatuses": [
        {"name": "train", "state": {"terminated": {"exitCode": 1, "startedAt": "2026-12-05T10:00:05Z"}}}]}}
    assert running_since(ended) == "2026-12-05T10:00:05Z"
    assert running_since({"status": {"phase": "Pending", "startTime": "2026-12-05T10:00:00Z"}}) is None
    assert running_since({"status": {"phase": "Succeeded", "startTime": "2026-12-05T10:00:00Z"}}) == \
        "2026-12-05T10:00:00Z"


def test_a_jobs_priority_picks_its_teams_class_for_that_priority(examples):
    assert render(examples)["spec"]["priorityClassName"] == "gpupool-vision"  # normal: the notebooks' class
    low = render(examples, priority="low")
    assert low["spec"]["priorityClassName"] == template(low)["spec"]["priorityClassName"] == "gpupool-vision-low-jobs"
    # over budget, it is the lowest whatever it asked for
    assert render(examples, priority="low", deprioritized=True)["spec"]["priorityClassName"] == "gpupool-deprioritized"
    with pytest.raises(ValueError, match="may not use job priority 'high'"):
        render(examples, priority="high")  # vision's job_priorities are [low, normal]
    names = {c["metadata"]["name"] for c in priority_classes(examples, Release())}
    assert {"gpupool-vision", "gpupool-vision-low-jobs"} <= names


def test_a_team_whose_name_makes_another_teams_class_is_refused(examples):
    policy = examples.model_copy(deep=True)
    policy.teams["vision-low-jobs"] = policy.teams["nlp"].model_copy(update={"job_priorities": ["normal"]})
    with pytest.raises(ValueError, match="gpupool-vision-low-jobs"):
        priority_classes(policy, Release())
