"""GPUKubeSpawner without a cluster: rendered pods, queue explanations, and whole spawns over HTTP.

Everything is real except the Kubernetes API server: JupyterHub's own `User` and `Hub` objects build the
spawner from a real (in-memory) hub database, KubeSpawner renders and creates the pod, its reflectors watch
through real `kubernetes_asyncio` HTTP calls. The API server is `KubernetesAPIDouble` (tests/kube_double.py),
kmock's in-memory emulator over HTTP; the tests play Volcano and the kubelet by writing PodGroups, events and pod status into it
through the same client library.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import re
import shutil
import threading
import types
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from pathlib import Path

import kmock
import pytest
import pytest_asyncio
import yaml
from gpupool.hub.accounting import notify
from gpupool.hub.accounting.ledger import HowEnded, Ledger, State, run_key
from gpupool.policies import periods
from gpupool.policies import load_policy
from gpupool.spawner import podgroups
from gpupool.spawner.kube import (
    UPSTREAM_INTERNALS,
    GPUKubeSpawner,
    PodGroupReflector,
    policy_priorities,
    volcano_binding,
)
from gpupool.spawner.usage import get_ledger
from jupyterhub import orm
from kube_double import NAMESPACE, PODGROUPS, Cluster, KubernetesAPIDouble, forget_kube_clients, rfc3339
from jupyterhub.objects import Hub, Server
from jupyterhub.spawner import SpawnException
from jupyterhub.user import User
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.config import kube_config
from kubespawner import KubeSpawner
from tornado import web
from traitlets.config import Config

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "policies" / "examples"



@pytest.fixture(scope="module", autouse=True)
def kubeconfig(tmp_path_factory):
    """KubeSpawner loads a kubeconfig when not in a cluster; each spawner then points at its double by host."""
    path = tmp_path_factory.mktemp("kube") / "config"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "double",
        "clusters": [{"name": "double", "cluster": {"server": "http://127.0.0.1:9"}}],
        "users": [{"name": "nobody", "user": {}}],
        "contexts": [{"name": "double", "context": {"cluster": "double", "user": "nobody"}}],
    }))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KUBECONFIG", str(path))
        # kubernetes_asyncio reads KUBECONFIG once, at import, which happened before this fixture.
        patch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
        patch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield path


@pytest_asyncio.fixture(autouse=True)
async def fresh_reflectors():
    """Reflectors are class-level singletons bound to one event loop, and the client configuration is
    process-wide: each test starts and ends without either (`forget_kube_clients`)."""
    await forget_kube_clients()
    yield
    await forget_kube_clients()


@pytest.fixture(autouse=True)
def ledger(tmp_path, monkeypatch) -> Ledger:
    """The usage ledger the spawners admit against and record into (GPUPOOL_LEDGER_URL, as the chart sets)."""
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    monkeypatch.setenv("GPUPOOL_LEDGER_URL", url)
    return get_ledger(url)


@pytest_asyncio.fixture
async def cluster():
    async with KubernetesAPIDouble() as api, kmock.Server(api) as server:
        for plural in ("pods", "events", "nodes"):
            api.resources[f"v1/{plural}"] = {}
        api.resources["scheduling.volcano.sh/v1beta1/podgroups"] = {}
        url = str(server.url).rstrip("/")
        async with ApiClient(Configuration(host=url)) as client:
            yield Cluster(api, url, client)
        # Watches hold connections open: end them before the server, which waits for open requests.
        await forget_kube_clients()


# --- JupyterHub's real user and hub objects ------------------------------------------------------------------


class HubDB:
    """A real JupyterHub database (in memory) and the settings JupyterHub's `User` builds spawners from."""

    def __init__(self, config: Config):
        self.db = orm.new_session_factory("sqlite:///:memory:")()
        self.settings = {"spawner_class": GPUKubeSpawner, "config": config, "hub": Hub(), "base_url": "/",
                         "domain": ""}

    def user(self, name: str, groups: tuple[str, ...] = ()) -> User:
        orm_user = self.db.query(orm.User).filter_by(name=name).first()
        if orm_user is None:
            orm_user = orm.User(name=name)
            self.db.add(orm_user)
            for group_name in groups:
                group = self.db.query(orm.Group).filter_by(name=group_name).first() or orm.Group(name=group_name)
                orm_user.groups.append(group)
            self.db.commit()
        return User(orm_user, self.settings, self.db)

    def spawner(self, name: str, groups: tuple[str, ...] = ()) -> GPUKubeSpawner:
        """A new User wrapper and its spawner, as JupyterHub makes them (state loaded from the database)."""
        spawner = self.user(name, groups).spawners[""]
        spawner.api_token = "test-token"  # what User.spawn gives a starting server
        return spawner

    def save_state(self, spawner: GPUKubeSpawner) -> None:
        spawner.orm_spawner.state = spawner.get_state()
        self.db.commit()


def policy_copy(tmp_path: Path, queue_timeout: int, budgets: dict[str, int] | None = None) -> Path:
    """The example policy with the vision team's queue timeout shortened, so a test can reach it, and
    the GPU-hour budgets of some teams (`budgets`: team → GPU-hours) made small enough to exhaust."""
    directory = tmp_path / "policies"
    shutil.copytree(EXAMPLES, directory)
    teams = yaml.safe_load((directory / "teams.yaml").read_text())
    teams["teams"]["vision"]["queue"]["timeout_seconds"] = queue_timeout
    for team, hours in (budgets or {}).items():
        teams["teams"][team]["budget"]["gpu_hours"] = hours
        teams["teams"][team]["budget"].pop("per_model", None)
    (directory / "teams.yaml").write_text(yaml.safe_dump(teams, sort_keys=False, allow_unicode=True))
    return directory


def spawner_config(policy_dir: Path, host: str = "http://127.0.0.1:9", start_timeout: int = 30) -> Config:
    c = Config()
    c.GPUKubeSpawner.policy_dir = str(policy_dir)
    c.GPUKubeSpawner.namespace = NAMESPACE
    c.GPUKubeSpawner.k8s_api_host = host
    c.GPUKubeSpawner.cmd = ["jupyterhub-singleuser"]
    c.GPUKubeSpawner.start_timeout = start_timeout
    c.GPUKubeSpawner.queue_poll_interval = 0.05
    c.GPUKubeSpawner.k8s_api_request_retry_timeout = 5
    return c


# --- (a) the rendered pod for profiles of every backend -----------------------------------------------------

TOLERATE_NVIDIA = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]

