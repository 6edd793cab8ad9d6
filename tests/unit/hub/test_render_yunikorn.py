"""`gpupool render` under `settings.engine: yunikorn` (issue 37): YuniKorn's `yunikorn-configs` ConfigMap
(`spawner/yunikorn.py`) in place of Volcano's Queues, from the same policies; compared with a literal
configuration. That the real YuniKorn loads it is tests/e2e/test_kube_yunikorn.py's."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml

from gpupool.hub.cli import main
from gpupool.policies import load_policy
from gpupool.spawner import yunikorn
from gpupool.spawner.volcano import Release

CLUSTER = {
    "models": {"A100": {"vendor": "nvidia", "memory_gib": 80, "product": "NVIDIA-A100-SXM4-80GB",
                        "backends": ["mig", "whole"], "mig": {"strategy": "single", "profiles": ["1g.10gb"]}}},
    "settings": {"engine": "yunikorn"},
}
TEAMS = {"teams": {
    # listed children first: the configuration is ordered by name, parents holding their children
    "vision": {"priority": 100, "queue": {"parent": "research", "guarantee": {"nvidia.com/gpu": 2, "cpu": 8}}},
    "students": {"priority": 10, "queue": {"capability": {"nvidia.com/gpu": 4},
                                           "deserved": {"cpu": "1.5", "memory": "1.5Gi", "nvidia.com/gpu": 2},
                                           "guarantee": {"nvidia.com/gpu": 3}}},
    "research": {"priority": 100, "queue": {"weight": 4, "reclaimable": False,
                                            "capability": {"cpu": 512, "memory": "4Ti", "nvidia.com/gpu": 32},
                                            "deserved": {"cpu": 256, "memory": "2Ti", "nvidia.com/gpu": 16},
                                            "guarantee": {"nvidia.com/gpu": 2, "cpu": 8}}},
}}
PROFILES = {"profiles": {"a100": {"display_name": "1 × A100", "gpu": {"model": "A100", "count": 1},
                                  "teams": ["vision", "students"]}}}

EXPECTED = {"partitions": [{
    "name": "default",
    "placementrules": [{"name": "provided", "create": False}],
    "preemption": {"enabled": True},
    "queues": [{"name": "root", "submitacl": "*", "parent": True, "queues": [
        {"name": "research", "parent": True,
         # per resource the larger of deserved and guarantee; cpu is YuniKorn's vcore, in millicores, memory in
         # bytes: YuniKorn parses integers only
         "resources": {"guaranteed": {"vcore": "256000m", "memory": str(2 * 2**40), "nvidia.com/gpu": "16"},
                       "max": {"vcore": "512000m", "memory": str(4 * 2**40), "nvidia.com/gpu": "32"}},
         "properties": {"preemption.policy": "disabled"},
         # below a non-reclaimable team, written on the child too: YuniKorn replaces properties on reload
         "queues": [{"name": "vision", "resources": {"guaranteed": {"vcore": "8000m", "nvidia.com/gpu": "2"}},
                     "properties": {"preemption.policy": "disabled"}}]},
        {"name": "students",
         # guarantee (3 GPUs) above deserved (2) is what YuniKorn guarantees; 1.5 cores are 1500 millicores
         "resources": {"guaranteed": {"vcore": "1500m", "memory": str(3 * 2**29), "nvidia.com/gpu": "3"},
                       "max": {"nvidia.com/gpu": "4"}}},
    ]}],
}]}


def policy_dir(tmp_path: Path, **changes) -> Path:
    directory = tmp_path / "policies"
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in (("cluster.yaml", CLUSTER), ("teams.yaml", TEAMS), ("profiles.yaml", PROFILES)):
        (directory / name).write_text(yaml.safe_dump(content, sort_keys=False))
    for name, content in changes.items():
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(content, sort_keys=False))
    return directory


def render(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["render", *args])
    return code, out.getvalue(), err.getvalue()


def test_the_queue_configuration_is_the_policys_teams_as_yunikorn_queues(tmp_path):
    assert yunikorn.queues_config(load_policy(policy_dir(tmp_path))) == EXPECTED
    assert yunikorn.queue_path(load_policy(policy_dir(tmp_path)), "vision") == "root.research.vision"


def check(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["policy", "check", *args])
    return code, out.getvalue(), err.getvalue()


def refused_by_both(directory: Path, field: str, *words: str) -> None:
    """`gpupool render` writes nothing and `gpupool policy check` refuses, each naming the file defining the team,
    the field and `words`."""
    code, out, err = render("--policies", str(directory))
    assert code == 1 and out == "" and "nothing was rendered" in err
    line = next(line for line in err.splitlines() if f": {field}: " in line)
    assert f"{directory / 'teams.yaml'}: {field}: " in line and all(word in line for word in words), line
    code, out, err = check(str(directory))
    assert code == 1 and out == "" and "refused for YuniKorn" in err
    line = next(line for line in err.splitlines() if f": {field}: " in line)
    assert f"{directory / 'teams.yaml'}: {field}: " in line and all(word in line for word in words), line


@pytest.mark.parametrize("resource, value, words", [
    ("cpu", "0.0005", ["not a whole number of millicores", "accepted: e.g. 2, 1.5, 500m"]),
    ("memory", "500m", ["not a whole number of bytes", "accepted: e.g. 512Mi, 1.5Gi"]),
    ("nvidia.com/gpu", "0.5", ["not a whole number", "nvidia.com/gpu.shared"]),
])
def test_a_quantity_yunikorn_cannot_write_as_an_integer_is_refused_naming_file_and_field(
        resource, value, words, tmp_path):
    teams = yaml.safe_load(yaml.safe_dump(TEAMS))
    teams["teams"]["students"]["queue"]["deserved"][resource] = value
    refused_by_both(policy_dir(tmp_path, teams=teams), "teams.students.queue.deserved", f"{resource} {value}", *words)


def test_a_guaranteed_above_the_queues_own_max_is_refused(tmp_path):
    teams = yaml.safe_load(yaml.safe_dump(TEAMS))
    teams["teams"]["students"]["queue"]["guarantee"] = {"nvidia.com/gpu": 6}  # max is 4
    refused_by_both(policy_dir(tmp_path, teams=teams), "teams.students.queue.capability",
                    "guaranteed nvidia.com/gpu 6", "max nvidia.com/gpu 4", "larger than its max")


def test_a_max_above_a_grandparents_is_refused(tmp_path):
    # the policy check compares a child with its parent; YuniKorn with the smallest max above it
    teams = yaml.safe_load(yaml.safe_dump(TEAMS))
    teams["teams"]["students"]["queue"] = {"parent": "vision", "capability": {"nvidia.com/gpu": 40}}
    refused_by_both(policy_dir(tmp_path, teams=teams), "teams.students.queue.capability",
                    "capability nvidia.com/gpu 40", "parent's max", "nvidia.com/gpu 32")


def test_a_parent_whose_guaranteed_is_below_its_childrens_sum_is_refused():
    # The policy check on load already refuses such a tree (policies.references): checked on a policy built
    # past it, the YuniKorn check refuses it too, as YuniKorn's validator does.
    from gpupool.policies.engines import yunikorn_problems
    from gpupool.policies.model import Policy

    policy = Policy.model_validate({**CLUSTER, "teams": {
        "research": {"queue": {"deserved": {"nvidia.com/gpu": 2}}},
        "vision": {"queue": {"parent": "research", "guarantee": {"nvidia.com/gpu": 2}}},
        "nlp": {"queue": {"parent": "research", "deserved": {"nvidia.com/gpu": 1}}}}})
    [(path, message)] = yunikorn_problems(policy)
    assert path == ("teams", "research", "queue", "deserved")
    assert "children's (nlp, vision) guaranteed add up to nvidia.com/gpu 3" in message
    with pytest.raises(ValueError, match="teams.research.queue.deserved"):
        yunikorn.queues_config(policy)


def test_no_queue_carries_a_priority_offset_the_priority_class_alone_ranks_pods(tmp_path):
    # YuniKorn adds each queue's priority.offset on a pod's path to the pod's priority, which the team's
    # PriorityClass already sets: an offset would count the team's priority twice (three times under a parent).
    code, out, err = render("--policies", str(policy_dir(tmp_path)))
    assert code == 0, err
    objects = list(yaml.safe_load_all(out))
    queues = next(o for o in objects if o["metadata"]["name"] == "yunikorn-configs")["data"]["queues.yaml"]
    assert "priority" not in queues
    classes = {o["metadata"]["name"]: o["value"] for o in objects if o["kind"] == "PriorityClass"}
    assert classes["gpupool-vision"] == 100 and classes["gpupool-students"] == 10


def test_every_queue_below_a_non_reclaimable_team_says_disabled_itself(tmp_path):
    # YuniKorn copies a parent's preemption.policy to a child only when it creates the child and replaces the
    # child's properties on each reload: a grandchild, reclaimable itself, is written disabled as well.
    teams = yaml.safe_load(yaml.safe_dump(TEAMS))
    teams["teams"]["students"]["queue"] = {"parent": "vision", "reclaimable": True}
    profiles = {"profiles": {"a100": {**PROFILES["profiles"]["a100"], "teams": ["students"]}}}
    queues = yunikorn.queues_config(load_policy(policy_dir(tmp_path, teams=teams, profiles=profiles)))
    queues = queues["partitions"][0]["queues"][0]
    [research] = queues["queues"]
    [vision] = research["queues"]
    [students] = vision["queues"]
    assert [q["properties"] for q in (research, vision, students)] == [{"preemption.policy": "disabled"}] * 3


def test_members_or_profiles_on_a_team_with_child_teams_are_refused_with_the_way_out(tmp_path):
    # YuniKorn never places a pod in a parent queue: research's members and a profile naming it could start nothing
    teams = yaml.safe_load(yaml.safe_dump(TEAMS))
    teams["teams"]["research"]["members"] = ["alice"]
    profiles = {"profiles": {"a100": {**PROFILES["profiles"]["a100"], "teams": ["research", "students"]}}}
    directory = policy_dir(tmp_path, teams=teams, profiles=profiles)
    refused_by_both(directory, "teams.research.members", "team 'research' has child teams (vision)",
                    "root.research", "move its members to a child team", "queue.parent: research")
    code, _, err = check(str(directory))
    line = next(line for line in err.splitlines() if ": profiles.a100.teams: " in line)
    assert f"{directory / 'profiles.yaml'}: profiles.a100.teams: lists team 'research'" in line
    assert "list its child teams instead" in line
    # the way out: the members and the profile on the child team
    teams["teams"]["vision"]["members"] = teams["teams"]["research"].pop("members")
    profiles["profiles"]["a100"]["teams"] = ["vision", "students"]
    code, out, err = check(str(policy_dir(tmp_path / "fixed", teams=teams, profiles=profiles)))
    assert code == 0 and out.startswith("OK "), err


def test_pods_name_their_queue_and_application_in_yunikorns_current_annotations(tmp_path):
    # k8shim 1.8 reads `yunikorn.apache.org/queue` and `.../app-id` (annotations); a label value (at most 63
    # characters) could not hold the path of a child team under a parent, both of the longest names
    teams = {"teams": {"p" * 32: {}, "c" * 32: {"queue": {"parent": "p" * 32}}}}
    profiles = {"profiles": {"a100": {**PROFILES["profiles"]["a100"], "teams": ["c" * 32]}}}
    path = yunikorn.queue_path(load_policy(policy_dir(tmp_path, teams=teams, profiles=profiles)), "c" * 32)
    assert len(path) == 70
    assert (yunikorn.QUEUE_ANNOTATION, yunikorn.APPLICATION_ANNOTATION) == (
        "yunikorn.apache.org/queue", "yunikorn.apache.org/app-id")
    docs = (Path(__file__).resolve().parents[3] / "docs" / "kubernetes.md").read_text()
    assert f"`{yunikorn.QUEUE_ANNOTATION}: root.T`" in docs and f"`{yunikorn.APPLICATION_ANNOTATION}`" in docs


def test_jobs_preemption_off_turns_the_partitions_preemption_off(tmp_path):
    policy = load_policy(policy_dir(tmp_path, jobs={"jobs": {"preemption": {"enabled": False}}}))
    assert yunikorn.queues_config(policy)["partitions"][0]["preemption"] == {"enabled": False}


def test_render_writes_the_configmap_in_yunikorns_namespace_instead_of_volcano_queues(tmp_path):
    code, out, err = render("--policies", str(policy_dir(tmp_path)), "--yunikorn-namespace", "yk")
    assert code == 0, err
    objects = list(yaml.safe_load_all(out))
    assert not [o for o in objects if o["kind"] == "Queue"]
    configs = [o for o in objects if o["metadata"]["name"] == "yunikorn-configs"]
    assert len(configs) == 1 and configs[0]["kind"] == "ConfigMap" and configs[0]["metadata"]["namespace"] == "yk"
    assert list(configs[0]["data"]) == ["queues.yaml"]
    assert yaml.safe_load(configs[0]["data"]["queues.yaml"]) == EXPECTED
    # YuniKorn's service settings are the operator's yunikorn-defaults, not gpupool's
    assert "service." not in configs[0]["data"]["queues.yaml"]
    # the PriorityClasses the pods name come first, as under Volcano; the policy ConfigMap is still rendered
    kinds = [o["kind"] for o in objects]
    assert kinds.index("PriorityClass") < objects.index(configs[0])
    assert any(o["metadata"]["name"] == "gpupool-policies" for o in objects)
    assert "research set queue.weight, which YuniKorn has no field for" in err.replace("teams ", "")


def test_the_rendering_is_byte_for_byte_the_same_whatever_the_order_of_the_teams(tmp_path):
    first = render("--policies", str(policy_dir(tmp_path / "a")))[1]
    assert render("--policies", str(policy_dir(tmp_path / "a")))[1] == first
    reordered = {"teams": dict(reversed(list(TEAMS["teams"].items())))}
    again = render("--policies", str(policy_dir(tmp_path / "b", teams=reordered)))[1]

    def configs(text: str) -> str:  # the policy ConfigMap carries the files' own text, which differs
        return next(part for part in text.split("---\n") if "name: yunikorn-configs" in part)

    assert configs(again) == configs(first) and "queues.yaml: |" in configs(first)


def test_helm_values_carry_the_configmap_and_no_queue(tmp_path):
    directory = policy_dir(tmp_path)
    code, out, err = render("--policies", str(directory), "--helm-values")
    assert code == 0, err
    objects = yaml.safe_load(out)["gpupool"]["objects"]
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"] == ["yunikorn-configs"]
    assert not [o for o in objects if o["kind"] == "Queue"]
    policy = load_policy(directory)
    files = {p.name: p.read_text() for p in sorted(directory.glob("*.yaml"))}
    assert yunikorn.helm_values(policy, files, Release())["gpupool"]["objects"] == objects


def test_a_backend_the_named_engine_cannot_place_renders_nothing(tmp_path):
    cluster = {**CLUSTER, "models": {"A100": {**CLUSTER["models"]["A100"], "backends": ["hami", "mig", "whole"]}}}
    profiles = {"profiles": {**PROFILES["profiles"], "half": {
        "display_name": "0.5 × A100", "gpu": {"model": "A100", "share": 0.5}, "teams": ["vision"]}}}
    code, out, err = render("--policies", str(policy_dir(tmp_path, cluster=cluster, profiles=profiles)))
    assert code == 1 and out == ""
    assert "profiles.half: backend 'hami' (model A100) cannot work under settings.engine 'yunikorn'" in err
    assert "nothing was rendered" in err


def test_a_policy_naming_no_engine_renders_volcano_queues_and_notes_what_volcano_cannot_place(tmp_path):
    cluster = {"models": {"A100": {**CLUSTER["models"]["A100"], "backends": ["hami", "mig", "whole"]}}}
    profiles = {"profiles": {**PROFILES["profiles"], "half": {
        "display_name": "0.5 × A100", "gpu": {"model": "A100", "share": 0.5}, "teams": ["vision"]}}}
    code, out, err = render("--policies", str(policy_dir(tmp_path, cluster=cluster, profiles=profiles)))
    assert code == 0, err
    assert {o["kind"] for o in yaml.safe_load_all(out)} >= {"Queue", "PriorityClass"}
    assert "note: in the Kubernetes mode, profiles.half: backend 'hami'" in err


def test_a_yunikorn_namespace_that_is_not_dns_safe_is_refused(tmp_path):
    code, out, err = render("--policies", str(policy_dir(tmp_path)), "--yunikorn-namespace", "YK_1")
    assert code == 1 and out == "" and "yunikorn namespace 'YK_1' is not DNS-safe" in err


def test_the_chart_emits_the_rendered_configmap_unchanged(tmp_path):
    # The chart (helm/gpupool) rendered by the real Helm library with the values `--helm-values` writes
    import helm_python as helm

    code, out, err = render("--policies", str(policy_dir(tmp_path)), "--helm-values", "--release", "pool")
    assert code == 0, err
    values = yaml.safe_load(out)
    values["postgresql"] = {"host": "postgres.db.svc", "existingSecret": "gpupool-postgres"}
    values["jupyterhub"]["enabled"] = False
    values["jupyterhub"]["hub"]["extraEnv"]["PGPASSWORD"] = {
        "valueFrom": {"secretKeyRef": {"name": "gpupool-postgres", "key": "password"}}}
    chart = Path(__file__).resolve().parents[3] / "helm" / "gpupool"
    with helm.Chart.load(chart) as loaded:
        manifests = loaded.render(values, name="pool", namespace="jhub", is_install=True)
    emitted = [doc for name, text in sorted(manifests.items()) if not name.endswith("NOTES.txt")
               for doc in yaml.safe_load_all(text) if doc]
    configs = [o for o in emitted if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "yunikorn-configs"]
    assert configs == [o for o in values["gpupool"]["objects"] if o["metadata"]["name"] == "yunikorn-configs"]
    assert yaml.safe_load(configs[0]["data"]["queues.yaml"]) == EXPECTED
    assert not [o for o in emitted if o["kind"] == "Queue"]
