"""The first hour of a new admin and new users, driven the way people drive the platform.

One `gpupool up` per variant (a subprocess, as `make up` runs it) with a fresh state folder, for the whole
journey: the admin logs in in Chromium with the password `gpupool up` printed; three people sign up on the
sign-up page and the admin approves them at /hub/authorize; the admin puts them in a team with the `gpupool`
command from another folder; one picks "0.25 × H200" on the spawn page and gets JupyterLab; in a JupyterLab
terminal (its websocket, as JupyterLab drives it) she runs dvc, git and mlflow; a notebook's MLflow run is
priced; her usage page and the MLflow UI show her work without errors; the team's quota fills and the third
person's spawn page shows the queue, which she leaves with the page's Stop button. Screenshots of the main pages
go to docs/screenshots/ (made by this run, so they stay current).

The journey runs twice: with the hub run as root (each server then runs as its own Unix user and cannot read
the hub's state), and with the hub run by an ordinary Unix user that the test creates. Run by an ordinary user,
gpupool is a personal workstation where the admin alone logs in: the journey's people need the explicit,
loudly printed opt-in `--unsafe-shared-as-user`; its last step starts the same ordinary user's platform without
it and finds a personal workstation. Each step is one test,
named for what a person does; a step whose prerequisite an earlier step failed to make is set up through the
REST harness instead, so every step reports on its own. Nothing waits on a clock: every wait is for a
condition, with deadlines generous enough for two busy cores.
"""

from __future__ import annotations

import os
import pwd
import re
import secrets
import shutil
import subprocess
import tempfile
import textwrap
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import psutil
import pytest
import requests

from harness import Browser, Hub, Terminal
from ordinary_user import ordinary_user

REPO_ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = REPO_ROOT / "docs" / "screenshots"
TEAM = "vision"
#: The quota lets two quarter shares run at once: the third person waits, for a reason the page must name.
POLICY = {
    "policy.yaml": f"""
models:
  H200: {{vendor: nvidia, memory_gib: 141, backends: [hami]}}
inventory: [{{model: H200, count: 2}}]
teams:
  {TEAM}: {{display_name: Computer vision, priority: 100, quota: {{gpus: 0.5, per_user_gpus: 0.25}}}}
  nlp: {{display_name: Language models, priority: 50}}
profiles:
  cpu: {{display_name: CPU only, teams: [{TEAM}, nlp], default: true}}
  h200-quarter: {{display_name: 0.25 × H200, description: A quarter of an H200, gpu: {{model: H200, share: 0.25}},
                 teams: [{TEAM}, nlp]}}
billing: {{currency: EUR, prices: {{H200: '3.20'}}}}
""",
}
QUARTER = "0.25 × H200"
#: The people of the journey: two who work, and a third who finds the team's quota full.
PEOPLE = ("ada", "ben", "cleo")
RUN_NAME = "journey-run"
VARIANTS = ("hub-as-root", "hub-as-ordinary-user")


@dataclass
class Journey:
    """Everything the steps share: the hub, one browser, the people's passwords and what earlier steps made."""

    hub: Hub
    variant: str
    browser: Browser
    shots: Path
    hub_user: str
    admin_password: str | None
    login_answer_when_printed: list = field(default_factory=list)
    password_watcher: threading.Thread | None = None
    passwords: dict[str, str] = field(default_factory=lambda: {p: f"{p}-{secrets.token_hex(6)}" for p in PEOPLE})
    tokens: dict[str, str] = field(default_factory=dict)
    terminals: dict[str, Terminal] = field(default_factory=dict)
    made: dict = field(default_factory=dict)

    def shot(self, name: str) -> Path:
        return self.browser.screenshot(self.shots / f"{name}.png")

    def login(self, user: str, password: str) -> None:
        """`user` logs in on the hub's login page (after whoever used the browser before logged out)."""
        b = self.browser
        b.driver.execute_cdp_cmd("Network.clearBrowserCookies", {})
        b.get(f"{self.hub.url}/hub/login")
        b.wait(lambda d: b.css("#login_submit"), 120, "the login page has no Sign In button")
        b.fill({"username_input": user, "password_input": password})
        b.click("#login_submit")
        try:
            b.wait(lambda d: "/hub/login" not in d.current_url, 120)
        except Exception:
            raise AssertionError(f"{user} could not log in; the login page says:\n{b.text()[:2000]}") from None

    def token(self, user: str) -> str:
        if user not in self.tokens:
            reply = self.hub.api("POST", f"/users/{user}/tokens", json={"note": "journey"})
            assert reply.status_code == 201, reply.text
            self.tokens[user] = reply.json()["token"]
        return self.tokens[user]

    def ensure_member(self, user: str) -> None:
        """What the CLI step makes, made through the REST API when that step failed."""
        if self.hub.api("GET", f"/users/{user}").status_code == 404:
            self.hub.api("POST", f"/users/{user}")
        if user not in self.hub.api("GET", f"/groups/{TEAM}").json()["users"]:
            assert self.hub.api("POST", f"/groups/{TEAM}/users", json={"users": [user]}).status_code == 200

    def ensure_server(self, user: str) -> None:
        """`user`'s quarter-H200 server running, started through the REST API if the browser did not."""
        self.ensure_member(user)
        server = self.hub.server(user)
        if not server:
            reply = self.hub.api("POST", f"/users/{user}/server", json={"profile": "h200-quarter"})
            assert reply.status_code in (201, 202), reply.text
        self.hub.wait_ready(user, timeout=300)

    def terminal(self, user: str) -> Terminal:
        if user not in self.terminals:
            self.ensure_server(user)
            self.terminals[user] = Terminal(self.hub.url, user, self.token(user), timeout=300)
        return self.terminals[user]

    def mlflow(self, user: str, method: str, path: str, **kw) -> requests.Response:
        return requests.request(method, f"{self.hub.url}/services/mlflow/{path}", timeout=60,
                                headers={"Authorization": f"Bearer {self.token(user)}"}, **kw)

    def log_text(self, since: int = 0) -> str:
        return self.hub.log.read_bytes()[since:].decode(errors="replace")


