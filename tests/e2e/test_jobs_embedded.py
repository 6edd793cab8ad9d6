"""Training jobs in the embedded mode, end to end: the real hub (`gpupool up`), its job runner, the jobs
service, the `gpupool jobs` command, real processes (a tiny CPU PyTorch model, tests/train_loop.py).

No double anywhere: the declared H200 card is the pool's inventory (no NVML here), as in every embedded test.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import signal
import subprocess
import sys
import tempfile
import time
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import psutil
import pytest
import requests
import sqlalchemy as sa
import torch

from gpupool.hub.accounting.ledger import INTERVALS, Ledger
from harness import Hub, Terminal, platform_command

HERE = Path(__file__).resolve().parents[1]  # the tests folder (train_loop.py)
POLICY = {
    "gpus.yaml": "models:\n  H200: {vendor: nvidia, memory_gib: 141, backends: [hami, whole]}\n"
                 "inventory:\n  - {model: H200, count: 1}\n",
    "teams.yaml": """
teams:
  vision: {priority: 0, quota: {gpus: 10, per_user_gpus: 10}, job_priorities: [low, normal, high]}
  other: {priority: 0}
""",
    "profiles.yaml": """
profiles:
  h200: {display_name: 1 × H200, gpu: {model: H200, count: 1}, teams: [vision, other], default: true}
  cpu: {display_name: CPU only, teams: [vision, other]}
""",
    "billing.yaml": "billing: {prices: {H200: '3.20'}}\n",
    # A save on SIGTERM fsyncs its files: on a machine busy writing (a pip install beside the tests) that took
    # over 60 s once, and the SIGKILL at the end of the grace period lost it. No test here waits for the grace.
    "jobs.yaml": """
jobs:
  grace_seconds: 240
  restarts: {max_restarts: 2, backoff_seconds: 1, max_backoff_seconds: 2, never_retry_exit_codes: [2]}
