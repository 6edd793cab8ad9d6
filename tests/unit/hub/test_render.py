"""`gpupool render`: the Kubernetes objects made from policies, compared with literal manifests and checked
against the real schemas: kubernetes-validate (strict) for built-in kinds, Volcano's CRD schemas for Queues.

The Volcano CRDs come from shared/ beside the repository (never copied into it); without that folder the
Volcano checks skip and say so.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gpupool.hub.cli import main
from gpupool.policies import DEFAULT_POLICY_DIR, EXAMPLES_DIR, load_policy
from gpupool.spawner import volcano
from gpupool.spawner.wiring import CULLER_SCOPES
from gpupool.policies.resources import profile_gpu

ROOT = Path(__file__).resolve().parents[3]
VOLCANO_SCHEMAS = Path(__file__).resolve().parents[4] / "shared" / "schemas" / "volcano"
#: A recent Kubernetes release among those kubernetes-validate bundles (1.25–1.37).
KUBERNETES_VERSION = "1.35"
#: What the API server accepts as an object name (a DNS subdomain); no OpenAPI schema says it.
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

LABELS = {
    "app.kubernetes.io/name": "gpupool",
    "app.kubernetes.io/instance": "gpupool",
    "app.kubernetes.io/part-of": "gpupool",
}


# --- the checks every rendered manifest goes through (tests/unit/hub/test_helm.py uses them too) ---------------


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """A CRD's structural schema with unknown fields refused, as the API server's strict field validation
    (kubectl's default) refuses them, instead of silently pruning a misspelled field."""
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {name: strict(sub) for name, sub in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = strict(out["additionalProperties"])
    if isinstance(out.get("items"), dict):
        out["items"] = strict(out["items"])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [strict(sub) for sub in out[key]]
    return out


def volcano_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    """(apiVersion, kind) → a validator for each served version of each Volcano CRD in shared/."""
    if not VOLCANO_SCHEMAS.is_dir():
        pytest.skip(f"the Volcano CRD schemas are not at {VOLCANO_SCHEMAS} (shared/ beside the repository)")
    validators = {}
    for path in sorted(VOLCANO_SCHEMAS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = strict(version["schema"]["openAPIV3Schema"])
            validators[(f"{group}/{version['name']}", kind)] = jsonschema.Draft7Validator(schema)
    assert ("scheduling.volcano.sh/v1beta1", "Queue") in validators
    return validators


def validate(obj: dict[str, Any], crds: dict[tuple[str, str], Any]) -> None:
    """Raise unless `obj` is a valid object of its kind: Volcano CRD schema, or kubernetes-validate strict."""
    name = obj["metadata"]["name"]
    assert DNS_SUBDOMAIN.fullmatch(name) and len(name) <= 253, f"{obj['kind']} name {name!r} is not a DNS subdomain"
    validator = crds.get((obj["apiVersion"], obj["kind"]))
    if validator is not None:
        validator.validate(obj)
    else:
        # SchemaNotFoundError for a kind we did not expect: every object is checked by one of the two.
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


# --- helpers ---------------------------------------------------------------------------------------------


def run(*args: str) -> tuple[int, str, str]:
    """`gpupool ARGS` in this process: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def render(policies: Path, *args: str) -> list[dict[str, Any]]:
    code, out, err = run("render", "--policies", str(policies), *args)
    assert code == 0, err
    return list(yaml.safe_load_all(out))


def by_name(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


@pytest.fixture(scope="module")
def crds():
    return volcano_validators()


# --- literal manifests -------------------------------------------------------------------------------------


def test_default_policies_render_queues_classes_and_the_policy_configmap():
    objects = render(DEFAULT_POLICY_DIR)
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("PriorityClass", "gpupool-nlp"), ("PriorityClass", "gpupool-nlp-low-jobs"),
        ("PriorityClass", "gpupool-vision"), ("PriorityClass", "gpupool-vision-low-jobs"),
        ("PriorityClass", "gpupool-deprioritized"),
        ("Queue", "nlp"), ("Queue", "vision"),
        ("ConfigMap", "gpupool-policies"),
    ]
    assert by_name(objects, "Queue")["vision"] == {
        "apiVersion": "scheduling.volcano.sh/v1beta1",
        "kind": "Queue",
        "metadata": {
            "name": "vision",
            "labels": {**LABELS, "app.kubernetes.io/component": "queue", "gpupool.io/team": "vision"},
        },
        "spec": {"weight": 2, "priority": 100, "reclaimable": True, "parent": "root"},
    }
    classes = by_name(objects, "PriorityClass")
    assert classes["gpupool-vision"] == {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {
            "name": "gpupool-vision",
            "labels": {**LABELS, "app.kubernetes.io/component": "priority-class", "gpupool.io/team": "vision"},
        },
        "value": 100,
        "globalDefault": False,
        "preemptionPolicy": "PreemptLowerPriority",
        "description": "gpupool team vision: its notebooks and jobs (policy teams.vision.priority)",
    }
    # A team's low-priority jobs: the team's priority moved by jobs.priorities' low offset from normal (10).
    assert (classes["gpupool-vision-low-jobs"]["value"], classes["gpupool-nlp-low-jobs"]["value"]) == (90, 40)
    assert classes["gpupool-deprioritized"] == {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {
            "name": "gpupool-deprioritized",
            "labels": {**LABELS, "app.kubernetes.io/component": "priority-class"},
        },
        "value": -1,
        "globalDefault": False,
        "preemptionPolicy": "Never",
        "description": "gpupool: work admitted beyond an exhausted budget (on_exhausted: deprioritize); "
        "lowest priority, preempted first",
    }
    policies = by_name(objects, "ConfigMap")["gpupool-policies"]
    assert policies["metadata"]["namespace"] == "default"
    assert policies["data"] == {p.name: p.read_text() for p in sorted(DEFAULT_POLICY_DIR.glob("*.yaml"))}


def test_example_queues_form_a_hierarchy_parents_first():
    objects = render(EXAMPLES_DIR, "--release", "pool", "--namespace", "jhub")
    queues = by_name(objects, "Queue")
    order = [o["metadata"]["name"] for o in objects if o["kind"] == "Queue"]
    assert order == ["research", "students", "nlp", "vision"]
    labels = {**LABELS, "app.kubernetes.io/instance": "pool", "app.kubernetes.io/component": "queue"}
    assert queues["research"] == {
        "apiVersion": "scheduling.volcano.sh/v1beta1",
        "kind": "Queue",
        "metadata": {"name": "research", "labels": {**labels, "gpupool.io/team": "research"}},
        "spec": {
            "weight": 4, "priority": 100, "reclaimable": False, "parent": "root",
            "capability": {"cpu": "512", "memory": "4Ti", "nvidia.com/gpu": "32"},
            "deserved": {"cpu": "256", "memory": "2Ti", "nvidia.com/gpu": "16"},
            "guarantee": {"resource": {"cpu": "32", "memory": "256Gi", "nvidia.com/gpu": "2"}},
        },
    }
    assert queues["vision"] == {
        "apiVersion": "scheduling.volcano.sh/v1beta1",
        "kind": "Queue",
        "metadata": {"name": "vision", "labels": {**labels, "gpupool.io/team": "vision"}},
        "spec": {
            "weight": 2, "priority": 100, "reclaimable": True, "parent": "research",
            "deserved": {"cpu": "128", "memory": "1Ti", "nvidia.com/gpu": "8"},
            "guarantee": {"resource": {"cpu": "32", "memory": "256Gi", "nvidia.com/gpu": "2"}},
        },
    }
    # A team without a parent names `root` itself, so that vc-controller-manager never becomes the owner of
    # spec.parent (which would make a later re-parenting `kubectl apply --server-side` conflict).
    assert queues["students"]["spec"]["parent"] == "root"
    assert by_name(objects, "ConfigMap")["pool-policies"]["metadata"]["namespace"] == "jhub"


def test_time_sliced_models_get_a_device_plugin_config_keyed_by_model():
    objects = render(EXAMPLES_DIR, "--device-plugin-namespace", "nvidia-device-plugin")
    config = by_name(objects, "ConfigMap")["gpupool-time-slicing"]
    assert config["metadata"] == {
        "name": "gpupool-time-slicing",
        "namespace": "nvidia-device-plugin",
        "labels": {**LABELS, "app.kubernetes.io/component": "device-plugin-config"},
    }
    assert {model: yaml.safe_load(text) for model, text in config["data"].items()} == {
        "RTX4090": {
            "version": "v1",
            "sharing": {
                "timeSlicing": {"renameByDefault": True, "resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}
            },
        },
    }
    # renameByDefault advertises replicas under the name the share translation asks for.
    policy = load_policy(EXAMPLES_DIR)
    gpu = profile_gpu(policy.profiles["rtx4090-quarter"], policy)
    assert gpu is not None and gpu.limits == {"nvidia.com/gpu.shared": 1}
    # No model of the default set is time-sliced, so there is no such ConfigMap.
    assert "gpupool-time-slicing" not in by_name(render(DEFAULT_POLICY_DIR), "ConfigMap")


def test_jupyterhub_values_wire_the_hub_to_gpupool():
    values = volcano.jupyterhub_values(load_policy(DEFAULT_POLICY_DIR), volcano.Release("gpupool", "jhub"))
    assert values == {
        "hub": {
            # gpupool's hub (its pages, routes and job runner) on z2jh's configuration file
            "args": ["gpupool-hub", "--config", "/usr/local/etc/jupyterhub/jupyterhub_config.py"],
            "config": {
                "JupyterHub": {
                    "spawner_class": "gpupool.spawner.kube.GPUKubeSpawner",
                    "load_groups": {
                        "nlp": {"users": [], "properties": {"gpupool.team": "true"}},
                        "vision": {"users": [], "properties": {"gpupool.team": "true"}},
                    },
                },
                "KubeSpawner": {"automount_service_account_token": False},
                "GPUKubeSpawner": {"mlflow_url": "http://proxy-public/services/mlflow/"},
            },
            # Named servers as in the embedded mode: the largest of the teams' limits (the default, 2).
            "allowNamedServers": True,
            "namedServerLimitPerUser": 2,
            "extraEnv": {
                "GPUPOOL_POLICIES": "/etc/gpupool/policies",
                "GPUPOOL_RELEASE": "gpupool",
                "GPUPOOL_LEDGER_URL": {"valueFrom": {"configMapKeyRef": {"name": "gpupool-hub-env",
                                                                             "key": "GPUPOOL_LEDGER_URL"}}},
            },
            "extraVolumes": [{"name": "gpupool-policies", "configMap": {"name": "gpupool-policies"}}],
            "extraVolumeMounts": [
                {"name": "gpupool-policies", "mountPath": "/etc/gpupool/policies", "readOnly": True},
            ],
            "services": {
                "accounting": {"url": "http://gpupool-accounting:8080", "oauth_no_confirm": True, "display": True},
                "mlflow": {"url": "http://gpupool-mlflow:5000", "oauth_no_confirm": True, "display": True},
                "jobs": {"url": "http://gpupool-jobs:8080", "oauth_no_confirm": True, "display": True},
                "culler": {"url": "http://gpupool-culler:8080", "oauth_no_confirm": True, "display": True},
            },
            "loadRoles": {
                "gpupool-accounting": {
                    "description": "gpupool-accounting reads team membership and which servers run",
                    "scopes": ["list:groups", "read:groups", "list:users", "read:servers"],
                    "services": ["accounting"],
                },
                "gpupool-mlflow": {
                    "description": "the MLflow tracking server and model registry: no hub scopes",
                    "scopes": [],
                    "services": ["mlflow"],
                },
                "gpupool-jobs": {
                    "description": "gpupool-jobs: training jobs' API and page; no hub scopes",
                    "scopes": [],
                    "services": ["jobs"],
                },
                "gpupool-culler": {
                    "description": "gpupool-culler warns, then stops, servers whose GPU share sits idle",
                    "scopes": ["list:users", "read:users:name", "read:servers", "admin:server_state",
                               "delete:servers"],
                    "services": ["culler"],
                },
                "user": {"scopes": ["self", "access:services!service=accounting", "access:services!service=mlflow",
                                    "access:services!service=jobs", "access:services!service=culler"]},
            },
        },
        "scheduling": {
            "userScheduler": {"enabled": False},
            "userPlaceholder": {"enabled": False},
            "podPriority": {"enabled": False},
        },
    }


def test_the_culler_role_has_exactly_its_scopes_and_without_the_culler_nothing_of_it_is_registered():
    policy, release = load_policy(DEFAULT_POLICY_DIR), volcano.Release("gpupool", "jhub")
    hub = volcano.jupyterhub_values(policy, release)["hub"]
    assert hub["loadRoles"]["gpupool-culler"]["scopes"] == list(CULLER_SCOPES)
    assert hub["loadRoles"]["gpupool-culler"]["services"] == ["culler"]
    without = volcano.jupyterhub_values(policy, release, culler=False)
    assert set(without["hub"]["services"]) == {"accounting", "mlflow", "jobs"}
    assert set(without["hub"]["loadRoles"]) == {"gpupool-accounting", "gpupool-mlflow", "gpupool-jobs", "user"}
    assert without["hub"]["loadRoles"]["user"]["scopes"] == [
        "self", "access:services!service=accounting", "access:services!service=mlflow",
        "access:services!service=jobs"]
    # Everything else is the same wiring.
    for section in (hub, without["hub"]):
        section.pop("services"), section.pop("loadRoles")
    assert without["hub"] == hub
    # The chart's values carry the culler's Service name and port, and its registration only when it runs.
    files = {p.name: p.read_text() for p in sorted(DEFAULT_POLICY_DIR.glob("*.yaml"))}
    generated = volcano.helm_values(policy, files, release, culler=False)
    assert generated["gpupool"]["cullerService"] == "culler"
    assert generated["gpupool"]["cullerPort"] == volcano.CULLER_PORT
    assert generated["jupyterhub"] == volcano.jupyterhub_values(policy, release, culler=False)
    # The command line: `gpupool render --helm-values --no-culler` (and --output's values file) leave it out.
    printed = yaml.safe_load(run("render", "--policies", str(DEFAULT_POLICY_DIR), "--namespace", "jhub",
                                 "--helm-values", "--no-culler")[1])
    assert printed["jupyterhub"] == volcano.jupyterhub_values(policy, release, culler=False)


def test_named_servers_are_allowed_up_to_the_largest_teams_limit(tmp_path):
    policies = tmp_path / "policies"
    shutil.copytree(DEFAULT_POLICY_DIR, policies, ignore=shutil.ignore_patterns("examples", "*.py", "__pycache__"))
    teams = yaml.safe_load((policies / "teams.yaml").read_text())
    for limits in ((0, 0), (1, 3)):
        for team, limit in zip(sorted(teams["teams"]), limits):
            teams["teams"][team]["named_servers"] = limit
        (policies / "teams.yaml").write_text(yaml.safe_dump(teams, sort_keys=False, allow_unicode=True))
        hub = volcano.jupyterhub_values(load_policy(policies), volcano.Release())["hub"]
        assert (hub["allowNamedServers"], hub["namedServerLimitPerUser"]) == (max(limits) > 0, max(limits))


def test_teams_from_the_authenticator_hand_groups_to_it_and_say_what_is_lost():
    values = volcano.jupyterhub_values(load_policy(EXAMPLES_DIR), volcano.Release())
    config = values["hub"]["config"]
    # JupyterHub refuses load_groups together with Authenticator.manage_groups.
    assert config["Authenticator"] == {"manage_groups": True}
    assert "load_groups" not in config["JupyterHub"]
    code, _, err = run("render", "--policies", str(EXAMPLES_DIR))
    assert code == 0
    assert "note: teams research, vision, nlp take their members from the authenticator" in err
    assert "member lists of students" in err


def test_teams_without_a_deserved_are_named_since_they_cannot_reclaim(tmp_path):
    code, _, err = run("render", "--policies", str(DEFAULT_POLICY_DIR))
    assert code == 0
    assert "note: teams vision, nlp have no queue.deserved: under Volcano's capacity plugin" in err
    # In the examples every team that takes pods has one (research is a parent: it takes none).
    code, _, err = run("render", "--policies", str(EXAMPLES_DIR))
    assert code == 0, err
    assert "queue.deserved" not in err
    policies = tmp_path / "policies"
    shutil.copytree(EXAMPLES_DIR, policies)
    teams = policies / "teams.yaml"
    line = "      deserved: {cpu: 16, memory: 128Gi, nvidia.com/gpu: 2}\n"
    assert teams.read_text().count(line) == 1
    teams.write_text(teams.read_text().replace(line, ""))
    code, _, err = run("render", "--policies", str(policies))
    assert code == 0, err
    assert "note: teams students have no queue.deserved" in err


@pytest.mark.parametrize("section, module, name", [
    ("JupyterHub", "jupyterhub.app", "JupyterHub"),
    ("Authenticator", "jupyterhub.auth", "Authenticator"),
    ("KubeSpawner", "kubespawner", "KubeSpawner"),
    ("GPUKubeSpawner", "gpupool.spawner.kube", "GPUKubeSpawner"),
])
def test_hub_config_sets_only_real_configurable_traits(section, module, name):
    """Each hub.config entry is a trait of the class it names; a misspelled one would be ignored by the hub."""
    configurable = getattr(pytest.importorskip(module), name).class_traits(config=True)
    seen = False
    for policies in (DEFAULT_POLICY_DIR, EXAMPLES_DIR):
        config = volcano.jupyterhub_values(load_policy(policies), volcano.Release())["hub"]["config"]
        assert set(config) <= {"JupyterHub", "Authenticator", "KubeSpawner", "GPUKubeSpawner"}
        traits = config.get(section, {})
        seen = seen or bool(traits)
        assert set(traits) <= set(configurable), f"{section}: {set(traits) - set(configurable)}"
    assert seen, f"no policy set configures {section}"


def test_priority_classes_are_the_ones_the_spawner_asks_for():
    kube = pytest.importorskip("gpupool.spawner.kube", reason="GPUKubeSpawner (spawner/kube.py) is not there yet")
    for policies in (DEFAULT_POLICY_DIR, EXAMPLES_DIR):
        classes = {name: o["value"] for name, o in by_name(render(policies), "PriorityClass").items()}
        assert classes == kube.policy_priorities(load_policy(policies))


# --- every object is valid for the cluster -------------------------------------------------------------------


@pytest.mark.parametrize("policies", [DEFAULT_POLICY_DIR, EXAMPLES_DIR], ids=["default", "examples"])
def test_every_rendered_object_passes_the_kubernetes_and_volcano_schemas(policies, crds, tmp_path):
    objects = render(policies)
    for obj in objects:
        validate(obj, crds)
    # The folder form holds the same objects, one per file, plus the Zero-to-JupyterHub values.
    assert run("render", "--policies", str(policies), "--output", str(tmp_path / "out"))[0] == 0
    files = sorted(p.name for p in (tmp_path / "out").glob("*.yaml"))
    assert files == [render_module().object_filename(i, o) for i, o in enumerate(objects)]
    assert [yaml.safe_load((tmp_path / "out" / f).read_text()) for f in files] == objects
    values = yaml.safe_load((tmp_path / "out" / "zero-to-jupyterhub" / "values.yaml").read_text())
    assert values == volcano.jupyterhub_values(load_policy(policies), volcano.Release())


def test_the_checks_refuse_what_the_api_server_refuses(crds):
    """The validators are not blind: a misspelled field, a bad value and a bad name each fail."""
    queue = render(DEFAULT_POLICY_DIR)[5]
    assert queue["kind"] == "Queue"
    misspelled = {**queue, "spec": {**queue["spec"], "guarantee": {"resources": {"cpu": "1"}}}}
    with pytest.raises(jsonschema.ValidationError, match="resources"):
        validate(misspelled, crds)
    with pytest.raises(jsonschema.ValidationError):
        validate({**queue, "spec": {**queue["spec"], "weight": 0}}, crds)
    with pytest.raises(jsonschema.ValidationError):
        validate({**queue, "spec": {**queue["spec"], "capability": {"cpu": "lots"}}}, crds)
    priority_class = render(DEFAULT_POLICY_DIR)[0]
    with pytest.raises(kubernetes_validate.ValidationError, match="values"):
        validate({**priority_class, "values": 3}, crds)
    with pytest.raises(AssertionError, match="DNS subdomain"):
        validate({**priority_class, "metadata": {"name": "Gpupool_Vision"}}, crds)


# --- the command ------------------------------------------------------------------------------------------


def render_module():
    from gpupool.hub import render as module

    return module


def test_output_is_byte_for_byte_deterministic():
    """Same policies, same bytes, whatever the hash seed (sets and dicts must not leak their order)."""
    outputs = set()
    for seed in ("1", "2"):
        for extra in ([], ["--helm-values"]):
            result = subprocess.run(
                [sys.executable, "-m", "gpupool.hub.cli", "render", "--policies", str(EXAMPLES_DIR), *extra],
                capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": seed},
            )
            outputs.add((tuple(extra), result.stdout))
    assert len(outputs) == 2


def test_output_folder_replaces_its_previous_render_and_refuses_a_foreign_folder(tmp_path):
    policies = tmp_path / "policies"
    shutil.copytree(DEFAULT_POLICY_DIR, policies, ignore=shutil.ignore_patterns("examples", "*.py", "__pycache__"))
    out = tmp_path / "out"
    code, stdout, _ = run("render", "--policies", str(policies), "--output", str(out))
    assert code == 0
    assert stdout == (f"wrote 9 files to {out}: 5 PriorityClasses, 2 Queues, 1 ConfigMap and "
                      "zero-to-jupyterhub/values.yaml\n")
    assert (out / "006-queue-vision.yaml").exists()
    (out / "notes.txt").write_text("mine")
    # Team vision goes away: its queue file must not linger for the next `kubectl apply -f out`.
    teams = yaml.safe_load((policies / "teams.yaml").read_text())
    del teams["teams"]["vision"]
    (policies / "teams.yaml").write_text(yaml.safe_dump(teams))
    profiles = yaml.safe_load((policies / "profiles.yaml").read_text())
    profiles["profiles"] = {
        slug: {**p, "teams": [t for t in p["teams"] if t != "vision"]}
        for slug, p in profiles["profiles"].items() if p["teams"] != ["vision"]
    }
    (policies / "profiles.yaml").write_text(yaml.safe_dump(profiles, allow_unicode=True))
    assert run("render", "--policies", str(policies), "--output", str(out))[0] == 0
    assert not any("vision" in p.name for p in out.iterdir())
    assert (out / "003-queue-nlp.yaml").exists() and (out / "notes.txt").read_text() == "mine"

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "deployment.yaml").write_text("kind: Deployment\n")
    code, _, err = run("render", "--policies", str(policies), "--output", str(foreign))
    assert code == 1 and "not empty and was not written by gpupool render" in err
    assert [p.name for p in foreign.iterdir()] == ["deployment.yaml"]


def test_an_invalid_policy_renders_nothing_and_names_the_line(tmp_path):
    policies = tmp_path / "policies"
    shutil.copytree(DEFAULT_POLICY_DIR, policies, ignore=shutil.ignore_patterns("examples", "*.py", "__pycache__"))
    (policies / "teams.yaml").write_text((policies / "teams.yaml").read_text().replace("weight: 2", "weight: 0"))
    code, out, err = run("render", "--policies", str(policies))
    assert code == 1 and out == ""
    assert re.search(r"teams\.yaml:\d+:\d+: teams\.vision\.queue\.weight: ", err)
    assert "nothing was rendered" in err


def test_names_that_would_collide_or_are_not_dns_safe_are_refused(tmp_path):
    code, out, err = run("render", "--release", "GPU_pool")
    assert code == 1 and out == "" and "release 'GPU_pool' is not DNS-safe" in err
    policies = tmp_path / "policies"
    shutil.copytree(DEFAULT_POLICY_DIR, policies, ignore=shutil.ignore_patterns("examples", "*.py", "__pycache__"))
    for name in ("teams.yaml", "profiles.yaml"):
        (policies / name).write_text(re.sub(r"\bnlp\b", "deprioritized", (policies / name).read_text()))
    code, out, err = run("render", "--policies", str(policies))
    assert code == 1 and out == ""
    # the policy check itself refuses it: gpupool-deprioritized is the class of over-budget work
    assert "team name 'deprioritized' is reserved" in err


def test_helm_values_carry_the_objects_and_the_policy_files():
    values = yaml.safe_load(run("render", "--policies", str(EXAMPLES_DIR), "--helm-values")[1])
    assert set(values) == {"gpupool", "jupyterhub"}
    generated = values["gpupool"]
    files = {p.name: p.read_text() for p in sorted(EXAMPLES_DIR.glob("*.yaml"))}
    assert generated["policies"] == files
    assert generated["policiesDigest"] == volcano.policies_digest(files)
    assert generated["release"] == "gpupool"
    # Everything `gpupool render` prints except the policy ConfigMap, which the chart builds from `policies`.
    assert generated["objects"] == render(EXAMPLES_DIR)[:-1]
    assert values["jupyterhub"] == volcano.jupyterhub_values(load_policy(EXAMPLES_DIR), volcano.Release())