def _watch_for_password(journey: Journey, stop: threading.Event) -> None:
    """The moment `gpupool up` prints the password, ask the printed address for its login page, as a person would."""
    while not stop.is_set():
        if journey.hub.log.exists() and "with the password" in journey.log_text():
            try:
                reply = requests.get(f"{journey.hub.url}/hub/login", timeout=30)
                journey.login_answer_when_printed.append(reply.status_code)
            except requests.ConnectionError:
                journey.login_answer_when_printed.append("connection refused")
            except requests.RequestException as error:
                journey.login_answer_when_printed.append(type(error).__name__)
            return
        stop.wait(0.05)


@pytest.fixture(scope="module", params=VARIANTS)
def journey(request, tmp_path_factory):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("headless Chromium is not installed (apt-get install chromium chromium-driver; "
                    "`make install` does it as root)")
    if request.param == "hub-as-root":
        if os.geteuid() != 0:
            pytest.skip("the hub-as-root journey needs the tests to run as root (CI does)")
        hub_user, unix_user = "root", None
    else:
        hub_user, problem = ordinary_user()
        if problem:
            pytest.skip(problem)
        unix_user = hub_user if os.geteuid() == 0 else None
    # Not under pytest's tmp_path, whose parents are private to the tests' user: the servers of real users
    # enter the team folders beside the state folder, and an ordinary hub user owns the whole tree.
    tmp = Path(tempfile.mkdtemp(prefix=f"gpupool-journey-{request.param}-"))
    os.chmod(tmp, 0o755)
    # Several people on a hub an ordinary user runs: only with the opt-in (without it: the last step).
    shared = ("--unsafe-shared-as-user",) if request.param == "hub-as-ordinary-user" else ()
    hub = Hub(tmp, POLICY, unix_user=unix_user, up_args=shared)
    if unix_user:
        account = pwd.getpwnam(unix_user)
        for path in [tmp, *tmp.rglob("*")]:
            os.chown(path, account.pw_uid, account.pw_gid)
    accounts_before = {a.pw_name for a in pwd.getpwall()}
    # Docs get the screenshots of the variant CI runs (root), or of the only one that can run here.
    documents = request.param == "hub-as-root" or os.geteuid() != 0
    shots = SCREENSHOTS if documents else tmp_path_factory.mktemp("journey-screenshots")
    browser = Browser(chromium, driver)
    journey = Journey(hub, request.param, browser, shots, hub_user, None)
    stop = threading.Event()
    watcher = journey.password_watcher = threading.Thread(target=_watch_for_password, args=(journey, stop),
                                                           daemon=True)
    watcher.start()
    try:
        hub.start()
        found = re.findall(r"with the password (\S+)", journey.log_text())
        journey.admin_password = found[0] if found else None
        yield journey
    finally:
        stop.set()
        for terminal in journey.terminals.values():
            terminal.close()
        browser.quit()
        try:
            for user in hub.api("GET", "/users").json():
                if user["servers"]:
                    hub.stop_server(user["name"], timeout=60)
        except (requests.RequestException, ValueError, AssertionError):
            pass  # the hub is gone already: stopping it below and killing what is left is all there is to do
        hub.stop()
        for process in psutil.process_iter(["cmdline"]):  # nothing this journey started outlives it
            if str(hub.state) in " ".join(process.info["cmdline"] or []):
                process.kill()
        if os.geteuid() == 0:  # the accounts the spawner made for the journey's people
            for name in {a.pw_name for a in pwd.getpwall()} - accounts_before:
                if any(name == p or name.endswith(f"-{p}") for p in PEOPLE):
                    subprocess.run(["userdel", "--remove", name], capture_output=True, check=False)
        shutil.rmtree(tmp, ignore_errors=True)


# --- the admin ------------------------------------------------------------------------------------------------