""",
}
ENDED = ("succeeded", "failed", "cancelled")
#: A job that runs until it is stopped, and exits 0 on SIGTERM.
UNTIL_STOPPED = [sys.executable, "-c", "import signal, sys, time\n"
                 "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
                 "print('holding the card', flush=True)\n"
                 "while True: time.sleep(0.1)"]


@pytest.fixture(scope="module")
def shared_hub(tmp_path_factory):
    """One hub for the tests that need no fresh one (a hub start is most of a short test's time); `hub` leaves it
    with nothing running between them. The tests that need another configuration start their own."""
    hub = Hub(tmp_path_factory.mktemp("jobs"), POLICY, 'c.LocalGPUSpawner.run_as = "self"', mlflow=True)
    hub.start()
    hub.wait_service("jobs", "health")
    hub.wait_service("mlflow", "health")
    yield hub
    hub.kill()
    hub.kill_leftovers()  # no job, server or service outlives the module


@pytest.fixture
def hub(shared_hub):
    """The module's hub, running (a test that restarts it and fails may have left it down), and after the test
    with no job, server or share of the card left (`leave_nothing_running`)."""
    if shared_hub.process.poll() is not None:
        shared_hub.kill_leftovers()  # its proxy and services, which a killed hub leaves
        shared_hub.start()
        shared_hub.wait_service("jobs", "health")
    yield shared_hub
    leave_nothing_running(shared_hub)


class Jobs:
    """The jobs service's REST API as one user calls it, with their own hub token."""

    def __init__(self, hub: Hub, user: str):
        self.hub, self.user = hub, user
        self.session = requests.Session()
        self.token = hub.user_token(user)
        self.session.headers["Authorization"] = f"token {self.token}"
        self.base = f"{hub.url}/services/jobs/"

    def call(self, method: str, path: str, **kw) -> requests.Response:
        return self.session.request(method, self.base + path, timeout=30, **kw)

    def submit(self, **body) -> dict:
        reply = self.call("POST", "api/jobs", json=body)
        assert reply.status_code == 201, reply.text
        return reply.json()

    def get(self, job_id: str) -> dict:
        reply = self.call("GET", f"api/jobs/{job_id}")
        assert reply.status_code == 200, reply.text
        return reply.json()

    def wait(self, job_id: str, until, timeout: float = 240, what: str = "") -> dict:
        deadline = time.monotonic() + timeout
        job = self.get(job_id)
        while time.monotonic() < deadline:
            job = self.get(job_id)
            if until(job):
                return job
            time.sleep(0.3)
        raise AssertionError(f"job {job_id} did not get {what or 'there'} in {timeout} s: {json.dumps(job)[:3000]}\n"
                             f"{self.hub.log.read_text()[-3000:]}")

    def cli(self, *args: str, cwd: Path) -> subprocess.CompletedProcess:
        """`gpupool jobs ARGS` as in a server's terminal: its token and the hub's address in the environment."""
        env = {**os.environ, "JUPYTERHUB_API_TOKEN": self.token, "GPUPOOL_HUB_URL": self.hub.url + "/"}
        return subprocess.run([str(platform_command(None)), "jobs", *args], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=120, check=False)


def leave_nothing_running(hub: Hub) -> None:
    """The clean-up between the tests sharing a hub: every job not ended is cancelled (by the admin, who sees all
    jobs) and has ended, every server (named ones too) is stopped, and the pool then holds nothing, so that the
    next test finds its one card free."""
    admin = Jobs(hub, "admin")
    for job in admin.call("GET", "api/jobs").json()["jobs"]:
        if job["state"] not in ENDED:
            reply = admin.call("POST", f"api/jobs/{job['id']}/cancel")
            assert reply.status_code in (200, 409), reply.text  # 409: it ended meanwhile
            admin.wait(job["id"], lambda j: j["state"] in ENDED, what="to its end after a cancel")
    for user in hub.api("GET", "/users").json():
        for server in user.get("servers", {}):
            hub.stop_server(user["name"], timeout=120, server=server)
    deadline = time.monotonic() + 60
    while hub.allocations():
        assert time.monotonic() < deadline, f"the pool still holds {hub.allocations()} after the clean-up"
        time.sleep(0.2)


def job_intervals(hub: Hub, job_id: str) -> list:
    """The ledger's intervals of the job's runs, in order."""
    ledger = Ledger(hub.ledger_url, migrate=False)
    try:
        with ledger.engine.connect() as connection:
            rows = connection.execute(sa.select(INTERVALS).where(INTERVALS.c.key.like(f"job:{job_id}@%"))
                                      .order_by(INTERVALS.c.start_at, INTERVALS.c.id)).all()
        return rows
    finally:
        ledger.dispose()


def closed_intervals(hub: Hub, job_id: str, count: int, timeout: float = 60) -> list:
    """The job's `count` ledger intervals once all are closed: the runner records a run's end in the jobs table,
    then closes its interval (the job may read as ended a moment before its bill does)."""
    deadline = time.monotonic() + timeout
    while True:
        intervals = job_intervals(hub, job_id)
        if len(intervals) == count and all(i.end_at is not None for i in intervals):
            return intervals
        assert time.monotonic() < deadline, f"job {job_id}: not {count} closed intervals in {timeout} s: {intervals}"
        time.sleep(0.2)


def wait_for(path: Path, jobs: Jobs, job_id: str, timeout: float = 180) -> str:
    """The text of `path` once the job's run wrote it (the job's state and log when it never does)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        job = jobs.get(job_id)
        assert job["state"] not in ENDED, f"job {job_id} ended before writing {path.name}: {json.dumps(job)[:3000]}"
        time.sleep(0.2)
    raise AssertionError(f"{path} did not appear in {timeout} s: {json.dumps(jobs.get(job_id))[:3000]}")


def steps_of(out: Path) -> list[int]:
    return [int(line) for line in (out / "steps").read_text().split()]


def uninterrupted(out: Path, steps: int, every: int) -> dict:
    result = subprocess.run([sys.executable, str(HERE / "train_loop.py"), str(out), "--steps", str(steps),
                             "--every", str(every)], env={k: v for k, v in os.environ.items()
                                                          if k != "GPUPOOL_CHECKPOINT_DIR"},
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out / "final.pt")


def test_a_job_sigkilled_mid_run_restarts_by_itself_and_resumes_to_the_same_weights(hub, tmp_path):
    steps, every, kill_at = 40, 5, 13
    whole = uninterrupted(tmp_path / "whole", steps, every)
    hub.add_user("alice", "vision")
    alice = Jobs(hub, "alice")
    out = tmp_path / "job"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # Submitted as a person does, from a terminal in another folder: `gpupool jobs submit … -- CMD`.
    submitted = alice.cli("submit", "--profile", "h200", "--max-restarts", "2", "--json", "--",
                          sys.executable, str(HERE / "train_loop.py"), str(out), "--steps", str(steps),
                          "--every", str(every), "--pause-at", str(kill_at), cwd=elsewhere)
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["id"]
    assert json.loads(submitted.stdout)["workdir"] == str(elsewhere)  # it runs where it was submitted from

    pid = int(wait_for(out / "paused", alice, job_id))  # the training process, at step 13: a crash of it
    os.kill(pid, signal.SIGKILL)
    job = alice.wait(job_id, lambda j: j["state"] in ENDED, what="to its end")
    assert job["state"] == "succeeded", job
    assert [r["event"] for r in job["runs"]] == ["failed", "succeeded"]
    assert job["runs"][0]["exit_code"] == -signal.SIGKILL and job["runs"][0]["counted"]
    assert job["restarts"] == 1
    # It resumed from the last committed checkpoint (step 10): at most `every` steps redone, the counter goes on.
    assert steps_of(out) == list(range(1, kill_at + 1)) + list(range(10 + 1, steps + 1))
    again = torch.load(out / "final.pt")
    assert all(torch.equal(whole[name], again[name]) for name in whole)  # bit for bit
    # Its checkpoints are in its own folder of the team's storage, which only its user enters.
    checkpoints = Path(job["checkpoint_dir"])
    assert checkpoints == hub.team_root / "vision" / "checkpoints" / "alice" / job_id
    assert (checkpoints.stat().st_mode & 0o777, checkpoints.parent.stat().st_mode & 0o777) == (0o700, 0o700)

    # Each run is one ledger interval of kind `job`, billed, one after the other.
    intervals = closed_intervals(hub, job_id, 2)
    assert [(i.kind, i.state, i.how) for i in intervals] == [("job", "running", "failed"), ("job", "running", "stopped")]
    assert intervals[0].end_at <= intervals[1].start_at
    assert float(job["gpu_hours"]) > 0 and job["cost"] != ""

    # What the person sees: show (the restart and its cause), logs (every run's output).
    shown = alice.cli("show", job_id, cwd=elsewhere)
    assert shown.returncode == 0, shown.stderr
    assert "succeeded" in shown.stdout and "run 1:" in shown.stdout and "exit -9" in shown.stdout, shown.stdout
    logs = alice.cli("logs", job_id, cwd=elsewhere)
    assert "resumed from step 10" in logs.stdout and "run 2 of job" in logs.stdout, logs.stdout
    listed = alice.cli("list", cwd=elsewhere)
    assert job_id in listed.stdout and "succeeded" in listed.stdout


def test_a_notebook_preempts_a_low_priority_job_which_saves_requeues_and_resumes(hub, tmp_path):
    steps = 30
    whole = uninterrupted(tmp_path / "whole", steps, 100)
    hub.add_user("alice", "vision")
    alice = Jobs(hub, "alice")
    out = tmp_path / "job"
    job = alice.submit(profile="h200", priority="low", preemptible=True,
                       command=[sys.executable, str(HERE / "train_loop.py"), str(out), "--steps", str(steps),
                                "--every", "100", "--pause-at", "7"])
    wait_for(out / "paused", alice, job["id"])  # it holds the only card, at step 7, with no checkpoint yet
    # A notebook (normal priority: above a low job) asks for the card: the job is preempted for it.
    assert hub.api("POST", "/users/alice/server", json={"profile": "h200"}).status_code in (201, 202)
    hub.wait_ready("alice", timeout=240)
    preempted = alice.wait(job["id"], lambda j: j["runs"] and j["runs"][0]["ended_at"], what="preempted")
    assert preempted["runs"][0]["event"] == "preempted" and not preempted["runs"][0]["counted"], preempted
    assert preempted["restarts"] == 0 and preempted["state"] in ("queued", "restarting"), preempted
    assert "asked to stop: saved step 7" in alice.call("GET", f"api/jobs/{job['id']}/log").text
    time.sleep(2)  # the queue has had its passes: the job waits, the notebook keeps the card
    assert alice.get(job["id"])["state"] == "queued"

    hub.stop_server("alice", timeout=120)  # room again: the job resumes from the checkpoint it saved
    done = alice.wait(job["id"], lambda j: j["state"] in ENDED, what="to its end")
    assert done["state"] == "succeeded" and done["restarts"] == 0, done
    assert [r["event"] for r in done["runs"]] == ["preempted", "succeeded"]
    assert steps_of(out) == list(range(1, steps + 1))  # saved at the step it was stopped: nothing redone
    again = torch.load(out / "final.pt")
    assert all(torch.equal(whole[name], again[name]) for name in whole)
    # The card was never held twice: job run 1, then the notebook, then job run 2.
    runs = closed_intervals(hub, job["id"], 2)
    assert [(i.how, i.state) for i in runs] == [("preempted", "running"), ("stopped", "running")]
    ledger = Ledger(hub.ledger_url, migrate=False)
    with ledger.engine.connect() as connection:
        # alice's notebook: the module's hub has the other tests' servers in its ledger
        (server,) = connection.execute(sa.select(INTERVALS).where(INTERVALS.c.kind == "server",
                                                                  INTERVALS.c.state == "running",
                                                                  INTERVALS.c.user == "alice")).all()
    ledger.dispose()
    assert runs[0].end_at <= server.start_at and server.end_at <= runs[1].start_at


def test_a_suspended_job_saves_waits_and_resumes_where_it_stopped_without_a_restart_counted(hub, tmp_path):
    steps = 30
    whole = uninterrupted(tmp_path / "whole", steps, 100)
    hub.add_user("alice", "vision")
    alice = Jobs(hub, "alice")
    out = tmp_path / "job"
    job = alice.submit(profile="h200", command=[sys.executable, str(HERE / "train_loop.py"), str(out),
                                                "--steps", str(steps), "--every", "100", "--pause-at", "7"])
    wait_for(out / "paused", alice, job["id"])  # running, at step 7, with no checkpoint yet
    # Suspended from a terminal, as a person does: the run is stopped (SIGTERM: it saves) and the job waits.
    suspended = alice.cli("suspend", job["id"], cwd=tmp_path)
    assert suspended.returncode == 0 and "suspending" in suspended.stdout, suspended.stdout + suspended.stderr
    held = alice.wait(job["id"], lambda j: j["state"] == "suspended", what="suspended")
    assert [(r["event"], r["counted"]) for r in held["runs"]] == [("suspended", False)] and held["restarts"] == 0
    assert "asked to stop: saved step 7" in alice.call("GET", f"api/jobs/{job['id']}/log").text
    time.sleep(2)  # the runner has had its rounds: a suspended job is not started again, the card stays free
    assert alice.get(job["id"])["state"] == "suspended"
    again = alice.call("POST", f"api/jobs/{job['id']}/suspend")
    assert again.status_code == 409 and "only a queued, restarting or running job" in again.json()["message"]
    page = alice.call("GET", f"jobs/{job['id']}")
    assert page.status_code == 200 and 'id="resume"' in page.text and 'id="suspend"' not in page.text

    resumed = alice.cli("resume", job["id"], cwd=tmp_path)
    assert resumed.returncode == 0 and "queued" in resumed.stdout, resumed.stdout + resumed.stderr
    done = alice.wait(job["id"], lambda j: j["state"] in ENDED, what="to its end")
    assert done["state"] == "succeeded" and done["restarts"] == 0, done
    assert [r["event"] for r in done["runs"]] == ["suspended", "succeeded"]
    assert steps_of(out) == list(range(1, steps + 1))  # saved at the step it was stopped: nothing redone
    final = torch.load(out / "final.pt")
    assert all(torch.equal(whole[name], final[name]) for name in whole)
    assert [(i.how, i.state) for i in closed_intervals(hub, job["id"], 2)] == [("stopped", "running")] * 2
    assert alice.call("POST", f"api/jobs/{job['id']}/resume").status_code == 409


def test_an_mlflow_run_made_inside_a_job_is_tagged_with_that_jobs_gpu_hours_and_cost(hub, tmp_path):
    hub.add_user("alice", "vision")
    alice = Jobs(hub, "alice")
    out = tmp_path / "run_id"
    # A training script as a user writes it: MLflow from the job's environment (tracking URI, token,
    # experiment), a run of a few seconds on the job's card.
    script = ("import time, mlflow\n"
              "with mlflow.start_run() as run:\n"
              "    mlflow.log_metric('loss', 0.5)\n"
              "    time.sleep(3)\n"
              f"open({str(out)!r}, 'w').write(run.info.run_id)\n")
    job = alice.submit(profile="h200", command=[sys.executable, "-c", script])
    done = alice.wait(job["id"], lambda j: j["state"] in ENDED, what="to its end")
    assert done["state"] == "succeeded", alice.call("GET", f"api/jobs/{job['id']}/log").text
    reply = requests.get(f"{hub.url}/services/mlflow/api/2.0/mlflow/runs/get", params={"run_id": out.read_text()},
                         headers={"Authorization": f"token {alice.token}"}, timeout=60)
    assert reply.status_code == 200, reply.text
    tags = {t["key"]: t["value"] for t in reply.json()["run"]["data"]["tags"]}
    assert (tags["gpupool.user"], tags["gpupool.team"], tags["gpupool.profile"], tags["gpupool.job"]) == (
        "alice", "vision", "h200", job["id"])
    # At least the 3 s it slept on the whole card, at most the job's own run: priced at 3.20 EUR per GPU-hour.
    seconds = Fraction(tags["gpupool.gpu_seconds"])
    (interval,) = closed_intervals(hub, job["id"], 1)
    assert 2 <= seconds <= (interval.end_at - interval.start_at).total_seconds()
    assert Decimal(tags["gpupool.cost"]) > 0 and tags["gpupool.currency"] == "EUR"


def test_a_job_submitted_in_a_jupyterlab_terminal_runs_and_its_log_is_followed_there(hub):
    # The person's path: a server, its JupyterLab terminal (as JupyterLab drives it), and `gpupool jobs` with no
    # set-up: the server's own token and the hub's address are in the terminal's environment.
    hub.add_user("dora", "vision")
    assert hub.api("POST", "/users/dora/server", json={"profile": "cpu"}).status_code in (201, 202)
    hub.wait_ready("dora", timeout=240)
    terminal = Terminal(hub.url, "dora", hub.user_token("dora"), timeout=300)
    try:
        submitted = terminal.check("cd $(mktemp -d) && gpupool jobs submit --profile cpu --json -- python -c "
                                   "\"print('hello from a job', flush=True)\" | python -c "
                                   "'import json, sys; print(\"JOB=\" + json.load(sys.stdin)[\"id\"])'")
        job_id = re.findall(r"JOB=([0-9a-f]{12})", submitted)[-1]
        followed = terminal.check(f"gpupool jobs logs {job_id} --follow", timeout=240)
        assert "hello from a job" in followed.split(f"logs {job_id} --follow", 1)[-1], followed
        shown = terminal.check(f"gpupool jobs show {job_id}")
        assert "succeeded" in shown.split(f"show {job_id}", 1)[-1], shown
    finally:
        terminal.close()
        hub.stop_server("dora", timeout=120)


def test_failures_cancels_a_hub_restart_and_other_teams(hub, tmp_path):
    hub.add_user("alice", "vision")
    hub.add_user("bob", "other")
    alice, bob = Jobs(hub, "alice"), Jobs(hub, "bob")

    # Retries exhausted: failed, with the last exit code and the log's last lines.
    failing = alice.submit(profile="cpu", max_restarts=1, command=["sh", "-c", "echo boom; exit 3"])
    failed = alice.wait(failing["id"], lambda j: j["state"] in ENDED)
    assert (failed["state"], failed["exit_code"], failed["restarts"], len(failed["runs"])) == ("failed", 3, 1, 2)
    assert "after 1 restart" in failed["reason"] and "boom" in failed["log_tail"]
    # A never-retry exit code (a usage error) fails at once.
    usage = alice.wait(alice.submit(profile="cpu", command=["sh", "-c", "exit 2"])["id"], lambda j: j["state"] in ENDED)
    assert (usage["state"], len(usage["runs"])) == ("failed", 1)

    # One job holds the card; another waits behind it (not preemptible, same priority), a third is cancelled there.
    holder = alice.submit(profile="h200", command=UNTIL_STOPPED)
    alice.wait(holder["id"], lambda j: j["state"] == "running")
    queued = alice.submit(profile="h200", command=["sh", "-c", "echo second done"])
    cancelled = alice.submit(profile="h200", command=["sh", "-c", "echo never"])
    alice.wait(queued["id"], lambda j: "position" in j["reason"], what="a place in the queue")
    assert alice.call("POST", f"api/jobs/{cancelled['id']}/cancel").status_code == 200
    never = alice.wait(cancelled["id"], lambda j: j["state"] in ENDED)
    assert (never["state"], never["runs"], never["reason"]) == ("cancelled", [], "cancelled while queued: it never ran")

    # Another team's user gets 404 on every route of alice's job, and does not see it listed.
    for method, path in [("GET", "api/jobs/{}"), ("DELETE", "api/jobs/{}"), ("POST", "api/jobs/{}/cancel"),
                         ("GET", "api/jobs/{}/log"), ("GET", "jobs/{}")]:
        assert bob.call(method, path.format(holder["id"])).status_code == 404, (method, path)
    assert bob.call("GET", "api/jobs").json() == {"jobs": []}
    # Bad input gets a 4xx naming what is wrong, and makes no job.
    refusals = [({"profile": "h100", "command": ["x"]}, 400, "no profile 'h100' (options: cpu, h200)"),
                ({"profile": "cpu", "command": ["x"], "env": {"PATH": "/tmp"}}, 400, "PATH is set by the platform"),
                ({"profile": "cpu", "command": ["x"], "priority": "high"}, 403, "may not run high-priority jobs"),
                ({"profile": "cpu", "command": []}, 400, "command")]
    # A working folder its runs could not enter: refused at once, named (not three failed runs later).
    (tmp_path / "a-file").write_text("")
    for folder, why in ((tmp_path / "gone", "No such file or directory"), (tmp_path / "a-file", "Not a directory")):
        refusals.append(({"profile": "cpu", "command": ["x"], "workdir": str(folder)}, 400,
                         f"working folder '{folder}' cannot be entered by the account that runs the platform ({why})"))
    for body, status, words in refusals:
        reply = bob.call("POST", "api/jobs", json=body)
        assert (reply.status_code, words in reply.json()["message"]) == (status, True), reply.text
    assert bob.call("POST", "api/jobs", data="{not json").status_code == 400
    refused = bob.cli("submit", "--profile", "cpu", "--workdir", "gone", "--", "true", cwd=tmp_path)
    assert refused.returncode != 0 and f"working folder '{tmp_path / 'gone'}' cannot be entered" in refused.stderr, (
        refused.stdout, refused.stderr)
    assert bob.call("GET", "api/jobs").json() == {"jobs": []}

    # The hub crashes while one job runs and another waits: neither is lost.
    process = next(p for p in psutil.process_iter(["cmdline"]) if "holding the card" in " ".join(p.info["cmdline"] or []))
    hub.kill()
    hub.start()
    hub.wait_service("jobs", "health")
    assert process.is_running()  # the run went on while the hub was down
    assert alice.get(holder["id"])["state"] == "running" and alice.get(queued["id"])["state"] == "queued"
    assert alice.call("POST", f"api/jobs/{holder['id']}/cancel").status_code == 200  # the re-adopted run stops
    stopped = alice.wait(holder["id"], lambda j: j["state"] in ENDED)
    assert (stopped["state"], len(stopped["runs"]), stopped["runs"][0]["event"]) == ("cancelled", 1, "cancelled")
    second = alice.wait(queued["id"], lambda j: j["state"] in ENDED)
    assert second["state"] == "succeeded" and "second done" in second["log_tail"]
    # The holder's one run is one interval across the restart, ended by the cancel; the second's starts after it.
    (held,), (then,) = closed_intervals(hub, holder["id"], 1), closed_intervals(hub, queued["id"], 1)
    assert (held.how, held.state) == ("stopped", "running") and held.end_at <= then.start_at


#: A job as people write them: a tqdm bar over its steps (redrawn with "\r" at every step, on stderr) and a
#: gpupool.train checkpoint of 3 MiB at steps 100 and 200, in the folder the platform gives the job.
PROGRESS_BAR = [sys.executable, "-c", "import time\n"
                "from tqdm import tqdm\n"
                "from gpupool.train import Checkpoints\n"
                "ckpt = Checkpoints()\n"
                "for step in tqdm(range(1, 201), desc='training', mininterval=0, miniters=1):\n"
                "    time.sleep(0.01)\n"
                "    if step % 100 == 0: ckpt.save({'weights': bytes(3 * 2**20)}, step)\n"
                "print('trained', flush=True)\n"]


def test_the_jobs_page_lists_a_job_and_its_cancel_button_cancels_it(hub, tmp_path):
    # A person in a browser: signed up, approved, logged in on the hub's pages (cookies, the forms' _xsrf).
    (browser,) = hub.sign_up(["carol"], "carol-password-long").values()
    assert hub.api("POST", "/groups/vision/users", json={"users": ["carol"]}).status_code == 200
    carol = Jobs(hub, "carol")

    # A progress bar and checkpoints, followed from a terminal in another folder: the bar is one line at its
    # last state (its 200 redraws are in the stored log, not in what people read), and each checkpoint says
    # its step, when it was committed and its size.
    bar = carol.submit(profile="h200", command=PROGRESS_BAR)
    done = carol.wait(bar["id"], lambda j: j["state"] in ENDED, what="to its end")
    assert done["state"] == "succeeded", carol.call("GET", f"api/jobs/{bar['id']}/log").text[-3000:]
    assert (hub.state / "jobs" / bar["id"] / "log").read_bytes().count(b"\r") >= 200  # what tqdm wrote
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shown = carol.cli("show", bar["id"], cwd=elsewhere)
    logs = carol.cli("logs", bar["id"], cwd=elsewhere)
    for out in (shown, logs):
        assert out.returncode == 0, out.stderr
        assert "\r" not in out.stdout, out.stdout[-3000:]
        (line,) = [line for line in out.stdout.splitlines() if "training:" in line]
        assert "100%" in line and "200/200" in line, line
        for step in (100, 200):
            assert re.search(rf"gpupool\.train: checkpoint step {step} committed at \d{{4}}-\d\d-\d\d "
                             rf"\d\d:\d\d:\d\d UTC, 3\.0 MiB \(", out.stdout), out.stdout[-3000:]
    # GPU-hours at the bills' precision (4 places), the same in `jobs show` and on the Jobs page.
    (hours,) = re.findall(r"GPU-hours so far: (\S+),", shown.stdout)
    assert re.fullmatch(r"\d+\.\d{4}", hours) and Decimal(hours) > 0, hours
    listing = browser.get(f"{hub.url}/services/jobs/", timeout=60)
    row = listing.text.split(f'data-job="{bar["id"]}"', 1)[1].split("</tr>", 1)[0]
    assert f'<td class="num">{hours}</td>' in row, row
    page = browser.get(f"{hub.url}/services/jobs/jobs/{bar['id']}", timeout=60)
    assert f"{hours} GPU-h" in page.text and "\r" not in page.text.split('id="log"', 1)[1]

    job = carol.submit(profile="cpu", command=UNTIL_STOPPED)
    carol.wait(job["id"], lambda j: j["state"] == "running")
    listing = browser.get(f"{hub.url}/services/jobs/", timeout=60)  # through the hub's OAuth, as a browser
    assert listing.status_code == 200 and "Training jobs" in listing.text and f'data-job="{job["id"]}"' in listing.text
    page = browser.get(f"{hub.url}/services/jobs/jobs/{job['id']}", timeout=60)
    assert page.status_code == 200 and 'id="cancel"' in page.text and 'id="suspend"' in page.text
    (xsrf,) = set(re.findall(r'name="_xsrf" value="([^"]+)"', page.text))  # one token, in each of its forms
    cancel = f"{hub.url}/services/jobs/jobs/{job['id']}/cancel"
    assert browser.post(cancel, timeout=60, allow_redirects=False).status_code == 403  # no _xsrf: refused
    assert carol.get(job["id"])["state"] == "running"
    reply = browser.post(cancel, data={"_xsrf": xsrf}, timeout=60, allow_redirects=False)
    assert reply.status_code == 302, reply.text[-2000:]
    assert carol.wait(job["id"], lambda j: j["state"] in ENDED)["state"] == "cancelled"


@pytest.mark.skipif(os.geteuid() != 0, reason="jobs run as their users' own accounts only when the hub runs as "
                    "root (CI runs the tests as root)")
def test_a_job_runs_as_its_user_with_a_servers_environment_and_a_private_checkpoint_folder():
    # Not under pytest's private tmp_path: the job's user enters the team folders beside the state folder.
    tmp = Path(tempfile.mkdtemp(prefix="gpupool-jobs-"))
    os.chmod(tmp, 0o755)
    hub = Hub(tmp, POLICY, mlflow=False)
    hub.start()
    try:
        hub.wait_service("jobs", "health")
        hub.add_user("jobuser", "vision")
        jobs = Jobs(hub, "jobuser")
        script = ('id -un; pwd; echo "CUDA=$CUDA_VISIBLE_DEVICES JOB=$GPUPOOL_JOB_ID RESTARTS=$GPUPOOL_RESTART_COUNT '
                  'TEAM=$GPUPOOL_TEAM"; echo "CKPT=$GPUPOOL_CHECKPOINT_DIR"; echo "DVC=$DVC_GLOBAL_CONFIG_DIR"; '
                  'touch "$GPUPOOL_CHECKPOINT_DIR/mine"; '
                  'ls "$GPUPOOL_TEAM_ROOT/../state" 2>&1 | head -1')
        job = jobs.submit(profile="h200", command=["sh", "-c", script], workdir="/tmp")
        done = jobs.wait(job["id"], lambda j: j["state"] in ENDED)
        assert done["state"] == "succeeded", done
        log = done["log_tail"]
        account = pwd.getpwnam("gp-jobuser")
        assert "\ngp-jobuser\n/tmp\n" in log, log
        assert f"CUDA=GPU-declared-H200-0 JOB={job['id']} RESTARTS=0 TEAM=vision" in log, log
        checkpoints = Path(done["checkpoint_dir"])
        assert f"CKPT={checkpoints}" in log and "DVC=" in log
        assert ((checkpoints / "mine").stat().st_uid, checkpoints.stat().st_uid) == (account.pw_uid, account.pw_uid)
        assert checkpoints.stat().st_mode & 0o777 == 0o700
        shared = checkpoints.parent.parent
        assert (shared.stat().st_uid, shared.stat().st_mode & 0o777) == (0, 0o711)  # nobody plants a folder there
        assert "Permission denied" in log  # the hub's state folder is not the job's to read
        # A folder the job's account cannot enter is refused at submit, named; its team's folder (through the team
        # group, which the account may not have yet) is not.
        refused = jobs.call("POST", "api/jobs", json={"profile": "cpu", "command": ["true"], "workdir": str(hub.state)})
        assert refused.status_code == 400 and (f"working folder '{hub.state}' cannot be entered by your account "
                                               "gp-jobuser (Permission denied)") in refused.json()["message"], refused.text
        team = jobs.submit(profile="cpu", command=["sh", "-c", "id -un; pwd"], workdir=str(hub.team_root / "vision"))
        ran = jobs.wait(team["id"], lambda j: j["state"] in ENDED)
        assert ran["state"] == "succeeded" and f"\ngp-jobuser\n{hub.team_root / 'vision'}" in ran["log_tail"], ran
    finally:
        hub.kill()
        hub.kill_leftovers()  # no job, server or service outlives the test
        subprocess.run(["userdel", "--remove", "gp-jobuser"], capture_output=True, check=False)


def test_the_runner_never_follows_a_link_its_user_planted_for_the_exit_status(tmp_path):
    # The run's private folder is its user's: a planted link (to a root-owned file, a FIFO, /dev/zero) must not
    # make the hub read it, hang on it or read it whole.
    from gpupool.spawner.jobs.local import read_exit_status

    (tmp_path / "real").write_text("0\n")
    assert read_exit_status(tmp_path / "real") == 0
    (tmp_path / "link").symlink_to(tmp_path / "real")
    os.mkfifo(tmp_path / "fifo")
    assert [read_exit_status(tmp_path / n) for n in ("link", "fifo", "gone")] == [None, None, None]


@pytest.mark.skipif(os.geteuid() != 0, reason="gives folders to another account, which needs root")
def test_a_teammate_swapping_the_checkpoints_folder_meanwhile_gets_no_folder_made_elsewhere(tmp_path, monkeypatch):
    # Team members may rename anything in the team folder, `checkpoints` too: swapped for a link once the runner
    # has checked it, the job's folder must still be made where it was checked, never through the link.
    from gpupool.spawner.jobs import local as jobrunner

    team, elsewhere = tmp_path / "vision", tmp_path / "etc"
    (elsewhere / "alice").mkdir(parents=True)
    team.mkdir()
    real_fchown = os.fchown

    def swapped_meanwhile(fd, uid, gid):  # the racer's move, at the moment the runner hands `alice` over
        if not (team / "moved").exists():
            (team / "checkpoints").rename(team / "moved")
            (team / "checkpoints").symlink_to(elsewhere)
        real_fchown(fd, uid, gid)

    monkeypatch.setattr(jobrunner.os, "fchown", swapped_meanwhile)
    jobrunner.checkpoint_folder(team / "checkpoints" / "alice" / "job1", (65534, 65534))
    assert not (elsewhere / "alice" / "job1").exists()
    made = team / "moved" / "alice" / "job1"
    assert (made.stat().st_uid, made.stat().st_mode & 0o777) == (65534, 0o700)


@pytest.mark.skipif(os.geteuid() != 0, reason="checks a folder as another account, which needs root")
def test_a_workdir_refusal_tells_a_user_nothing_of_what_they_cannot_see():
    # The jobs service runs as root: its refusal says only what the job's own account could find out.
    from gpupool.hub.services.jobs_service import workdir_problem

    with tempfile.TemporaryDirectory() as tmp:  # pytest's own folders are closed to other accounts
        os.chmod(tmp, 0o755)
        private = Path(tmp) / "bobs"
        private.mkdir(mode=0o700)
        (private / "thesis.pdf").write_text("")
        # gp-nobody: an account not made yet, checked as the uid `nobody`
        said = {name: workdir_problem(str(private / name), "nobody", [], True) for name in ("thesis.pdf", "nothing")}
        assert said["thesis.pdf"].replace("thesis.pdf", "nothing") == said["nothing"], said
        assert "(No such file or directory, or a folder on its way that it cannot enter)" in said["nothing"]
        assert "(Permission denied)" in workdir_problem(str(private), "nobody", [], True)


def test_a_run_hears_sigterm_even_when_the_thread_starting_it_blocks_signals():
    # The job runner starts runs from a worker thread; a signal mask is inherited across exec, so a run started
    # from a thread with SIGTERM blocked would never hear it (it waits for the SIGKILL). Its processes unblock.
    import signal
    import threading

    from gpupool.spawner.jobs.local import hear_signals

    show = [sys.executable, "-c", "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('SigBlk')))"]
    masks = {}

    def start(name, preexec):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        masks[name] = subprocess.run(show, capture_output=True, text=True, preexec_fn=preexec, check=True).stdout.strip()

    for name, preexec in (("as inherited", None), ("hear_signals", hear_signals)):
        thread = threading.Thread(target=start, args=(name, preexec))
        thread.start()
        thread.join()
    assert int(masks["as inherited"], 16) & (1 << (signal.SIGTERM - 1))  # the mechanism: the mask goes across exec
    assert int(masks["hear_signals"], 16) == 0, masks
