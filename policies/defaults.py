"""Where the platform keeps its things when nothing says otherwise: each default defined here, once.

The embedded platform (`gpupool up`) passes every location to the hub, its spawner and its services
explicitly; these defaults are what each of them falls back to when run alone (a service started by hand,
`gpupool bill`, a test), so that all of them fall back to the same place.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: The state folder, relative to the folder `gpupool up` runs in (the hub's database, the pool's
#: allocations, the ledger's SQLite file, the services' tokens).
STATE_DIR = Path("state")
#: The environment variable every process of the platform reads the state folder from.
STATE_DIR_ENV = "GPUPOOL_STATE_DIR"


#: The public proxy's port of `gpupool up` when none is given (`--port`, `$GPUPOOL_PORT`).
PORT = 8000
#: Where each of the platform's processes listens, as an offset from that port: PORT to PORT+6, on 127.0.0.1.
PORT_OFFSETS = {"proxy": 0, "hub": 1, "proxy API": 2, "accounting": 3, "mlflow": 4, "jobs": 5, "culler": 6}


def service_url(name: str, port: int = PORT) -> str:
    """Where the platform's process `name` (a key of `PORT_OFFSETS`) listens when the proxy is on `port`."""
    return f"http://127.0.0.1:{port + PORT_OFFSETS[name]}"


def env(name: str, fallback: str, environ: Mapping[str, str] | None = None) -> str:
    """An environment variable, empty counting as unset: the documented fallback of a setting."""
    environ = os.environ if environ is None else environ
    return environ.get(name) or fallback


def state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """`$GPUPOOL_STATE_DIR`, else `./state` (of the current folder, as an absolute path)."""
    environ = os.environ if environ is None else environ
    return Path(environ.get(STATE_DIR_ENV) or Path.cwd() / STATE_DIR)


def ledger_url(state: str | Path) -> str:
    """The usage ledger when no URL is configured: SQLite in the state folder `state`."""
    return f"sqlite:///{Path(state) / 'ledger.sqlite'}"


def team_root(state: str | Path, servers_run_as_users: bool | None = None) -> Path:
    """The teams' shared folders (data, dataset registries) when none is configured: `teams` in the state folder,
    or beside it when servers run as their own users, who cannot enter the 0700 state folder (by default: when
    this process runs as root, as the embedded platform's servers then do)."""
    state = Path(state)
    beside = os.geteuid() == 0 if servers_run_as_users is None else servers_run_as_users
    return (state.parent if beside else state) / "teams"