def test_01_the_printed_address_answers_as_soon_as_the_password_is_printed(journey):
    assert journey.admin_password, f"`gpupool up` printed no password:\n{journey.log_text()[-3000:]}"
    # The watcher asked the login page the moment the password appeared; its answer may still be on its way
    # (a busy machine): wait for the answer itself, which says whether the page answered when printed.
    journey.password_watcher.join(timeout=120)
    assert journey.login_answer_when_printed == [200], (
        f"when `gpupool up` printed the password, {journey.hub.url}/hub/login answered "
        f"{journey.login_answer_when_printed} (issue 12 item 10: print it when the hub routes answer)")


def test_01b_the_start_says_who_logs_in_and_an_ordinary_users_shared_hub_is_a_loud_opt_in(journey):
    log = journey.log_text()
    warning = "WARNING: --unsafe-shared-as-user"
    assert "users sign up on the login page" in log, log[-3000:]
    if journey.variant == "hub-as-root":
        assert warning not in log, log[-3000:]
    else:
        assert warning in log and f"EVERY USER'S SERVER RUNS AS {journey.hub_user}" in log, (
            f"a hub shared by several people but run by an ordinary user must say so loudly at start (issue 33 "
            f"item 2):\n{log[-3000:]}")


def test_02_the_admin_logs_in_in_chromium_with_the_printed_password(journey):
    b = journey.browser
    b.get(f"{journey.hub.url}/hub/login")
    b.wait(lambda d: b.css("#login_submit"), 120, "no login form")
    journey.shot("login")
    journey.login("admin", journey.admin_password)
    b.get(f"{journey.hub.url}/hub/home")
    b.wait_for_text("Admin")
    journey.shot("home-admin")


def test_03_people_sign_up_and_the_admin_approves_them_at_hub_authorize(journey):
    b = journey.browser
    for person in PEOPLE:
        b.driver.execute_cdp_cmd("Network.clearBrowserCookies", {})
        b.get(f"{journey.hub.url}/hub/signup")
        b.wait(lambda d: b.css("#signup_submit"), 120, "no sign-up form")
        password = journey.passwords[person]
        b.fill({"username_input": person, "password_input": password, "password_confirmation_input": password})
        if b.css("#email_input"):
            b.fill({"email_input": f"{person}@example.org"})
        if person == PEOPLE[0]:
            journey.shot("signup")
        b.click("#signup_submit")
        b.wait(lambda d: b.css(".alert"), 120, f"signing up {person} shows no answer:\n{b.text()[:2000]}")
        answer = b.css(".alert")[0]
        assert "alert-danger" not in answer.get_attribute("class"), f"signing up {person}: {answer.text}"
        if person == PEOPLE[0]:
            journey.shot("signup-sent")
    journey.login("admin", journey.admin_password)
    for person in PEOPLE:
        b.get(f"{journey.hub.url}/hub/authorize")
        link = f"button[data-approve='{person}']"  # a form POST with the page's _xsrf token, not a link
        b.wait(lambda d: b.css(link), 120, f"{person} is not on the authorize page:\n{b.text()[:2000]}")
        assert b.css(link)[0].text == "Authorize", f"{person} is already authorized before the admin approved"
        b.click(link)
        b.wait(lambda d: b.css(link) and b.css(link)[0].text == "Unauthorize", 120,
               f"approving {person} did not take:\n{b.text()[:2000]}")
    journey.shot("authorize")
    for person in PEOPLE:  # each logs in once: the hub knows them from then on
        journey.login(person, journey.passwords[person])
    assert {p for p in PEOPLE if journey.hub.api("GET", f"/users/{p}").status_code == 200} == set(PEOPLE)


def test_04_a_person_in_no_team_is_told_how_to_join_one_and_offered_no_start_button(journey):
    journey.login(PEOPLE[0], journey.passwords[PEOPLE[0]])
    b = journey.browser
    b.get(f"{journey.hub.url}/hub/spawn")
    text = b.wait_for_text("in no team")
    buttons = [e.get_attribute("value") or e.text for e in b.css("#spawn_form [type=submit], #spawn_form button")]
    assert not buttons, (f"a person in no team is offered {buttons} on the spawn page, which can only end in a 403 "
                         f"(issue 12 item 6); the page says:\n{text[:1000]}")


# --- the team, with the CLI -----------------------------------------------------------------------------------

