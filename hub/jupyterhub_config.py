"""JupyterHub configuration of the embedded mode; `gpupool up` runs `gpupool-hub -f` (JupyterHub) on this file.

Settings come from GPUPOOL_* variables (see `gpupool up --help`). Files in `<state>/jupyterhub_config.d/*.py`
are run afterwards with the same `c`, for anything gpupool does not set.
"""

import os
import pwd
import sys

from traitlets.config import Application

from gpupool.hub.services.jobs_service import RUN_AS_ENV
from gpupool.hub.app import GPUPoolHub
from gpupool.hub.config import PlatformSettings, apply_config, shared_as_user_warning, workstation_problem
from gpupool.policies import load_policy
from gpupool.spawner.accounts import DEFAULT_RECORD, claim_machine
from gpupool.spawner.local import UNSAFE_SINGLE_USER, default_server_env, root_servers_problem
from gpupool.spawner.wiring import JOBS_SERVICE

c = get_config()  # noqa: F821 - provided by JupyterHub
settings = PlatformSettings.from_env()
apply_config(c, settings)

# Teams that allow sharing get JupyterHub's `shares` scope; only gpupool's hub (`gpupool-hub`, which `gpupool up`
# runs) keeps shares within the team, plain `jupyterhub` would not refuse share codes.
hub = Application.instance() if Application.initialized() else None
if any(team.sharing for team in load_policy(settings.policy_dir).teams.values()) and not isinstance(hub, GPUPoolHub):
    raise SystemExit("gpupool: teams with `sharing: true` need gpupool's hub, which keeps shares within the team: "
                     "run the platform with `gpupool up` (or `gpupool-hub -f` this file), not `jupyterhub`")

for extra in sorted((settings.state_dir / "jupyterhub_config.d").glob("*.py")):
    exec(compile(extra.read_text(), str(extra), "exec"), {"c": c, "get_config": lambda: c})

# Users' servers run as their users when the hub runs as root, or it refuses to start (not per spawn): checked
# after the extra files, which may set server_env or run_as.
spawner = c.LocalGPUSpawner
if os.getuid() == 0:
    problem = "" if spawner.get("run_as") == "self" else root_servers_problem(
        spawner.get("server_env") or default_server_env())
    if spawner.get("run_as") == "self" or (problem and os.environ.get(UNSAFE_SINGLE_USER) == "1"):
        # the admin's explicit choice (a one-user machine), said loudly at every start
        why = ("c.LocalGPUSpawner.run_as = 'self'" if spawner.get("run_as") == "self"
               else f"--unsafe-single-user ({problem})")
        print(f"gpupool: WARNING: {why}: EVERY USER'S SERVER RUNS AS ROOT, can read the hub's state and become admin",
              file=sys.stderr, flush=True)
    elif problem:
        raise SystemExit(f"gpupool up: refusing to start: {problem}. Users' servers would run as root, could read "
                         f"the hub's state (its admin-scoped token among it) and become admin. On a machine with "
                         f"one user, say so with `gpupool up --unsafe-single-user`.")
    else:
        # Servers and jobs run as gpupool's accounts and groups, which are the machine's: one machine, one platform.
        refused = claim_machine(settings.state_dir, spawner.get("identity_record") or DEFAULT_RECORD)
        if refused:
            raise SystemExit(f"gpupool up: refusing to start: {refused}")
        # Jobs run as their users too: the jobs service checks a job's working folder as its user's account.
        for service in c.JupyterHub.services:
            if service["name"] == JOBS_SERVICE:
                service["environment"][RUN_AS_ENV] = "user"
elif settings.personal:
    # Run by an ordinary user, every server runs as that user beside the hub's state: a personal workstation,
    # where the admin alone exists (gpupool.hub.auth refuses sign-ups and new users).
    problem = workstation_problem(c.JupyterHub.db_url, settings)
    if problem:
        raise SystemExit(f"gpupool up: refusing to start: {problem}")
else:
    print(shared_as_user_warning(pwd.getpwuid(os.getuid()).pw_name), file=sys.stderr, flush=True)