MANIFESTS = {
    # HAMi fraction: one card, a quarter of its memory and cores, model pinned by HAMi's annotation and, for
    # any other scheduler, GPU feature discovery's label.
    ("alice", "vision", "h200-quarter", "tensorflow"): {
        "image": "quay.io/jupyter/tensorflow-notebook:cuda-2026-11-30",
        "limits": {"cpu": 8.0, "memory": 32 * 2**30, "nvidia.com/gpu": "1",
                   "nvidia.com/gpumem-percentage": "25", "nvidia.com/gpucores": "25"},
        "requests": {"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "25", "nvidia.com/gpucores": "25"},
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"}, "tolerations": TOLERATE_NVIDIA, "priorityClassName": "gpupool-vision",
        "annotations": {"nvidia.com/use-gputype": "H200", "scheduling.volcano.sh/queue-name": "vision",
                        "volcano.sh/preemptable": "false", "gpupool.io/share": "1/4"},
        "labels": {"gpupool.io/team": "vision", "gpupool.io/profile": "h200-quarter", "gpupool.io/gpu-model": "H200"},
        "env": {"GPUPOOL_TEAM": "vision", "GPUPOOL_PROFILE": "h200-quarter", "GPUPOOL_SHARE": "1/4",
                "GPUPOOL_GPU_MODEL": "H200", "GPUPOOL_IMAGE": "tensorflow"},
    },
    # MIG, mixed strategy: one resource per MIG profile, the model chosen by GPU feature discovery's label.
    ("alice", "vision", "h200-mig-1g", None): {
        "image": "quay.io/jupyterhub/singleuser:latest",
        "limits": {"nvidia.com/mig-1g.18gb": "1"}, "requests": {"nvidia.com/mig-1g.18gb": "1"},
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"}, "tolerations": TOLERATE_NVIDIA,
        "priorityClassName": "gpupool-vision",
        "annotations": {"scheduling.volcano.sh/queue-name": "vision", "volcano.sh/preemptable": "false",
                        "gpupool.io/share": "1/7"},
        "labels": {"gpupool.io/team": "vision", "gpupool.io/profile": "h200-mig-1g", "gpupool.io/gpu-model": "H200"},
        "env": {"GPUPOOL_TEAM": "vision", "GPUPOOL_PROFILE": "h200-mig-1g", "GPUPOOL_SHARE": "1/7",
                "GPUPOOL_GPU_MODEL": "H200"},
    },
    # MIG, single strategy: plain nvidia.com/gpu on nodes labelled with the MIG profile.
    ("nora", "nlp", "a100-mig-3g", None): {
        "image": "quay.io/jupyterhub/singleuser:latest",
        "limits": {"nvidia.com/gpu": "1"}, "requests": {"nvidia.com/gpu": "1"},
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB-MIG-3g.40gb"},
        "tolerations": TOLERATE_NVIDIA, "priorityClassName": "gpupool-nlp",
        "annotations": {"scheduling.volcano.sh/queue-name": "nlp", "volcano.sh/preemptable": "false",
                        "gpupool.io/share": "3/7"},
        "labels": {"gpupool.io/team": "nlp", "gpupool.io/profile": "a100-mig-3g", "gpupool.io/gpu-model": "A100-80GB"},
        "env": {"GPUPOOL_TEAM": "nlp", "GPUPOOL_PROFILE": "a100-mig-3g", "GPUPOOL_SHARE": "3/7",
                "GPUPOOL_GPU_MODEL": "A100-80GB"},
    },
    # Whole cards.
    ("alice", "vision", "h200-whole-2", None): {
        "image": "quay.io/jupyterhub/singleuser:latest",
        "limits": {"nvidia.com/gpu": "2"}, "requests": {"nvidia.com/gpu": "2"},
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"}, "tolerations": TOLERATE_NVIDIA,
        "priorityClassName": "gpupool-vision",
        "annotations": {"scheduling.volcano.sh/queue-name": "vision", "volcano.sh/preemptable": "false",
                        "gpupool.io/share": "2"},
        "labels": {"gpupool.io/team": "vision", "gpupool.io/profile": "h200-whole-2", "gpupool.io/gpu-model": "H200"},
        "env": {"GPUPOOL_TEAM": "vision", "GPUPOOL_PROFILE": "h200-whole-2", "GPUPOOL_SHARE": "2",
                "GPUPOOL_GPU_MODEL": "H200"},
    },
    # Time-slicing: one of the card's four advertised replicas.
    ("student1", "students", "rtx4090-quarter", None): {
        "image": "quay.io/jupyterhub/singleuser:latest",
        "limits": {"nvidia.com/gpu.shared": "1"}, "requests": {"nvidia.com/gpu.shared": "1"},
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-GeForce-RTX-4090"}, "tolerations": TOLERATE_NVIDIA,
        "priorityClassName": "gpupool-students",
        "annotations": {"scheduling.volcano.sh/queue-name": "students", "volcano.sh/preemptable": "false",
                        "gpupool.io/share": "1/4"},
        "labels": {"gpupool.io/team": "students", "gpupool.io/profile": "rtx4090-quarter",
                   "gpupool.io/gpu-model": "RTX4090"},
        "env": {"GPUPOOL_TEAM": "students", "GPUPOOL_PROFILE": "rtx4090-quarter", "GPUPOOL_SHARE": "1/4",
                "GPUPOOL_GPU_MODEL": "RTX4090"},
    },
    # Hygon DCU through HAMi: HAMi's Hygon resource names, memory in MiB, no NVIDIA toleration.
    ("nora", "nlp", "k100-half", None): {
        "image": "quay.io/jupyterhub/singleuser:latest",
        "limits": {"hygon.com/dcunum": "1", "hygon.com/dcumem": "32768", "hygon.com/dcucores": "50"},
        "requests": {"hygon.com/dcunum": "1", "hygon.com/dcumem": "32768", "hygon.com/dcucores": "50"},
        "nodeSelector": None, "tolerations": None, "priorityClassName": "gpupool-nlp",
        "annotations": {"hygon.com/use-dcutype": "K100", "scheduling.volcano.sh/queue-name": "nlp",
                        "volcano.sh/preemptable": "false", "gpupool.io/share": "1/2"},
        "labels": {"gpupool.io/team": "nlp", "gpupool.io/profile": "k100-half", "gpupool.io/gpu-model": "K100"},
        "env": {"GPUPOOL_TEAM": "nlp", "GPUPOOL_PROFILE": "k100-half", "GPUPOOL_SHARE": "1/2",
                "GPUPOOL_GPU_MODEL": "K100"},
    },
    # Volcano's vGPU, on a profile marked preemptible.
    ("nora", "nlp", "a100-quarter-vgpu", None): {
        "image": "quay.io/jupyterhub/singleuser:latest",
        "limits": {"volcano.sh/vgpu-number": "1", "volcano.sh/vgpu-memory": "20480", "volcano.sh/vgpu-cores": "25"},
        "requests": {"volcano.sh/vgpu-number": "1", "volcano.sh/vgpu-memory": "20480",
                     "volcano.sh/vgpu-cores": "25"},
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}, "tolerations": TOLERATE_NVIDIA,
        "priorityClassName": "gpupool-nlp",
        "annotations": {"scheduling.volcano.sh/queue-name": "nlp", "volcano.sh/preemptable": "true",
                        "gpupool.io/share": "1/4"},
        "labels": {"gpupool.io/team": "nlp", "gpupool.io/profile": "a100-quarter-vgpu",
                   "gpupool.io/gpu-model": "A100-80GB"},
        "env": {"GPUPOOL_TEAM": "nlp", "GPUPOOL_PROFILE": "a100-quarter-vgpu", "GPUPOOL_SHARE": "1/4",
                "GPUPOOL_GPU_MODEL": "A100-80GB"},
    },
    # CPU only: no GPU resources, still in the team's queue.
    ("student1", "students", "cpu", None): {
        "image": "quay.io/jupyterhub/singleuser:latest",
        "limits": {"cpu": 4.0, "memory": 8 * 2**30}, "requests": {},
        "nodeSelector": None, "tolerations": None, "priorityClassName": "gpupool-students",
        "annotations": {"scheduling.volcano.sh/queue-name": "students", "volcano.sh/preemptable": "false",
                        "gpupool.io/share": "0"},
        "labels": {"gpupool.io/team": "students", "gpupool.io/profile": "cpu"},
        "env": {"GPUPOOL_TEAM": "students", "GPUPOOL_PROFILE": "cpu", "GPUPOOL_SHARE": "0"},
    },
}

#: A user's teams: alice and nora by hub group (authenticator-managed teams), student1 by the policy's list.
GROUPS = {"alice": ("vision",), "nora": ("nlp",), "student1": ()}


async def serialized(pod) -> dict:
    """The pod as JSON, as kubernetes_asyncio sends it."""
    async with ApiClient() as client:
        return client.sanitize_for_serialization(pod)


def relevant(pod: dict) -> dict:
    """The parts of a sanitized pod gpupool decides, in the shape of MANIFESTS."""
    spec = pod["spec"]
    (notebook,) = [c for c in spec["containers"] if c["name"] == "notebook"]
    annotations = {k: v for k, v in pod["metadata"].get("annotations", {}).items()
                   if not k.startswith("hub.jupyter.org/")}
    return {
        "image": notebook["image"],
        "limits": notebook["resources"].get("limits"), "requests": notebook["resources"].get("requests"),
        "nodeSelector": spec.get("nodeSelector"), "tolerations": spec.get("tolerations"),
        "priorityClassName": spec.get("priorityClassName"), "annotations": annotations,
        "labels": {k: v for k, v in pod["metadata"]["labels"].items() if k.startswith("gpupool.io/")},
        # The team remote's DVC config is checked on its own (test_pod_gets_the_team_remote_and_its_secret).
        "env": {e["name"]: e["value"] for e in notebook["env"]
                if e["name"].startswith("GPUPOOL_") and e["name"] != "GPUPOOL_DVC_CONFIG"},
    }


@pytest.mark.parametrize(("key", "expected"), MANIFESTS.items(), ids=[k[2] for k in MANIFESTS])
@pytest.mark.asyncio
async def test_pod_manifest_for_each_backend(key, expected):
    user, _team, profile, image = key
    hub = HubDB(spawner_config(EXAMPLES))
    spawner = hub.spawner(user, GROUPS[user])
    options = {"profile": profile, **({"image": image} if image else {})}
    await spawner._run_apply_user_options(options)  # what User.spawn runs, turning errors into 400
    pod = await serialized(await spawner.get_pod_manifest())
    assert relevant(pod) == expected
    assert pod["spec"]["schedulerName"] == "volcano"
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert pod["metadata"]["annotations"]["hub.jupyter.org/username"] == user


@pytest.mark.asyncio
async def test_pod_gets_the_team_remote_and_its_secret():
    """The team's S3 keys come from its Secret as env; DVC's user-level config is written by a postStart hook."""
    config = spawner_config(EXAMPLES)
    config.GPUKubeSpawner.dataset_secret_name = "pool-datasets-{team}"
    spawner = HubDB(config).spawner("alice", GROUPS["alice"])
    await spawner._run_apply_user_options({"profile": "h200-quarter"})
    pod = await serialized(await spawner.get_pod_manifest())
    (notebook,) = [c for c in pod["spec"]["containers"] if c["name"] == "notebook"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in notebook["env"]}
    assert env["AWS_ACCESS_KEY_ID"] == {"secretKeyRef": {"name": "pool-datasets-vision", "key": "AWS_ACCESS_KEY_ID"}}
    assert env["AWS_SECRET_ACCESS_KEY"] == {"secretKeyRef": {"name": "pool-datasets-vision",
                                                             "key": "AWS_SECRET_ACCESS_KEY"}}
    assert env["DVC_GLOBAL_CONFIG_DIR"] == "/tmp/gpupool-dvc"
    assert env["GPUPOOL_DVC_CONFIG"] == ("[core]\nremote = vision\n[cache]\nshared = group\n['remote \"vision\"']\n"
                                         "url = s3://gpupool-vision/dvc\nendpointurl = https://s3.example.org\n")
    assert notebook["lifecycle"]["postStart"]["exec"]["command"][:2] == ["sh", "-c"]