@pytest.fixture
def elsewhere():
    """A folder of the admin's, far from the state folder (readable by an ordinary hub user, unlike tmp_path)."""
    folder = Path(tempfile.mkdtemp(prefix="gpupool-journey-admin-"))
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _cli(journey: Journey, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`gpupool …` as the admin types it: in a folder of its own, as the Unix user that runs the hub."""
    kw = {}
    if journey.variant == "hub-as-ordinary-user" and os.geteuid() == 0:
        account = pwd.getpwnam(journey.hub_user)
        kw = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
        os.chown(cwd, account.pw_uid, account.pw_gid)
    # The admin's own environment: the one `gpupool up` was started from (the harness gives each hub its own
    # XDG_STATE_HOME, where `gpupool up` records the running platform for the CLI).
    env = {**journey.hub.env, "HOME": pwd.getpwnam(journey.hub_user).pw_dir}
    return subprocess.run([str(journey.hub.command), *args], cwd=cwd, capture_output=True, text=True, timeout=120, env=env,
                          **kw)


def test_05_the_admin_puts_them_in_a_team_with_the_cli_from_another_folder(journey, elsewhere):
    try:
        for person in PEOPLE:
            done = _cli(journey, "team", "add-member", TEAM, person, cwd=elsewhere)
            assert done.returncode == 0, (
                f"`gpupool team add-member {TEAM} {person}` from {elsewhere} failed ({done.returncode}): "
                f"{done.stderr.strip()} (issue 12 item 9: the CLI must find the running platform)")
            assert f"{person} is now a member of team {TEAM}" in done.stdout, done.stdout
        assert set(PEOPLE) <= set(journey.hub.api("GET", f"/groups/{TEAM}").json()["users"])
    finally:
        for person in PEOPLE:
            journey.ensure_member(person)


def test_06_the_cli_refuses_a_typo_instead_of_creating_a_user(journey, elsewhere):
    done = _cli(journey, "team", "add-member", TEAM, "nosuchuser", "--state-dir", str(journey.hub.state),
                cwd=elsewhere)
    created = journey.hub.api("GET", "/users/nosuchuser").status_code == 200
    assert done.returncode != 0 and not created, (
        f"`gpupool team add-member {TEAM} nosuchuser` exited {done.returncode} ({done.stdout.strip()}"
        f"{done.stderr.strip()}) and {'created' if created else 'did not create'} the user "
        "(issue 12 item 9: refuse unknown users, or create them only with --create)")


# --- a server, a terminal, a notebook -------------------------------------------------------------------------

def test_07_a_person_picks_a_quarter_h200_on_the_spawn_page_and_gets_jupyterlab(journey):
    person = PEOPLE[0]
    b = journey.browser
    try:
        journey.login(person, journey.passwords[person])
        b.get(f"{journey.hub.url}/hub/spawn")
        b.wait_for_text(QUARTER)
        journey.shot("spawn")
        labels = [e for e in b.css("#spawn_form label") if QUARTER in e.text]
        assert labels, f"no {QUARTER} profile on the spawn page:\n{b.text()[:2000]}"
        labels[0].find_element("css selector", "input[type=radio]").click()
        b.click("#spawn_form [type=submit]")
        b.wait(lambda d: f"/user/{person}/lab" in d.current_url, 300,
               f"{person} did not get to JupyterLab: {b.driver.current_url}\n{b.text()[:2000]}")
        b.wait(lambda d: b.css("#jp-main-dock-panel") and b.css(".jp-Launcher"), 300,
               "JupyterLab did not show its launcher")
        journey.shot("jupyterlab")
        assert journey.hub.server(person)["user_options"].get("profile") == "h200-quarter"
    finally:
        journey.ensure_server(person)


def test_07b_nothing_in_the_server_phones_home_by_default(journey):
    person = PEOPLE[0]
    journey.ensure_server(person)
    headers = {"Authorization": f"token {journey.token(person)}"}
    base = f"{journey.hub.url}/user/{person}/lab"
    problems = []
    lab = requests.get(base, headers=headers, timeout=60)
    announcements_off = "@jupyterlab/apputils-extension:announcements" in lab.text.split("disabledExtensions", 1)[-1][:3000]
    settings = requests.get(f"{base}/api/settings/@jupyterlab/apputils-extension:notification", headers=headers,
                            timeout=60).json()
    # The user's own settings over the schema's default, which is where the server's overrides.json lands.
    default = settings.get("schema", {}).get("properties", {}).get("fetchNews", {}).get("default")
    fetch_news = settings.get("settings", {}).get("fetchNews", default)
    if not announcements_off and fetch_news != "false":
        problems.append(f"JupyterLab asks to fetch Jupyter's news (fetchNews={fetch_news!r})")
    printed = journey.hub.run_in_kernel(person, textwrap.dedent("""
        import dvc.analytics, mlflow.telemetry.utils
        print("DVC", dvc.analytics.is_enabled(), "MLFLOW", mlflow.telemetry.utils.is_telemetry_disabled())
    """))
    if "DVC False" not in printed:
        problems.append("DVC's usage analytics are on")
    if "MLFLOW True" not in printed:
        problems.append("MLflow's telemetry is on")
    assert not problems, "a private platform must not phone home (issue 12 item 10): " + "; ".join(problems)


def test_08_the_terminal_has_dvc_mlflow_and_python_on_its_path(journey):
    terminal = journey.terminal(PEOPLE[0])
    for tool in ("dvc", "mlflow", "python"):
        status, output = terminal.run(f"command -v {tool}")
        assert status == 0, (f"`{tool}` is not on PATH in a JupyterLab terminal (issue 12 item 1); "
                             f"PATH and the shell said:\n{terminal.run('echo $PATH')[1]}\n{output}")
    terminal.check("python -c 'import mlflow, dvc'")


def test_09_dvc_init_add_push_pull_work_in_the_terminal_without_setup(journey):
    terminal = journey.terminal(PEOPLE[0])
    terminal.check("mkdir -p ~/cats && cd ~/cats && git init -q")
    initialised = terminal.check("dvc init")
    assert "anonymous aggregate usage analytics" not in initialised, (
        f"`dvc init` announces DVC's analytics on a private platform (issue 12 item 10):\n{initialised}")
    terminal.check("echo 'a cat, labelled' > cats.txt && dvc add cats.txt")
    terminal.check("dvc push")
    terminal.check("rm -rf .dvc/cache cats.txt && dvc pull")
    assert "a cat, labelled" in terminal.check("cat cats.txt")


def test_10_git_commit_in_the_terminal_knows_who_commits(journey):
    person = PEOPLE[0]
    terminal = journey.terminal(person)
    terminal.check("mkdir -p ~/notes && cd ~/notes && git init -q && echo 'first notes' > notes.md && git add notes.md")
    terminal.check("git commit -q -m 'first notes'")
    author = terminal.check("git log -1 --format='AUTHOR=%an <%ae>'")
    assert f"AUTHOR={person} <" in author, f"the commit's author is not {person}:\n{author}"


def test_11_a_notebooks_mlflow_run_is_tagged_with_a_nonzero_cost(journey):
    person = PEOPLE[0]
    journey.ensure_server(person)
    # The run holds the quarter H200 for a few seconds of "training": that time is what it must cost.
    output = journey.hub.run_in_kernel(person, textwrap.dedent(f"""
        import time, mlflow
        with mlflow.start_run(run_name={RUN_NAME!r}) as run:
            mlflow.log_metric("loss", 0.5)
            time.sleep(5)
            mlflow.log_metric("loss", 0.25, step=1)
        print("RUN", run.info.run_id, run.info.experiment_id)
        try:  # a claim of another share than the server's: the hub's MLflow refuses it, in both modes
            mlflow.MlflowClient().create_run(run.info.experiment_id, tags={{"gpupool.share": "8"}})
            print("FORGED accepted")
        except Exception as error:
            print("FORGED", str(error).splitlines()[0])
    """))
    (run_id, experiment_id), = re.findall(r"RUN (\w+) (\w+)", output)
    forged = re.findall(r"FORGED (.*)", output)
    assert forged and forged[0].startswith("PERMISSION_DENIED: gpupool.share is set by the platform"), output
    journey.made["run"] = (run_id, experiment_id)
    reply = journey.mlflow(person, "GET", "api/2.0/mlflow/runs/get", params={"run_id": run_id})
    assert reply.status_code == 200, reply.text
    tags = {t["key"]: t["value"] for t in reply.json()["run"]["data"]["tags"]}
    hours, cost = tags.get("gpupool.gpu_hours"), tags.get("gpupool.cost")
    assert hours is not None and Fraction(hours) > 0 and cost is not None and Decimal(cost) > 0, (
        f"a 5-second run on {QUARTER} was tagged gpupool.gpu_hours={hours}, gpupool.cost={cost} "
        "(issue 12 item 3: exact to the ledger's precision)")


def test_12_mlflow_runs_list_in_the_terminal_shows_the_run(journey):
    assert "run" in journey.made, "needs the notebook's run of the step before"
    run_id, experiment_id = journey.made["run"]
    listed = journey.terminal(PEOPLE[0]).check(f"mlflow runs list --experiment-id {experiment_id}")
    assert run_id in listed and RUN_NAME in listed, listed


def test_12b_a_job_whose_working_folder_its_account_cannot_enter_is_refused_at_submit(journey):
    """Issue 33: the jobs service checks a job's working folder as the account its runs would run as, and names
    the folder, with the hub run as root and by an ordinary user alike; no job is made."""
    terminal = journey.terminal(PEOPLE[0])
    status, said = terminal.run("gpupool jobs submit --profile h200-quarter --workdir /root -- true")
    assert status != 0 and "working folder '/root' cannot be entered" in said, said
    assert terminal.check("gpupool jobs list").strip().endswith("no jobs")


def test_13_with_the_hub_run_as_root_the_server_is_its_user_and_cannot_read_the_state(journey):
    if journey.variant != "hub-as-root":
        pytest.skip("run by an ordinary user, every server runs as that user: a personal workstation, shared only "
                    "with the loud --unsafe-shared-as-user (README: Running as root or not; the last step)")
    state = journey.hub.state
    # The hub's secrets: what the state folder holds, and what would let a user act as the hub or its services.
    secrets_held = {"the CLI token": (state / "cli-token").read_text().strip(),
                    "the cookie secret": (state / "jupyterhub_cookie_secret").read_text().strip(),
                    "the harness service's token": journey.hub.token}
    problems = []
    for person in PEOPLE[:2]:
        terminal = journey.terminal(person)
        uid, name = terminal.check("echo ID=$(id -u):$(id -un)").rsplit("ID=", 1)[1].split()[0].split(":")
        # The account may carry the platform's own prefix (gp-ada), but it is that person's and nobody else's.
        if uid == "0" or not re.fullmatch(rf"([a-z0-9]+-)?{person}", name):
            problems.append(f"{person}'s server runs as uid {uid} ({name})")
        readable = [str(state / p) for p in ("", "cli-token", "admin.bcrypt", "jupyterhub.sqlite",
                                             "jupyterhub_cookie_secret", "ledger.sqlite")
                    if terminal.run(f"cat {state / p} >/dev/null 2>&1 || ls {state / p} >/dev/null 2>&1")[0] == 0]
        # Every other file the hub keeps there (databases, the proxy's pid, the services' records, its config),
        # asked as the person's own account.
        asked = subprocess.run(
            ["runuser", "-u", name, "--", "python3", "-c",
             "import os, sys; print(*(p for p in sys.stdin.read().splitlines() if os.access(p, os.R_OK)), sep='\\n')"],
            input="\n".join(map(str, [state, *state.rglob("*")])), capture_output=True, text=True, timeout=120,
            check=True)
        readable += [line for line in asked.stdout.splitlines() if line and line not in readable]
        if readable:
            problems.append(f"{person}'s server can read {readable[:10]}")
        # Nor on a command line, which `ps` shows every user.
        shown = terminal.check("ps -eww -o args")
        problems += [f"{person}'s terminal sees {what} on a command line (ps)" for what, value in secrets_held.items()
                     if value and value in shown]
    assert not problems, ("with the hub run as root (issue 12 item 2, issue 33 item 2: servers run as their users; "
                          "none may read a secret the hub holds): " + "; ".join(problems))


# --- what it costs --------------------------------------------------------------------------------------------

def test_14_the_usage_page_shows_my_gpu_hours_running_server_and_cost(journey):
    person = PEOPLE[0]
    journey.ensure_server(person)
    me = requests.get(f"{journey.hub.url}/services/accounting/api/me", timeout=60,
                      headers={"Authorization": f"token {journey.token(person)}"}).json()
    assert me["running"], f"api/me shows no running server of {person}: {me}"
    b = journey.browser
    journey.login(person, journey.passwords[person])
    b.get(f"{journey.hub.url}/services/accounting/")
    text = b.wait_for_text("GPU")
    journey.shot("usage")
    missing = [what for what, shown in [
        ("my running server's profile", QUARTER in text or "h200-quarter" in text),
        ("my GPU-hours", bool(re.search(r"GPU[- ]hours", text, re.I))),
        ("an amount in the currency", "EUR" in text or "€" in text),
        ("a way back to the hub", any("/hub/" in (a.get_attribute("href") or "") for a in b.css("a"))),
    ] if not shown]
    assert not missing, (f"{person}'s usage page lacks {', '.join(missing)} (issue 12 item 4); it shows:\n"
                         f"{text[:2000]}")


def test_15_the_mlflow_ui_opens_on_the_first_page_and_the_experiment_without_errors(journey):
    person = PEOPLE[0]
    b = journey.browser
    journey.login(person, journey.passwords[person])
    problems = []
    pages = [("mlflow", "", TEAM)]
    if "run" in journey.made:
        pages.append(("mlflow-experiment", f"#/experiments/{journey.made['run'][1]}", TEAM))
    else:
        problems.append("no experiment page checked: the notebook's run (step 11) was not made")
    for shot, fragment, words in pages:
        b.start_recording()
        b.get(f"{journey.hub.url}/services/mlflow/{fragment}")
        page = f"/services/mlflow/{fragment}"
        try:
            b.wait_for_text(words, 300)
            b.wait_page_loaded()
        finally:
            journey.shot(shot)
        text = b.text()
        problems += [f"{page}: the page says {line.strip()!r}" for line in text.splitlines()
                     if re.search(r"failed to|went wrong|\berror\b", line, re.I)
                     and not re.search(r"error rate: 0\.0%", line)]  # the traces panel's statistic, not an error
        if "Welcome to MLflow Assistant" in text:
            problems.append(f"{page}: the assistant panel opens by itself")
        if re.search(r"UI telemetry", text, re.I):
            problems.append(f"{page}: MLflow announces its UI telemetry on a private platform (issue 12 item 10)")
        problems += [f"{page}: request {r}" for r in b.failed_requests()]
        problems += [f"{page}: console {m}" for m in b.console_errors()]
    counted = Counter(problems)
    assert not problems, "the MLflow UI shows errors (issue 12 item 7):\n" + "\n".join(
        f"{problem}{f' ({n} times)' if n > 1 else ''}" for problem, n in counted.items())


# --- the queue ------------------------------------------------------------------------------------------------

def _queued_page(journey: Journey) -> str:
    """The third person's spawn-pending page once it shows her place in the queue (the quota being full)."""
    if "queued" in journey.made:
        return journey.made["queued"]
    for person in PEOPLE[:2]:
        journey.ensure_server(person)
    third = PEOPLE[2]
    b = journey.browser
    journey.login(third, journey.passwords[third])
    b.get(f"{journey.hub.url}/hub/spawn")
    b.wait_for_text(QUARTER)
    labels = [e for e in b.css("#spawn_form label") if QUARTER in e.text]
    labels[0].find_element("css selector", "input[type=radio]").click()
    b.click("#spawn_form [type=submit]")
    b.wait(lambda d: f"/spawn-pending/{third}" in d.current_url, 120,
           f"the spawn did not go to the progress page: {b.driver.current_url}\n{b.text()[:2000]}")
    b.wait(lambda d: "position" in (b.css("#progress-message")[0].text if b.css("#progress-message") else ""), 300,
           f"the progress page never showed a place in the queue:\n{b.text()[:2000]}")
    journey.shot("queue")
    journey.made["queued"] = b.text()
    return journey.made["queued"]


def test_16_when_the_quota_is_full_the_third_spawn_page_shows_position_and_reason(journey):
    text = _queued_page(journey)
    expected = f'Waiting for {QUARTER}: position 1 of 1 in queue "{TEAM}" (team "{TEAM}" holds 0.5 of 0.5 GPUs (quota))'
    assert expected in text, f"the queued spawn page does not say {expected!r}:\n{text[:2000]}"


def test_17_the_queued_page_says_it_waits_once_not_that_the_server_is_starting(journey):
    text = _queued_page(journey)
    log = journey.browser.css("#progress-log .progress-log-event")
    waiting = [e.get_attribute("textContent") for e in log if "position" in (e.get_attribute("textContent") or "")]
    problems = []
    if "Your server is starting up" in text:
        problems.append("it says 'Your server is starting up' while the request waits in the queue")
    if len(set(waiting)) != len(waiting):
        problems.append(f"the event log repeats the waiting message: {waiting}")
    assert not problems, "the queued spawn page misleads (issue 12 item 6): " + "; ".join(problems)


def test_18_stop_server_on_the_queued_page_leaves_the_queue_cleanly(journey):
    _queued_page(journey)
    third = PEOPLE[2]
    b = journey.browser
    since = journey.hub.log.stat().st_size
    b.driver.execute_script("window.__journey_before_cancel = true;")
    b.click("#stop-server-btn")

    def status_text() -> str:
        status = b.css("#stop-server-status")
        return status[0].text.strip() if status else ""

    def reloaded(driver) -> bool:
        try:
            return driver.execute_script("return window.__journey_before_cancel === undefined "
                                         "&& document.readyState === 'complete'")
        except Exception:  # between two pages
            return False

    def settled(driver) -> bool:
        text = status_text()
        return reloaded(driver) or bool(text and "Stopping" not in text)

    try:
        b.wait(settled, 180)
    except Exception:
        journey.shot("queue-cancelled")
        lines = [line for line in journey.log_text(since).splitlines() if third in line]
        raise AssertionError(
            f"the Stop Server button on {third}'s queued spawn page got no answer in 180 s (issue 12 item 6); the page "
            f"shows {status_text()!r}; the hub logged:\n" + "\n".join(lines[-30:])) from None
    status = status_text()
    deadline = time.monotonic() + 120
    while journey.hub.server(third) is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    # The page stays and says that the wait was cancelled (issue 33 item 1: it reloaded to "Server not running").
    b.wait(lambda d: "Spawn cancelled" in b.text() and "will not start" in status_text(), 120,
           f"the page does not say that the wait was cancelled:\n{b.text()[:2000]}")
    try:
        b.wait_page_loaded(timeout=120)
    except TimeoutError:
        pass  # a page that keeps asking for new addresses (a redirect loop): the log below says what it was
    journey.shot("queue-cancelled")
    log = journey.log_text(since)
    problems = [line for line in log.splitlines()
                if f"Server {third} is ready" in line or "Redirect loop" in line or " 424 " in line]
    if "Error" in status:
        problems.insert(0, f"the page said {status!r}")
    if journey.hub.server(third) is not None:
        problems.insert(0, f"{third}'s server is still there: {journey.hub.server(third)}")
    if f"{third}/" in journey.hub.allocations():
        problems.insert(0, f"{third} still holds a share: {journey.hub.allocations()}")
    assert not problems, f"cancelling {third}'s queued spawn did not leave the queue cleanly (issue 12 item 6):\n" + \
        "\n".join(problems)


# --- the ordinary user's platform without the opt-in: a personal workstation ---------------------------------

def _as_hub_user(journey: Journey) -> dict:
    """subprocess arguments that run a command as the ordinary Unix user that runs the hub (when the tests are root)."""
    if not journey.hub.unix_user:
        return {}
    account = pwd.getpwnam(journey.hub.unix_user)
    return {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}


def test_19_without_the_opt_in_an_ordinary_users_platform_is_a_personal_workstation(journey, elsewhere):
    """Issue 33 item 2: run by an ordinary user, every server runs as that user beside the hub's state (its
    admin-scoped CLI token, cookie secret, database), so the platform is the admin's alone unless told
    `--unsafe-shared-as-user`: no sign-up, no other user, said at start."""
    if journey.variant != "hub-as-ordinary-user":
        pytest.skip("run as root, the hub is shared: each server runs as its own user")
    hub, as_user = journey.hub, _as_hub_user(journey)
    env = {**hub.env, "HOME": pwd.getpwnam(journey.hub_user).pw_dir}
    if as_user:
        os.chown(elsewhere, as_user["user"], as_user["group"])
    # The journey's own state folder knows ada, ben and cleo: without the opt-in it does not start.
    for user in hub.api("GET", "/users").json():
        for server in user["servers"]:
            hub.stop_server(user["name"], timeout=120, server=server)
    hub.stop()
    again = subprocess.Popen(
        [str(hub.command), "up", "--state-dir", str(hub.state), "--port", str(hub.port), "--policies", str(hub.policies),
         "--ledger-url", hub.ledger_url, "--team-root", str(hub.team_root), "--no-mlflow"],
        cwd=elsewhere, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        **as_user)
    try:
        said, _ = again.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(again.pid, 9)
        said, _ = again.communicate()
        hub.kill_leftovers()
        raise AssertionError(f"gpupool up started a personal workstation on a state folder whose hub knows other "
                             f"people:\n{said[-3000:]}") from None
    assert again.returncode != 0 and "refusing to start" in said, said[-3000:]
    assert all(person in said for person in PEOPLE) and "--unsafe-shared-as-user" in said, said[-3000:]

    # A fresh platform of the same ordinary user, as `make up` makes it.
    tmp = Path(tempfile.mkdtemp(prefix="gpupool-journey-workstation-"))
    os.chmod(tmp, 0o755)
    mine = Hub(tmp, POLICY, unix_user=hub.unix_user, mlflow=False, up_args=())  # no opt-in: `make up`
    if as_user:
        for path in [tmp, *tmp.rglob("*")]:
            os.chown(path, as_user["user"], as_user["group"])
    b = journey.browser
    try:
        mine.start()
        log = mine.log.read_text()
        assert "a personal workstation" in log and "'admin' alone logs in" in log, log[-3000:]
        assert "users sign up" not in log and "WARNING: --unsafe-shared-as-user" not in log, log[-3000:]
        # The one person logs in in Chromium with the printed password; the login page offers no sign-up.
        b.driver.execute_cdp_cmd("Network.clearBrowserCookies", {})
        b.get(f"{mine.url}/hub/login")
        b.wait(lambda d: b.css("#login_submit"), 120, "the login page has no Sign In button")
        assert not b.css("a[href$='signup']"), f"the login page invites sign-ups:\n{b.text()[:2000]}"
        b.fill({"username_input": "admin", "password_input": mine.admin_password()})
        b.click("#login_submit")
        b.wait(lambda d: "/hub/login" not in d.current_url, 120, f"the admin could not log in:\n{b.text()[:2000]}")
        b.get(f"{mine.url}/hub/signup")
        b.wait_for_text("personal workstation")
        # Another person: the sign-up as the browser posts it, then a login.
        other = requests.Session()
        other.get(f"{mine.url}/hub/login", timeout=30)
        form = {"username": "zoe", "signup_password": "a long enough password 42",
                "signup_password_confirmation": "a long enough password 42", "_xsrf": other.cookies.get("_xsrf", "")}
        reply = other.post(f"{mine.url}/hub/signup", data=form, timeout=60)
        assert reply.status_code == 404 and "personal workstation" in reply.text, (reply.status_code, reply.text[-2000:])
        login = other.post(f"{mine.url}/hub/login", timeout=60, allow_redirects=False, data={
            "username": "zoe", "password": form["signup_password"], "_xsrf": other.cookies.get("_xsrf", "")})
        assert login.status_code != 302, "someone other than the admin logged in on a personal workstation"
        # Nobody else can be made: not through the REST API, nor the admin's CLI.
        reply = mine.api("POST", "/users/zoe")
        assert reply.status_code == 403 and "personal workstation" in reply.json()["message"], reply.text
        made = subprocess.run([str(mine.command), "team", "add-member", TEAM, "zoe", "--create", "--state-dir",
                               str(mine.state)], cwd=elsewhere, env={**mine.env, "HOME": env["HOME"]},
                              capture_output=True, text=True, timeout=120, **as_user)
        assert made.returncode != 0 and "personal workstation" in made.stderr, made.stderr
        assert [u["name"] for u in mine.api("GET", "/users").json()] == ["admin"]
        # The one person puts themselves in a team, as the start-up line says.
        mine_done = subprocess.run([str(mine.command), "team", "add-member", TEAM, "admin", "--state-dir",
                                    str(mine.state)], cwd=elsewhere, env={**mine.env, "HOME": env["HOME"]},
                                   capture_output=True, text=True, timeout=120, **as_user)
        assert mine_done.returncode == 0, mine_done.stderr
        # Done for the day: `gpupool down`, as that user from another folder, stops the whole platform.
        down = subprocess.run([str(mine.command), "down", "--state-dir", str(mine.state)], cwd=elsewhere,
                              env={**mine.env, "HOME": env["HOME"]}, capture_output=True, text=True, timeout=120,
                              **as_user)
        assert down.returncode == 0, (down.stdout, down.stderr)
        assert mine.process.wait(60) is not None
        left = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
                if str(mine.state) in " ".join(p.info["cmdline"] or [])]
        assert not left, f"gpupool down left these running: {left}"
    finally:
        mine.stop()
        mine.kill_leftovers()
        shutil.rmtree(tmp, ignore_errors=True)