@pytest.mark.asyncio
async def test_sanitizing_strips_cuda_disable_control_and_foreign_hami_annotations():
    c = spawner_config(EXAMPLES)
    # However they got there (a config section, a group override, a hook), these must not reach the pod.
    c.GPUKubeSpawner.environment = {"CUDA_DISABLE_CONTROL": "true", "KEEP_ME": "1"}
    c.GPUKubeSpawner.extra_annotations = {
        "hami.io/vgpu-devices-allocated": "GPU-0,NVIDIA,143360,100:;",
        "hami.io/bind-phase": "success",
        "scheduling.volcano.sh/queue-name": "nlp",  # another team's queue: the binding wins
        "example.org/kept": "yes",
    }
    c.GPUKubeSpawner.extra_containers = [{"name": "sidecar", "image": "busybox",
                                          "env": [{"name": "CUDA_DISABLE_CONTROL", "value": "1"}]}]
    c.GPUKubeSpawner.init_containers = [{"name": "init", "image": "busybox",
                                         "env": [{"name": "CUDA_DISABLE_CONTROL", "value": "1"},
                                                 {"name": "OTHER", "value": "2"}]}]
    spawner = HubDB(c).spawner("alice", ("vision",))
    await spawner._run_apply_user_options({"profile": "h200-quarter"})
    pod = await serialized(await spawner.get_pod_manifest())
    containers = pod["spec"]["containers"] + pod["spec"]["initContainers"]
    assert [c["name"] for c in containers] == ["notebook", "sidecar", "init"]
    assert not [e for c in containers for e in c.get("env") or [] if e["name"] == "CUDA_DISABLE_CONTROL"]
    assert {e["name"]: e["value"] for e in pod["spec"]["initContainers"][0]["env"]} == {"OTHER": "2"}
    assert {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}["KEEP_ME"] == "1"
    annotations = pod["metadata"]["annotations"]
    assert not [k for k in annotations if k.startswith("hami.io/")]
    assert annotations["scheduling.volcano.sh/queue-name"] == "vision"
    assert annotations["example.org/kept"] == "yes"
    assert annotations["nvidia.com/use-gputype"] == "H200"


@pytest.mark.asyncio
async def test_choices_do_not_leak_into_config_or_into_the_next_spawn():
    c = spawner_config(EXAMPLES)
    c.GPUKubeSpawner.extra_resource_limits = {"example.org/dongle": "1"}
    c.GPUKubeSpawner.node_selector = {"pool": "gpu"}
    hub = HubDB(c)
    spawner = hub.spawner("alice", ("vision",))
    await spawner._run_apply_user_options({"profile": "rtx4090-whole"})
    assert spawner.extra_resource_limits == {"example.org/dongle": "1", "nvidia.com/gpu": "1"}
    assert spawner.node_selector == {"pool": "gpu", "nvidia.com/gpu.product": "NVIDIA-GeForce-RTX-4090"}
    await spawner._run_apply_user_options({"profile": "h200-quarter"})
    pod = await serialized(await spawner.get_pod_manifest())
    assert relevant(pod)["limits"] == {"cpu": 8.0, "memory": 32 * 2**30, "example.org/dongle": "1",
                                       "nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "25",
                                       "nvidia.com/gpucores": "25"}
    # the whole-card profile's selector is gone
    assert pod["spec"]["nodeSelector"] == {"pool": "gpu", "nvidia.com/gpu.product": "NVIDIA-H200"}
    assert c.GPUKubeSpawner.extra_resource_limits == {"example.org/dongle": "1"}
    assert hub.spawner("bob", ("vision",)).extra_resource_limits == {"example.org/dongle": "1"}
    # A new spawn clears the state first (User.spawn does); a start that skips apply_user_options (an
    # admin's own hook replaced it) checks its own user_options instead of reusing the last choice.
    spawner.clear_state()
    spawner.user_options = {"profile": "cpu"}
    pod = await serialized(await spawner.get_pod_manifest())
    assert relevant(pod)["limits"] == {"cpu": 4.0, "memory": 8 * 2**30, "example.org/dongle": "1"}
    assert relevant(pod)["labels"]["gpupool.io/profile"] == "cpu"


@pytest.mark.asyncio
async def test_deprioritized_work_runs_as_lowest_priority_preemptable():
    spawner = HubDB(spawner_config(EXAMPLES)).spawner("alice", ("vision",))
    await spawner._run_apply_user_options({"profile": "h200-quarter"})
    spawner.gpupool_deprioritized = True  # decided after apply_user_options, e.g. by a pre-spawn hook
    pod = await serialized(await spawner.get_pod_manifest())
    assert pod["spec"]["priorityClassName"] == "gpupool-deprioritized"
    assert pod["metadata"]["annotations"]["volcano.sh/preemptable"] == "true"
    assert pod["metadata"]["annotations"]["scheduling.volcano.sh/queue-name"] == "vision"


def test_volcano_binding_names():
    assert volcano_binding("vision", preemptible=False, deprioritized=False).__dict__ == {
        "scheduler_name": "volcano", "priority_class_name": "gpupool-vision",
        "annotations": {"scheduling.volcano.sh/queue-name": "vision", "volcano.sh/preemptable": "false"}}
    assert volcano_binding("nlp", preemptible=True, deprioritized=False).annotations["volcano.sh/preemptable"] == "true"
    assert volcano_binding("nlp", preemptible=False, deprioritized=True).priority_class_name == "gpupool-deprioritized"
    assert policy_priorities(load_policy(EXAMPLES)) == {
        "gpupool-research": 100, "gpupool-vision": 100, "gpupool-nlp": 80, "gpupool-students": 10,
        # the teams' low-priority jobs (job_priorities [low, normal]): 10 under their notebooks, never below 0
        "gpupool-research-low-jobs": 90, "gpupool-vision-low-jobs": 90, "gpupool-nlp-low-jobs": 70,
        "gpupool-students-low-jobs": 0, "gpupool-deprioritized": -1}


@pytest.mark.asyncio
async def test_default_form_is_the_mixins():
    spawner = HubDB(spawner_config(EXAMPLES)).spawner("nora", ("nlp",))
    form = await spawner.get_options_form()
    assert '<input type="radio" name="profile" value="a100-half-hami"> <strong>0.5 × A100 (HAMi)</strong>' in form
    assert 'value="h200-whole-2"' not in form
    options = spawner.options_from_form({"profile": ["h200-quarter"], "image-h200-quarter": ["tensorflow"]})
    assert options == {"profile": "h200-quarter", "image": "tensorflow"}


@pytest.mark.asyncio
async def test_kubespawner_form_is_filled_from_policy_and_checked_by_the_mixin():
    c = spawner_config(EXAMPLES)
    c.GPUKubeSpawner.profile_form = "kubespawner"
    spawner = HubDB(c).spawner("nora", ("nlp",))
    form = await spawner.get_options_form()
    assert "0.5 × A100 (HAMi)" in form and "MIG 1g.18gb (H200)" in form
    assert "2 × H200" not in form  # vision's profile: not offered to nlp
    # What KubeSpawner's form posts for a profile with an image option.
    options = spawner.options_from_form({"profile": ["h200-quarter"], "profile-option-h200-quarter--image": ["tensorflow"]})
    assert options == {"profile": "h200-quarter", "image": "tensorflow"}
    await spawner._run_apply_user_options(options)
    assert spawner.image == "quay.io/jupyter/tensorflow-notebook:cuda-2026-11-30"
    with pytest.raises(web.HTTPError) as refused:
        await spawner._run_apply_user_options({"profile": "h200-quarter", "image--unlisted-choice": "evil:latest"})
    assert refused.value.status_code == 400


@pytest.mark.asyncio
async def test_profile_list_is_built_per_user_from_policy_without_overrides():
    hub = HubDB(spawner_config(EXAMPLES))
    student = hub.spawner("student1")
    assert student.profile_list(student) == [
        {"slug": "cpu", "display_name": "CPU only", "description": "", "default": True},
        {"slug": "h200-mig-1g", "display_name": "MIG 1g.18gb (H200)", "description": "", "default": False},
        {"slug": "rtx4090-quarter", "display_name": "0.25 × RTX 4090 (time-sliced)",
         "description": "Time-sliced, no memory isolation between the four users of a card", "default": False},
        {"slug": "rtx4090-whole", "display_name": "1 × RTX 4090", "description": "", "default": False},
    ]
    alice = hub.spawner("alice", ("vision",))
    quarter = next(p for p in alice.profile_list(alice) if p["slug"] == "h200-quarter")
    assert quarter["profile_options"] == {"image": {"display_name": "Image", "choices": {
        "pytorch": {"display_name": "PyTorch", "default": True},
        "tensorflow": {"display_name": "TensorFlow", "default": False}}}}
    assert "kubespawner_override" not in repr(alice.profile_list(alice))


# --- queue explanation (pure, table-driven) -------------------------------------------------------------------

QUARTER = podgroups.Wanted("0.25 × H200", "vision", "H200", "0.25",
                           frozenset({"nvidia.com/gpu", "nvidia.com/gpumem-percentage", "nvidia.com/gpucores"}))
MIG = podgroups.Wanted("MIG 1g.18gb", "nlp", "H200", "a MIG 1g.18gb slice", frozenset({"nvidia.com/mig-1g.18gb"}))
CPU = podgroups.Wanted("CPU only", "students")


@pytest.mark.parametrize(("messages", "wanted", "phase", "words"), [
    (["Unschedulable: queue resource quota insufficient"], QUARTER, "Pending",
     'team queue "vision" is at its capability'),
    (["Unschedulable: queue resource quota insufficient: insufficient nvidia.com/gpu"], QUARTER, "Pending",
     'team queue "vision" is at its capability'),
    (["NotInqueueable: job is not inqueue"], MIG, "Pending", 'team queue "nlp" is at its capability'),
    # Enqueued since: the old enqueue rejection no longer explains anything.
    (["Unschedulable: queue resource quota insufficient"], QUARTER, "Inqueue",
     "the scheduler says: Unschedulable: queue resource quota insufficient"),
    (["FailedScheduling: 0/3 nodes are unavailable: 3 Insufficient nvidia.com/gpu."], QUARTER, "Inqueue",
     "no H200 has 0.25 free"),
    ([("Unschedulable: all nodes are unavailable: 1 Insufficient nvidia.com/mig-1g.18gb, "
       "2 node(s) didn't match Pod's node affinity/selector.")], MIG, "Inqueue",
     "no H200 has a MIG 1g.18gb slice free"),
    (["FilteringFailed: 3 nodes CardInsufficientMemory(node-a,node-b,node-c)"], QUARTER, "Inqueue",
     "no H200 has 0.25 free"),
    (["FilteringFailed: 2 nodes CardTimeSlicingExhausted(node-d,node-e)"], QUARTER, "Inqueue", "no H200 has 0.25 free"),
    (["FailedScheduling: 0/2 nodes are unavailable: 2 Insufficient cpu."], QUARTER, "Inqueue",
     "no node has the CPUs it asks for free"),
    (["FailedScheduling: 0/2 nodes are unavailable: 1 Insufficient memory, 1 Insufficient cpu."], CPU, "Inqueue",
     "no node has the CPUs it asks for free"),
    (["FailedScheduling: 0/2 nodes are unavailable: 2 node(s) had untolerated taint {dedicated: infra}."], QUARTER,
     "Inqueue", "the nodes with room carry taints this profile does not tolerate"),
    (["FailedScheduling: 0/4 nodes are unavailable: 4 node(s) didn't match Pod's node affinity/selector."], MIG,
     "Inqueue", "no node with a H200 can take it"),
    (["Unschedulable: queue vision is closed"], QUARTER, "Pending", 'queue "vision" is closed or missing; ask an '
     'administrator (for an administrator: `kubectl get queue vision` shows it; `helm upgrade` with the policies '
     'makes it again)'),
    (["FilteringFailed: 1 nodes ResourceQuotaNotFit(node-a)"], QUARTER, "Inqueue", "the namespace's GPU quota is used up"),
    (["FailedScheduling: 0/3 nodes are unavailable: 3 node(s) were unschedulable."], CPU, "Inqueue",
     "nodes are cordoned or not ready"),
    # The best explanation wins whatever the order: GPU shortage over a selector mismatch on other nodes.
    (["FailedScheduling: 0/5 nodes are unavailable: 3 node(s) didn't match Pod's node affinity/selector.",
      "FailedScheduling: 0/5 nodes are unavailable: 2 Insufficient nvidia.com/gpu."], QUARTER, "Inqueue",
     "no H200 has 0.25 free"),
    # Insufficient of a resource this profile does not hold is not a GPU shortage.
    (["FailedScheduling: 0/1 nodes are unavailable: 1 Insufficient example.com/fpga."], QUARTER, "Inqueue",
     "the scheduler says: FailedScheduling: 0/1 nodes are unavailable: 1 Insufficient example.com/fpga."),
    # Gang boilerplate says nothing: fall back to what the phase means.
    ([("NotEnoughResources: 1/1 tasks in gang unschedulable: pod group is not ready, 1 Pending, 1 minAvailable; "
       "Pending: 1 Unschedulable")], QUARTER, "Inqueue", "admitted by the queue, waiting for a node with room"),
    ([], QUARTER, "Pending", "waiting for the queue to admit it"),
    ([], QUARTER, None, "waiting for Volcano to take it into the queue"),
])
def test_explain_translates_scheduler_messages(messages, wanted, phase, words):
    assert podgroups.explain(messages, wanted, phase) == words


def test_explain_shortens_unknown_messages():
    words = podgroups.explain(["Weird: " + "x" * 400], QUARTER, "Inqueue")
    assert words.startswith("the scheduler says: Weird: xxx") and words.endswith("…")
    assert len(words) == len("the scheduler says: ") + podgroups.RAW_LIMIT


def pg(name, queue="vision", phase="Inqueue", created="2026-01-01T00:00:00Z", cls="gpupool-vision", uid=None):
    return {"metadata": {"name": name, "namespace": NAMESPACE, "creationTimestamp": created, "uid": uid or name},
            "spec": {"queue": queue, "priorityClassName": cls}, "status": {"phase": phase}}


PRIORITIES = {"gpupool-vision": 100, "gpupool-nlp": 80, "gpupool-deprioritized": -1}


@pytest.mark.parametrize(("groups", "mine", "expected"), [
    # Older first within one priority; other queues and running groups do not count.
    ([pg("a", created="2026-01-01T00:00:01Z"), pg("me", created="2026-01-01T00:00:02Z"),
      pg("b", created="2026-01-01T00:00:03Z"), pg("n", queue="nlp", created="2026-01-01T00:00:00Z"),
      pg("r", phase="Running", created="2026-01-01T00:00:00Z")], "me", (2, 3)),
    # Priority before age: deprioritized work waits behind newer work of the team.
    ([pg("old-low", cls="gpupool-deprioritized", created="2026-01-01T00:00:00Z", phase="Pending"),
      pg("me", created="2026-01-01T00:00:05Z")], "me", (1, 2)),
    # Same time: uid decides, as in Volcano.
    ([pg("x", uid="b"), pg("me", uid="a")], "me", (1, 2)),
    # A group without status has not been looked at yet: it waits too.
    ([{"metadata": {"name": "new", "creationTimestamp": "2026-01-01T00:00:00Z"}, "spec": {"queue": "vision", "priorityClassName": "gpupool-vision"}},
      pg("me", created="2026-01-01T00:00:01Z")], "me", (2, 2)),
    # A group without a known PriorityClass counts as priority 0: behind the team's own.
    ([pg("classless", cls=None), pg("me", created="2026-01-01T00:00:05Z")], "me", (1, 2)),
    ([pg("me", phase="Running")], "me", None),
    ([pg("other")], "me", None),
])
def test_queue_position_follows_volcano_order(groups, mine, expected):
    assert podgroups.queue_position(groups, mine, "vision", PRIORITIES) == expected


@pytest.mark.parametrize(("pod", "group", "expected"), [
    ({"spec": {}, "status": {"phase": "Pending"}}, pg("g", phase="Inqueue"), False),
    ({"spec": {}, "status": {"phase": "Pending"}}, None, False),
    ({"spec": {"nodeName": "n1"}, "status": {"phase": "Pending"}}, pg("g", phase="Inqueue"), True),
    ({"spec": {}, "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]}},
     None, True),
    ({"spec": {}, "status": {"phase": "Pending"}}, pg("g", phase="Running"), True),
    ({"spec": {}, "status": {"phase": "Running"}}, None, True),
    (None, None, False),
])
def test_admitted(pod, group, expected):
    assert podgroups.admitted(pod, group) is expected


def test_scheduling_messages_gathers_conditions_and_own_events_newest_first():
    pod = {"metadata": {"name": "jupyter-alice", "uid": "u1"},
           "status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                      "message": "0/1 nodes are unavailable: 1 Insufficient cpu."}]}}
    group = {"metadata": {"name": "podgroup-u1", "uid": "g1"},
             "status": {"conditions": [{"type": "Unschedulable", "status": "True", "reason": "NotEnoughResources",
                                        "message": "pod group is not ready"}]}}
    events = [
        {"involvedObject": {"kind": "PodGroup", "name": "podgroup-u1", "uid": "g1"}, "reason": "Unschedulable",
         "message": "queue resource quota insufficient", "lastTimestamp": "2026-01-01T00:00:02Z"},
        {"involvedObject": {"kind": "Pod", "name": "jupyter-alice", "uid": "u1"}, "reason": "FailedScheduling",
         "message": "older", "lastTimestamp": "2026-01-01T00:00:01Z"},
        # Same name, earlier pod (other uid), and someone else's pod: not ours.
        {"involvedObject": {"kind": "Pod", "name": "jupyter-alice", "uid": "old"}, "reason": "X", "message": "stale",
         "lastTimestamp": "2026-01-01T00:00:03Z"},
        {"involvedObject": {"kind": "Pod", "name": "jupyter-bob", "uid": "u2"}, "reason": "X", "message": "bob's",
         "lastTimestamp": "2026-01-01T00:00:03Z"},
    ]
    assert podgroups.scheduling_messages(pod, group, events) == [
        "Unschedulable: queue resource quota insufficient", "FailedScheduling: older",
        "NotEnoughResources: pod group is not ready", "Unschedulable: 0/1 nodes are unavailable: 1 Insufficient cpu.",
    ]


def node(name, labels, allocatable):
    return {"metadata": {"name": name, "labels": labels}, "status": {"allocatable": allocatable}}


H200_NODE = node("h1", {"nvidia.com/gpu.product": "NVIDIA-H200"}, {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "1"})
A100_NODE = node("a1", {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}, {"cpu": "32", "nvidia.com/gpu": "8"})


@pytest.mark.parametrize(("requests", "selector", "nodes", "expected"), [
    ({"nvidia.com/gpu": "2"}, {"nvidia.com/gpu.product": "NVIDIA-H200"}, [H200_NODE, A100_NODE],
     ("2 × H200 can never start on this cluster: it asks for 2 nvidia.com/gpu and the largest node "
      "(nvidia.com/gpu.product=NVIDIA-H200) offers 1")),
    ({"nvidia.com/gpu": "1"}, {"nvidia.com/gpu.product": "NVIDIA-H200"}, [H200_NODE, A100_NODE], None),
    ({"cpu": 128.0}, {}, [H200_NODE, A100_NODE],
     "2 × H200 can never start on this cluster: it asks for 128.0 cpu and the largest node (any) offers 64"),
    ({"memory": 2**40}, {}, [H200_NODE], ("2 × H200 can never start on this cluster: it asks for "
                                          f"{2**40} memory and the largest node (any) offers 512Gi")),
    # HAMi's memory percentage is not a node resource: HAMi judges it, not this check.
    ({"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "25"}, {}, [H200_NODE], None),
    # No node of that model at all: perhaps an autoscaler adds one; wait in the queue instead.
    ({"nvidia.com/gpu": "2"}, {"nvidia.com/gpu.product": "NVIDIA-B200"}, [H200_NODE, A100_NODE], None),
    ({"nvidia.com/gpu": "2"}, {}, [], None),
])
def test_never_fits(requests, selector, nodes, expected):
    assert podgroups.never_fits(requests, selector, nodes, "2 × H200") == expected


def test_waiting_message_wording():
    assert podgroups.waiting_message(QUARTER, (2, 3), "no H200 has 0.25 free") == (
        'Waiting for 0.25 × H200: position 2 of 3 in queue "vision" (no H200 has 0.25 free)')
    assert podgroups.waiting_message(QUARTER, None, "waiting for Volcano to take it into the queue") == (
        'Waiting for 0.25 × H200 in queue "vision" (waiting for Volcano to take it into the queue)')


# --- (b) whole spawns against the API double -------------------------------------------------------------------


async def collect(progress, into: list) -> None:
    async for event in progress:
        into.append(event)


async def wait_for_message(events: list, pattern: str, timeout: float = 10) -> str:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        for event in events:
            if re.search(pattern, event.get("message", "")):
                return event["message"]
        await asyncio.sleep(0.02)
    raise AssertionError(f"no progress message matching {pattern!r} in {[e.get('message') for e in events]}")


def begin_spawn(hub: HubDB, spawner: GPUKubeSpawner) -> tuple[asyncio.Future, list, asyncio.Task]:
    """What User.spawn does around Spawner.start: a server, the start under start_timeout, and progress."""
    orm_server = orm.Server(base_url=f"/user/{spawner.user.name}/")
    hub.db.add(orm_server)
    hub.db.commit()
    spawner.server = Server(orm_server=orm_server)
    spawner.orm_spawner.started = datetime.now(UTC).replace(tzinfo=None)  # User.spawn, before start()
    spawner._spawn_pending = spawner._start_pending = True  # the spawn handler's and User.spawn's flags
    started = asyncio.ensure_future(asyncio.wait_for(spawner.start(), timeout=spawner.start_timeout))
    events: list = []
    progress = asyncio.ensure_future(collect(spawner._generate_progress(), events))
    return started, events, progress


@pytest.mark.asyncio
async def test_spawn_waits_in_queue_with_position_then_runs_stops_and_survives_restart(
        cluster, tmp_path, ledger, monkeypatch):
    c = spawner_config(policy_copy(tmp_path, queue_timeout=30), cluster.url, start_timeout=2)

    def modify_pod_hook(spawner, pod):
        # Runs after get_pod_manifest(); the pod sent to the API server is sanitized once more.
        pod.metadata.annotations["hami.io/vgpu-devices-to-allocate"] = "GPU-0,NVIDIA,143360,100:;"
        pod.spec.containers[0].env.append({"name": "CUDA_DISABLE_CONTROL", "value": "true"})
        return pod

    c.GPUKubeSpawner.modify_pod_hook = modify_pod_hook
    hub = HubDB(c)
    spawner = hub.spawner("alice", ("vision",))
    await spawner._run_apply_user_options({"profile": "h200-quarter"})
    assert spawner.start_timeout == 2 + 30 + 5  # start timeout + vision's queue timeout + creation margin
    clock = asyncio.get_running_loop().time
    began = clock()
    began_utc = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=3)
    started, events, progress = begin_spawn(hub, spawner)

    # Volcano's part: wrap the new pod in its PodGroup, behind an older one of the same queue.
    pod = await cluster.pod_named(spawner.pod_name)
    assert pod["metadata"]["annotations"]["scheduling.volcano.sh/queue-name"] == "vision"
    assert not [k for k in pod["metadata"]["annotations"] if k.startswith("hami.io/")]
    assert not [e for e in pod["spec"]["containers"][0]["env"] if e["name"] == "CUDA_DISABLE_CONTROL"]
    uid = pod["metadata"]["uid"]
    mine = podgroups.podgroup_name(uid)
    now = datetime.now(UTC)
    await cluster.podgroup("podgroup-ahead", "vision", "gpupool-vision", "2026-01-01T00:00:00Z", "Inqueue")
    await cluster.podgroup("podgroup-low", "vision", "gpupool-deprioritized", "2026-01-01T00:00:00Z", "Pending")
    await cluster.podgroup("podgroup-nlp", "nlp", "gpupool-nlp", "2026-01-01T00:00:00Z", "Pending")
    await cluster.podgroup("podgroup-running", "vision", "gpupool-vision", "2026-01-01T00:00:00Z", "Running")
    await cluster.podgroup(mine, "vision", "gpupool-vision", rfc3339(now), "Pending")
    group_uid = cluster.object("podgroups", mine, *PODGROUPS)["metadata"]["uid"]
    await cluster.event("PodGroup", mine, group_uid, "Unschedulable", "queue resource quota insufficient")
    message = await wait_for_message(events, r"team queue")
    assert message == ('Waiting for 0.25 × H200 (HAMi): position 2 of 3 in queue "vision" '
                       '(team queue "vision" is at its capability)')
    assert [e.get("reason") for e in events if e["message"] == message] == ["volcano-pending"]

    # Enqueued, but no H200 has room: the reason follows.
    await cluster.set_podgroup_status(mine, {"phase": "Inqueue", "conditions": [{
        "type": "Unschedulable", "status": "True", "reason": "NotEnoughResources",
        "message": "1/1 tasks in gang unschedulable: pod group is not ready, 1 Pending, 1 minAvailable"}]})
    await cluster.event("Pod", spawner.pod_name, uid, "FailedScheduling",
                        "0/2 nodes are unavailable: 2 Insufficient nvidia.com/gpu.")
    message = await wait_for_message(events, r"no H200")
    assert message == 'Waiting for 0.25 × H200 (HAMi): position 2 of 3 in queue "vision" (no H200 has 0.25 free)'

    # Queued longer than start_timeout (2 s): only the queue timeout applies until admission.
    while clock() - began < 3:
        await asyncio.sleep(0.05)
    assert not started.done()
    # Waiting in Volcano's queue is not usage: the share is held (reserved at admission), not billed.
    (held,) = ledger.open_intervals()
    assert (held.run, held.state) == (run_key("alice", "", spawner.orm_spawner.started), State.RESERVED)
    assert ledger.gpu_hours(periods.period_of(periods.utcnow())) == {}

    # Admitted and running: the kubelet's part.
    await cluster.set_podgroup_status(mine, {"phase": "Running", "conditions": []})
    await cluster.run_pod(spawner.pod_name)
    url = await started
    assert url == "http://127.0.0.1:8888"
    running = ledger.open_intervals()
    assert spawner.usage_run == run_key("alice", "", spawner.orm_spawner.started)  # the service's key too
    assert [(i.run, i.user, i.team, i.profile, i.model, i.share) for i in running] == [
        (spawner.usage_run, "alice", "vision", "h200-quarter", "H200", Fraction(1, 4))]
    assert running[0].start >= began_utc  # from Running: the 3 s in Volcano's queue are not usage
    assert running[0].state is State.RUNNING and running[0].start >= held.start + timedelta(seconds=3)
    assert running[0].queue_wait >= timedelta(seconds=3)
    await asyncio.wait_for(progress, 5)  # progress ends with the start
    assert any("admitted by queue" in e.get("message", "") for e in events)
    assert any("[Warning] 0/2 nodes are unavailable" in e.get("message", "") for e in events)  # KubeSpawner's own
    spawner._spawn_pending = spawner._start_pending = False
    assert await spawner.poll() is None

    # Hub restart: a new process has no reflectors and builds spawners from the database.
    hub.save_state(spawner)
    await KubeSpawner._stop_all_reflectors()
    again = hub.spawner("alice")
    assert again is not spawner
    assert again.pod_name == spawner.pod_name and again.gpupool_choice.slug == "h200-quarter"
    assert again.gpupool_choice.team == "vision"
    assert again.usage_run == spawner.usage_run
    later = running[0].start + timedelta(minutes=10)
    monkeypatch.setattr(periods, "utcnow", lambda: later)
    assert await again.poll() is None
    assert ledger.open_intervals()[0].last_seen == later  # the heartbeat

    await again.stop()
    assert cluster.object("pods", spawner.pod_name) is None
    assert await again.poll() == 1
    ended = ledger.interval(running[0].key)
    assert ended.how == HowEnded.STOPPED and ended.end == later and ledger.open_intervals() == []


@pytest.mark.asyncio
async def test_a_wait_cancelled_before_the_first_load_leaves_the_shared_reflector_for_the_next_spawn(cluster, tmp_path):
    # Seen against the real API server: a pod ran before the PodGroup reflector's first list was in, the spawn
    # cancelled its queue watch, and the cancellation reached the reflector's shared first-load future: every
    # later spawn of the hub then failed with CancelledError.
    hub = HubDB(spawner_config(EXAMPLES, cluster.url))
    spawner = hub.spawner("alice", ("vision",))
    loading = asyncio.get_running_loop().create_future()
    reflector = types.SimpleNamespace(first_load_future=loading)
    key = spawner._get_reflector_key("podgroups")
    GPUKubeSpawner.reflectors[key] = reflector
    try:
        first = asyncio.ensure_future(spawner._gpupool_reflector("podgroups", PodGroupReflector))
        await asyncio.sleep(0)
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first
        assert not loading.cancelled()
        second = asyncio.ensure_future(hub.spawner("bob", ("vision",))._gpupool_reflector("podgroups",
                                                                                         PodGroupReflector))
        loading.set_result(None)  # the first list arrives
        assert await second is reflector
    finally:
        GPUKubeSpawner.reflectors.pop(key, None)


@pytest.mark.asyncio
async def test_a_spawn_cancelled_while_its_reflector_starts_leaves_none_half_started(cluster, tmp_path):
    hub = HubDB(spawner_config(EXAMPLES, cluster.url))
    spawner = hub.spawner("alice", ("vision",))
    listing = asyncio.Event()

    class SlowReflector:  # a double of a reflector whose first list does not come back
        def __init__(self, **kwargs):
            self.first_load_future = asyncio.get_running_loop().create_future()

        async def start(self):
            listing.set()
            await asyncio.Event().wait()

    key = spawner._get_reflector_key("podgroups")
    first = asyncio.ensure_future(spawner._gpupool_reflector("podgroups", SlowReflector))
    await listing.wait()
    half = GPUKubeSpawner.reflectors[key]
    first.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await first
    try:
        assert key not in GPUKubeSpawner.reflectors  # the next spawn starts a reflector of its own
        assert isinstance(half.first_load_future.exception(), RuntimeError)  # and nobody waits on this one for ever
    finally:
        GPUKubeSpawner.reflectors.pop(key, None)


@pytest.mark.asyncio
async def test_bad_choices_are_refused_with_400_before_any_api_call(cluster, tmp_path):
    hub = HubDB(spawner_config(EXAMPLES, cluster.url))
    spawner = hub.spawner("alice", ("vision",))
    for options, words in [
        ({"profile": "a100-whole"}, "No such profile: 'a100-whole'. Options include: cpu, h200-quarter"),
        ({"profile": "h200-quarter", "extra_resource_limits": {"nvidia.com/gpu": "8"}},
         "Unknown user option(s): extra_resource_limits"),
        ({"profile": "h200-quarter", "team": "nlp"}, "Team 'nlp' cannot be charged for h200-quarter"),
        ({"profile": "h200-quarter", "image": "docker.io/evil:latest"}, "No such image for h200-quarter"),
    ]:
        with pytest.raises(web.HTTPError) as refused:
            await spawner._run_apply_user_options(options)
        assert refused.value.status_code == 400
        assert words in refused.value.log_message
    # Even a start that skipped apply_user_options checks first, and still calls nothing.
    spawner.user_options = {"profile": "a100-whole"}
    spawner.gpupool_choice = None
    with pytest.raises(web.HTTPError) as refused:
        await spawner.start()
    assert refused.value.status_code == 400
    assert cluster.requests() == []


@pytest.mark.asyncio
async def test_profile_no_node_can_hold_fails_fast_without_a_pod(cluster, tmp_path):
    await cluster.core.create_node({"metadata": {"name": "h200-1", "labels": {"nvidia.com/gpu.product": "NVIDIA-H200"}},
                                    "status": {"allocatable": {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "1"}}})
    spawner = HubDB(spawner_config(EXAMPLES, cluster.url)).spawner("alice", ("vision",))
    await spawner._run_apply_user_options({"profile": "h200-whole-2"})
    with pytest.raises(web.HTTPError) as failed:
        await spawner.start()
    assert (failed.value.status_code, failed.value.reason) == (409, "never-fits-pool")
    assert failed.value.log_message == ("2 × H200 can never start on this cluster: it asks for 2 nvidia.com/gpu and "
                                        "the largest node (nvidia.com/gpu.product=NVIDIA-H200) offers 1")
    requests = [(r.method, r.url.path) for r in cluster.requests()]
    assert ("GET", "/api/v1/nodes") in requests
    assert not [path for _method, path in requests if "pods" in path]  # no pod, not even a pod reflector


@pytest.mark.asyncio
async def test_queue_timeout_from_policy_ends_the_wait(cluster, tmp_path):
    # Volcano never takes the pod into its queue (no PodGroup): whenever the 1 s ends, on a loaded machine too,
    # the wait is for that, and it says so.
    c = spawner_config(policy_copy(tmp_path, queue_timeout=1), cluster.url)
    c.GPUKubeSpawner.events_enabled = False  # the queue is still explained without KubeSpawner's events
    hub = HubDB(c)
    spawner = hub.spawner("alice", ("vision",))
    await spawner._run_apply_user_options({"profile": "h200-quarter"})
    started, events, progress = begin_spawn(hub, spawner)
    with pytest.raises(web.HTTPError) as timed_out:
        await started
    assert (timed_out.value.status_code, timed_out.value.reason) == (503, "queue-timeout")
    assert timed_out.value.log_message == (
        '0.25 × H200 (HAMi) waited 1 seconds in queue "vision" without a place (waiting for Volcano to take it into '
        "the queue); try again later or pick a smaller profile")
    await asyncio.wait_for(progress, 5)
    await spawner.stop(now=True)  # what the hub does after a failed start
    assert cluster.object("pods", spawner.pod_name) is None


@pytest.mark.asyncio
async def test_start_timeout_counts_from_admission(cluster, tmp_path):
    hub = HubDB(spawner_config(policy_copy(tmp_path, queue_timeout=30), cluster.url, start_timeout=1))
    spawner = hub.spawner("alice", ("vision",))
    await spawner._run_apply_user_options({"profile": "h200-quarter"})
    started, _events, progress = begin_spawn(hub, spawner)
    pod = await cluster.pod_named(spawner.pod_name)
    await cluster.core.patch_namespaced_pod(spawner.pod_name, NAMESPACE, {"spec": {"nodeName": "gpu-node-1"}})
    began = asyncio.get_running_loop().time()
    with pytest.raises(TimeoutError, match=r'admitted by queue "vision" but did not start within 1 seconds'):
        await started
    assert asyncio.get_running_loop().time() - began < 10  # far below the hub-facing 36 s
    await asyncio.wait_for(progress, 5)
    assert pod is not None
    await spawner.stop(now=True)


@pytest.mark.asyncio
async def test_stopping_a_waiting_spawn_ends_the_wait(cluster, tmp_path):
    hub = HubDB(spawner_config(policy_copy(tmp_path, queue_timeout=30), cluster.url))
    spawner = hub.spawner("alice", ("vision",))
    await spawner._run_apply_user_options({"profile": "h200-quarter"})
    started, _events, progress = begin_spawn(hub, spawner)
    await cluster.pod_named(spawner.pod_name)
    await spawner.stop(now=True)
    with pytest.raises(web.HTTPError, match='stopped while waiting in queue "vision"'):
        await asyncio.wait_for(started, 10)
    await asyncio.wait_for(progress, 5)


@pytest.mark.asyncio
async def test_a_pod_deleted_behind_the_spawners_back_ends_the_wait(cluster, tmp_path):
    hub = HubDB(spawner_config(policy_copy(tmp_path, queue_timeout=30), cluster.url))
    spawner = hub.spawner("alice", ("vision",))
    await spawner._run_apply_user_options({"profile": "h200-quarter"})
    started, events, progress = begin_spawn(hub, spawner)
    await cluster.pod_named(spawner.pod_name)
    await wait_for_message(events, "Waiting for")  # the spawner has seen its pod waiting
    await cluster.core.delete_namespaced_pod(spawner.pod_name, NAMESPACE)  # e.g. an administrator's kubectl
    with pytest.raises(web.HTTPError, match='the pod was deleted while it waited in queue "vision"'):
        await asyncio.wait_for(started, 10)
    await asyncio.wait_for(progress, 5)


@pytest.mark.asyncio
async def test_a_pod_left_over_under_the_servers_name_is_replaced_and_the_spawn_goes_on(cluster, tmp_path, ledger):
    # A pod of this server's name from before (a hub that lost track of it): KubeSpawner's create gets a 409,
    # deletes that pod with stop(now=True) and creates again. That stop is not the user's: the spawn goes on.
    hub = HubDB(spawner_config(policy_copy(tmp_path, queue_timeout=30), cluster.url))
    spawner = hub.spawner("alice", ("vision",))
    await spawner._run_apply_user_options({"profile": "h200-quarter"})
    await cluster.core.create_namespaced_pod(NAMESPACE, {
        "metadata": {"name": spawner.pod_name, "namespace": NAMESPACE},
        "spec": {"containers": [{"name": "notebook", "image": "quay.io/jupyterhub/singleuser:5.3"}]}})
    left_over = (await cluster.pod_named(spawner.pod_name))["metadata"]["uid"]
    started, events, progress = begin_spawn(hub, spawner)
    deadline = asyncio.get_running_loop().time() + 10
    while (cluster.object("pods", spawner.pod_name) or {}).get("metadata", {}).get("uid") in (None, left_over):
        assert asyncio.get_running_loop().time() < deadline and not started.done(), (
            "the left-over pod was never replaced", started.done() and started.exception())
        await asyncio.sleep(0.02)
    ours = cluster.object("pods", spawner.pod_name)
    assert ours["metadata"]["annotations"]["scheduling.volcano.sh/queue-name"] == "vision"
    await wait_for_message(events, "Waiting for")
    await cluster.podgroup(podgroups.podgroup_name(ours["metadata"]["uid"]), "vision", "gpupool-vision",
                           rfc3339(datetime.now(UTC)), "Running")
    await cluster.run_pod(spawner.pod_name)
    assert await asyncio.wait_for(started, 10) == "http://127.0.0.1:8888"
    await asyncio.wait_for(progress, 5)
    (running,) = ledger.open_intervals()
    assert (running.user, running.state) == ("alice", State.RUNNING)  # not closed as stopped by the replacement
    spawner._spawn_pending = spawner._start_pending = False
    await spawner.stop(now=True)
    assert ledger.interval(running.key).how == HowEnded.STOPPED and ledger.open_intervals() == []


@pytest.mark.asyncio
async def test_without_volcanos_podgroups_the_wait_is_still_explained(cluster, tmp_path):
    # No PodGroup CRD (or no permission to read it): no position, but the pod's own scheduling reason.
    del cluster.api.resources["scheduling.volcano.sh/v1beta1/podgroups"]
    hub = HubDB(spawner_config(policy_copy(tmp_path, queue_timeout=30), cluster.url))
    spawner = hub.spawner("alice", ("vision",))
    await spawner._run_apply_user_options({"profile": "h200-mig-1g"})
    started, events, progress = begin_spawn(hub, spawner)
    pod = await cluster.pod_named(spawner.pod_name)
    await cluster.event("Pod", spawner.pod_name, pod["metadata"]["uid"], "FailedScheduling",
                        "0/3 nodes are unavailable: 3 Insufficient nvidia.com/mig-1g.18gb.")
    assert await wait_for_message(events, "slice") == (
        'Waiting for MIG 1g.18gb (H200) in queue "vision" (no H200 has a MIG 1g.18gb slice free)')
    await spawner.stop(now=True)
    with pytest.raises(web.HTTPError, match="stopped while waiting"):
        await asyncio.wait_for(started, 10)
    await asyncio.wait_for(progress, 5)


# --- (e) the accounting's admission, as in the embedded mode ---------------------------------------------------


def used(ledger: Ledger, team: str, hours: int, user: str = "carol") -> None:
    """`hours` GPU-hours of one whole H200 already used by `team` this period (ended a minute ago)."""
    now = periods.utcnow()
    start = max(now - timedelta(hours=hours, minutes=1), datetime.fromisoformat(periods.period_of(now) + "-01")
                .replace(tzinfo=UTC))
    share = Fraction(hours * 3600, int((now - timedelta(minutes=1) - start).total_seconds()))
    ledger.open_interval(f"seed-{team}", user, team, "h200-whole-2", "H200", share, start)
    ledger.close_interval(f"seed-{team}", now - timedelta(minutes=1), HowEnded.STOPPED)


@pytest.mark.asyncio
async def test_an_exhausted_deny_budget_refuses_with_403_before_any_api_call(cluster, tmp_path, ledger):
    used(ledger, "nlp", 3)
    hub = HubDB(spawner_config(policy_copy(tmp_path, queue_timeout=30, budgets={"nlp": 2}), cluster.url))
    spawner = hub.spawner("bob", ("nlp",))
    await spawner._run_apply_user_options({"profile": "a100-whole"})
    with pytest.raises(web.HTTPError) as refused:
        await spawner.start()
    assert refused.value.status_code == 403
    message = (f'team "nlp": budget of 2 GPU-hours for {periods.period_of(periods.utcnow())} used: 3 (150%); '
               f"resets {periods.period_reset(periods.period_of(periods.utcnow()))}")
    # JupyterHub's SpawnException: the code is its `reason` (the spawn metric's label) and follows the message
    # that the spawn page and the REST error show.
    assert isinstance(refused.value, SpawnException) and refused.value.reason == "budget-deny"
    assert refused.value.log_message == message
    assert refused.value.jupyterhub_message == f"{message} (reason: budget-deny)"
    assert cluster.requests() == []
    assert ledger.open_intervals() == []


@pytest.mark.asyncio
async def test_an_exhausted_deprioritize_budget_runs_the_pod_as_lowest_priority_preemptable(
        cluster, tmp_path, ledger):
    used(ledger, "vision", 3)
    hub = HubDB(spawner_config(policy_copy(tmp_path, queue_timeout=30, budgets={"vision": 2}), cluster.url))
    spawner = hub.spawner("alice", ("vision",))
    await spawner._run_apply_user_options({"profile": "h200-quarter"})
    started, _events, progress = begin_spawn(hub, spawner)
    pod = await cluster.pod_named(spawner.pod_name)
    assert pod["spec"]["priorityClassName"] == "gpupool-deprioritized"
    assert pod["metadata"]["annotations"]["volcano.sh/preemptable"] == "true"
    assert pod["metadata"]["annotations"]["scheduling.volcano.sh/queue-name"] == "vision"
    assert spawner.get_state()["deprioritized"] is True
    await spawner.stop(now=True)
    with pytest.raises(web.HTTPError):
        await asyncio.wait_for(started, 10)
    await asyncio.wait_for(progress, 5)
    assert ledger.open_intervals() == []  # it never ran


@pytest.mark.asyncio
async def test_a_full_per_user_quota_waits_without_a_pod_until_shares_free_up(cluster, tmp_path, ledger):
    # alice already runs 2 whole H200 (her per-user quota in vision is 2 GPUs)
    ledger.open_interval("alice-other-server", "alice", "vision", "h200-whole-2", "H200", Fraction(2),
                         periods.utcnow() - timedelta(minutes=5))
    hub = HubDB(spawner_config(policy_copy(tmp_path, queue_timeout=30), cluster.url))
    spawner = hub.spawner("alice", ("vision",))
    await spawner._run_apply_user_options({"profile": "h200-quarter"})
    started, events, progress = begin_spawn(hub, spawner)
    message = await wait_for_message(events, "quota")
    assert message == ('Waiting for 0.25 × H200 (HAMi): alice holds 2 of 2 GPUs allowed per member of team '
                       '"vision" (quota)')
    assert not [r for r in cluster.requests() if "pods" in r.url.path and r.method == "POST"]
    ledger.close_interval("alice-other-server", periods.utcnow(), HowEnded.STOPPED)
    pod = await cluster.pod_named(spawner.pod_name)  # admitted now: the pod goes to Volcano's queue
    assert pod["spec"]["priorityClassName"] == "gpupool-vision"
    await spawner.stop(now=True)
    with pytest.raises(web.HTTPError):
        await asyncio.wait_for(started, 10)
    await asyncio.wait_for(progress, 5)


@pytest.mark.asyncio
async def test_a_stop_while_the_door_decides_ends_the_holding_it_records(cluster, tmp_path, ledger, monkeypatch):
    # The door (Ledger.admit, in a worker thread) is held until the spawn was stopped: stop() finds no holding
    # yet, then the door records one. The start's end must close it, unbilled, and no pod may be created.
    entered, release = threading.Event(), threading.Event()
    door = notify.admit

    def held_door(*args, **kwargs):
        entered.set()
        release.wait(30)
        return door(*args, **kwargs)

    monkeypatch.setattr(notify, "admit", held_door)
    hub = HubDB(spawner_config(policy_copy(tmp_path, queue_timeout=30), cluster.url))
    spawner = hub.spawner("alice", ("vision",))
    await spawner._run_apply_user_options({"profile": "h200-quarter"})
    started, _events, progress = begin_spawn(hub, spawner)
    assert await asyncio.to_thread(entered.wait, 30)
    run = spawner.usage_run
    await spawner.stop(now=True)
    release.set()
    with pytest.raises(web.HTTPError) as stopped:
        await asyncio.wait_for(started, 10)
    assert stopped.value.reason == "cancelled", stopped.value
    await asyncio.wait_for(progress, 5)
    assert ledger.open_intervals() == []
    (held,) = ledger.run_intervals(run)
    assert held.how == "stopped" and held.gpu_hours(periods.period_of(periods.utcnow())) == 0
    assert not [r for r in cluster.requests() if r.method == "POST" and r.url.path.endswith("/pods")]


@pytest.mark.asyncio
async def test_spawns_admitted_together_never_exceed_a_quota_between_them(cluster, tmp_path, ledger):
    # vision may hold 4 H200 at once (quota per model) and holds 3.75: of two 0.25 spawns, one must wait.
    ledger.open_interval("carol-server", "carol", "vision", "h200-whole-2", "H200", Fraction(15, 4),
                         periods.utcnow() - timedelta(minutes=5))
    hub = HubDB(spawner_config(policy_copy(tmp_path, queue_timeout=30), cluster.url))
    spawners = [hub.spawner(name, ("vision",)) for name in ("alice", "bob")]
    spawns = []
    for spawner in spawners:
        await spawner._run_apply_user_options({"profile": "h200-quarter"})
        spawns.append(begin_spawn(hub, spawner))
    # Whichever was decided second waits, before any pod of its own exists.
    waiting = await asyncio.wait({asyncio.ensure_future(wait_for_message(events, "quota")) for _s, events, _p in spawns},
                                 return_when=asyncio.FIRST_COMPLETED)
    (done,) = waiting[0]
    assert done.result() == 'Waiting for 0.25 × H200 (HAMi): team "vision" holds 4 of 4 H200 (quota per model)'
    assert {e.get("reason") for _s, events, _p in spawns for e in events if "quota" in e["message"]} == {"quota-full"}
    for task in waiting[1]:
        task.cancel()
    # The one admitted holds its share in the ledger (reserved: its pod does not run, so it is not billed).
    (held,) = [i for i in ledger.open_intervals() if i.key != "carol-server"]
    assert held.state is State.RESERVED and held.gpu_hours(periods.period_of(periods.utcnow())) == 0
    first = next(s for s in spawners if s.usage_run == held.run)
    await cluster.pod_named(first.pod_name)
    created = [r for r in cluster.requests() if r.method == "POST" and r.url.path.endswith("/pods")]
    assert len(created) == 1
    for spawner, (started, _events, progress) in zip(spawners, spawns):
        await spawner.stop(now=True)
        with pytest.raises(web.HTTPError) as stopped:
            await asyncio.wait_for(started, 10)
        assert stopped.value.reason == "cancelled", stopped.value
        await asyncio.wait_for(progress, 5)
    assert [i.key for i in ledger.open_intervals()] == ["carol-server"]  # neither ran: the holding ended unbilled
    assert ledger.interval(held.key).how == "stopped" and ledger.gpu_hours(periods.period_of(periods.utcnow()),
                                                                          ("user",)).get((held.user,)) is None


# --- what GPUKubeSpawner relies on upstream -------------------------------------------------------------------


@pytest.mark.parametrize(("owner", "member", "parameters"), UPSTREAM_INTERNALS,
                         ids=[f"{owner}.{member}" for owner, member, _ in UPSTREAM_INTERNALS])
def test_the_upstream_internals_gpukubespawner_relies_on_are_there(owner, member, parameters):
    module_name, _, class_name = owner.rpartition(".")
    found = getattr(importlib.import_module(module_name), class_name)
    source = inspect.getsource(found)
    assert hasattr(found, member) or f"self.{member} = " in source, (
        f"{owner}.{member} is gone from this release: update GPUKubeSpawner and UPSTREAM_INTERNALS")
    if parameters is not None:
        assert tuple(inspect.signature(getattr(found, member)).parameters) == parameters, (
            f"{owner}.{member} now takes {inspect.signature(getattr(found, member))}: update GPUKubeSpawner")


def test_every_private_upstream_member_gpukubespawner_uses_is_listed():
    # Every `self._x` / `super()._x` in the module is gpupool's own (defined in the spawner's modules) or listed.
    modules = [importlib.import_module(f"gpupool.spawner.{name}") for name in ("kube", "mixin", "usage")]
    used = set(re.findall(r"(?:self|super\(\))\.(_[a-z][a-z_]*)", inspect.getsource(modules[0])))
    ours = {name for name in used for module in modules
            if re.search(rf"(def {name}\b|^\s*{name}\s*[:=]|self\.{name} = )", inspect.getsource(module), re.M)}
    listed = {member for _owner, member, _ in UPSTREAM_INTERNALS}
    assert used - ours - listed == set(), "list these in spawner/kube.py UPSTREAM_INTERNALS"
    assert listed - used <= {"reflectors", "pod_reflector", "event_reflector", "load_user_options", "kind",
                             "api_group_name", "list_method_name", "first_load_future", "resources", "start",
                             "events"}  # public names, used on reflectors or through `self.__class__`


@pytest.mark.asyncio
async def test_a_named_server_beyond_the_teams_limit_is_refused_before_anything_starts(tmp_path):
    # In the Kubernetes mode the hub's limit is one number for everyone (the largest of the teams'): the spawner
    # holds each user to the limit of their own teams, counting their other named servers that run or start.
    policies = policy_copy(tmp_path, queue_timeout=30)
    teams = yaml.safe_load((policies / "teams.yaml").read_text())
    teams["teams"]["vision"]["named_servers"] = 1
    (policies / "teams.yaml").write_text(yaml.safe_dump(teams, sort_keys=False, allow_unicode=True))
    hub = HubDB(spawner_config(policies))
    user = hub.user("alice", ("vision",))
    spawners = {name: user.get_or_create_spawner(name, name) for name in ("", "first", "second")}
    for name in ("", "first"):  # the default server does not count; "first" runs
        orm_server = orm.Server(base_url=f"/user/alice/{name}")
        hub.db.add(orm_server)
        hub.db.commit()
        spawners[name].orm_spawner.server = orm_server
        hub.db.commit()
    spawners["first"].check_named_server()  # itself, starting again: allowed
    with pytest.raises(web.HTTPError, match=r"allow 1 named server at once \(teams.TEAM.named_servers\), and first "
                                            r"runs: stop one first") as refused:
        spawners["second"].check_named_server()
    assert refused.value.status_code == 403
    spawners["first"].orm_spawner.server = None  # stopped
    hub.db.commit()
    spawners["second"].check_named_server()


@pytest.mark.asyncio
async def test_the_spawn_page_says_what_a_spawn_would_do_from_the_ledgers_decision(cluster, tmp_path, ledger):
    hub = HubDB(spawner_config(policy_copy(tmp_path, queue_timeout=30, budgets={"nlp": 1}), cluster.url))
    alice = hub.spawner("alice", ("vision",))
    seen = (await alice.profile_availability()).profiles
    assert seen["cpu"].action == "start" and seen["h200-quarter"].action == "start", seen
    assert "Volcano starts it when the cluster has room" in seen["h200-quarter"].reason
    # alice holds two cards, vision's quota per member: a GPU profile would wait, and the line says why.
    ledger.open_interval("alice-held", "alice", "vision", "h200-whole-2", "H200", Fraction(2), periods.utcnow())
    seen = (await alice.profile_availability()).profiles
    assert seen["h200-quarter"].action == "wait" and seen["cpu"].action == "start", seen
    assert seen["h200-quarter"].code == "quota-full", seen
    # nlp has used its budget, which denies: refused, saying so.
    used(ledger, "nlp", 2, user="nadia")
    nadia = hub.spawner("nadia", ("nlp",))
    seen = (await nadia.profile_availability()).profiles
    assert seen["h200-quarter"].action == "refuse" and "budget" in seen["h200-quarter"].reason, seen
    # The spawn page (the form JupyterHub renders) shows each profile's line.
    form = await alice.get_options_form()
    assert 'id="availability-h200-quarter" data-action="wait"' in form
    assert 'id="availability-cpu" data-action="start"' in form
