"""The platform's process lifecycle: one platform per state folder, services that cannot outlive their hub.

- `lock_state` holds a lock on the state folder for as long as the hub runs (a second `gpupool up` is refused).
- `supervised` wraps a hub-managed service's command in `python -m gpupool.hub.lifecycle`, a small supervisor
  that runs the service in its own process group, stops the whole group (MLflow's uvicorn workers and job
  runners included) when the hub stops it or when the hub dies (a parent-death signal, `prctl(PR_SET_PDEATHSIG)`),
  and records its PID and start time in the state folder.
- `stop_stale_services` runs before a hub starts: it stops what an earlier, crashed run left behind, found by
  that record and by the marker every process of a service inherits.
- `write_platform_record` / `find_state_dir` let the `gpupool` command find the running platform from any folder.
- `stop_platform` is `gpupool down`: the hub by its record, then what a crashed run left (services, proxy).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

#: Every process of a supervised service inherits this variable: "<state folder>\x1f<service name>".
MARKER = "GPUPOOL_SERVICE_OF"
_SEPARATOR = "\x1f"
#: How long a service may take to stop serving once asked to, before its process group is killed. Below
#: JupyterHub's `interrupt_timeout` (10 s), so the hub never has to escalate to SIGKILL on the supervisor.
STOP_GRACE_S = 8.0
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(option, value, 0, 0, 0) == 0


def set_parent_death_signal(sig: int) -> bool:
    """Have the kernel send `sig` to this process when its parent dies (Linux); False where it cannot."""
    return _prctl(_PR_SET_PDEATHSIG, int(sig))


# ---------------------------------------------------------------------------------------------- the state lock

class StateLocked(RuntimeError):
    pass


def lock_state(state: Path) -> int:
    """Lock `state` for this process and what it execs into; the descriptor stays open (and the lock held)
    until the hub exits, however it exits. Raises StateLocked naming the platform that holds it."""
    fd = os.open(state / "gpupool.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = _read_json(state / "hub.json")
        raise StateLocked(
            f"another gpupool platform runs on the state folder {state} (pid {holder.get('pid', '?')}, "
            f"{holder.get('url', 'url unknown')}): stop it first, or choose another --state-dir") from None
    os.set_inheritable(fd, True)
    return fd


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_json(path: Path, data: dict, mode: int = 0o600) -> None:
    """Write `data` whole or not at all (a reader never sees half a record)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(partial, path)


# -------------------------------------------------------------------------------------- the platform record

def platform_records_dir() -> Path:
    """Per user: `$XDG_STATE_HOME/gpupool/platforms` (default ~/.local/state/gpupool/platforms)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "gpupool" / "platforms"


def write_platform_record(state: Path, info: dict) -> None:
    """Tell the `gpupool` command (run by the same user, from any folder) where this platform keeps its state."""
    name = hashlib.sha256(str(state).encode()).hexdigest()[:16] + ".json"
    write_json(platform_records_dir() / name, {"state_dir": str(state), **info}, mode=0o644)


def _alive(pid: int | None, started: float | None) -> bool:
    try:
        return bool(pid) and abs(psutil.Process(pid).create_time() - (started or 0)) < 1
    except psutil.Error:
        return False


def _the_platforms(processes: list[psutil.Process], state: Path) -> list[psutil.Process]:
    """Those of `processes` run by the owner of `state`: the records in a state folder are its owner's words, and
    `gpupool down` run by root must not stop, on the word of a folder a user owns, a process that is not theirs."""
    try:
        owner = state.stat().st_uid
    except OSError:
        return []
    mine = []
    for process in processes:
        try:
            if process.uids().real == owner:
                mine.append(process)
        except psutil.Error:
            continue
    return mine


def platforms() -> list[dict]:
    """Platforms this user started, newest first, each with `running`."""
    found = []
    for path in platform_records_dir().glob("*.json"):
        record = _read_json(path)
        if record.get("state_dir") and Path(record["state_dir"]).is_dir():
            found.append({**record, "running": _alive(record.get("pid"), record.get("started"))})
    return sorted(found, key=lambda r: r.get("started") or 0, reverse=True)


class NoPlatform(RuntimeError):
    pass


def find_state_dir(explicit: str | None, running: bool = True) -> Path:
    """The state folder: `explicit` (--state-dir) when given; otherwise the one running platform of this
    user (or, with `running=False`, the last one started). Raises NoPlatform saying what to do."""
    if explicit:
        return Path(explicit).resolve()
    known = platforms()
    live = [r for r in known if r["running"]]
    if len(live) == 1:
        return Path(live[0]["state_dir"])
    if len(live) > 1:
        raise NoPlatform("several gpupool platforms run: " + ", ".join(f"{r['state_dir']} ({r.get('url')})"
                                                                       for r in live) + "; pass --state-dir")
    if known and not running:
        return Path(known[0]["state_dir"])
    if known:
        raise NoPlatform(f"no running gpupool platform of this user (the last one used the state folder "
                         f"{known[0]['state_dir']}): start it with `gpupool up`, or pass --state-dir")
    raise NoPlatform("this user started no gpupool platform: start one with `gpupool up`, or pass --state-dir")


# ------------------------------------------------------------------------------------ supervised services

def supervised(service: dict, state: Path) -> dict:
    """`service` (a JupyterHub.services entry) with its command run under the lifecycle supervisor."""
    if not service.get("command"):
        return service
    return {**service, "command": [sys.executable, "-m", "gpupool.hub.lifecycle", str(state), service["name"],
                                   "--", *service["command"]]}


def _record_path(state: Path, name: str) -> Path:
    return state / "services" / f"{name}.json"


def _group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and os.getpgid(process.pid) == pgid:
                members.append(process)
        except (OSError, psutil.Error):
            continue
    return members


def _descendants() -> list[psutil.Process]:
    """Every process this supervisor is responsible for: its process group, and whatever left the group but
    descends from it (orphans are re-parented here, the subreaper)."""
    found = {p.pid: p for p in _group_members(os.getpgrp())}
    found.update((p.pid, p) for p in psutil.Process().children(recursive=True))
    return list(found.values())


def _serving(processes: list[psutil.Process]) -> bool:
    """Whether any of `processes` still listens or holds an open TCP connection."""
    for process in processes:
        try:
            if any(c.status in (psutil.CONN_LISTEN, psutil.CONN_ESTABLISHED)
                   for c in process.net_connections(kind="tcp")):
                return True
        except psutil.Error:
            continue
    return False


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE  # a zombie only awaits its reaper
    except psutil.Error:
        return False


def _wait_gone(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until none of `processes` runs, at most `timeout` seconds; those still running."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in processes if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _kill_all(processes: list[psutil.Process]) -> None:
    for process in processes:
        try:
            process.kill()
        except psutil.Error:
            pass
    _wait_gone(processes, 10)


def _reap() -> None:
    """Collect the exit status of orphans that were re-parented to us (we are their subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def supervise(state: Path, name: str, command: list[str]) -> int:
    """Run `command` as the service `name` until it exits, the hub asks it to stop, or the hub dies."""
    hub = os.getppid()
    asked: list[int] = []  # a plain list: a signal handler must not take a lock the main thread may hold
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda number, _: asked.append(number))
    # SIGHUP when the hub dies, even by SIGKILL; checked after setting it, in case the hub died before.
    set_parent_death_signal(signal.SIGHUP)
    if os.getppid() != hub:
        return 1
    # Descendants whose parent dies (MLflow's job runner's consumers) are re-parented here, not to init.
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)
    env = {**os.environ, MARKER: f"{state}{_SEPARATOR}{name}"}
    # The service itself gets SIGTERM should this supervisor be killed outright.
    child = subprocess.Popen(command, env=env, preexec_fn=lambda: set_parent_death_signal(signal.SIGTERM))
    me = psutil.Process()
    write_json(_record_path(state, name), {"pid": me.pid, "started": me.create_time(), "pgid": os.getpgrp(),
                                            "service_pid": child.pid, "command": command})
    while child.poll() is None and not asked and os.getppid() == hub:
        time.sleep(0.2)
    if child.poll() is None:
        child.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        # Once it stops serving, what is left is the interpreters' teardown (MLflow's takes half a minute on
        # a busy machine: the final garbage collection of a large heap), which the kernel does faster.
        while child.poll() is None and time.monotonic() < deadline and _serving(_descendants()):
            time.sleep(0.2)
    _kill_all(_descendants())
    code = child.wait()
    _reap()
    _record_path(state, name).unlink(missing_ok=True)
    return 0 if asked else code


def stale_service_processes(state: Path) -> list[psutil.Process]:
    """Processes of services of an earlier run on `state`: recorded supervisors (same PID and start time),
    their process groups, and every process carrying the state folder's service marker."""
    found: dict[int, psutil.Process] = {}
    for record_file in (state / "services").glob("*.json"):
        record = _read_json(record_file)
        if _alive(record.get("pid"), record.get("started")):
            try:
                found[record["pid"]] = psutil.Process(record["pid"])
            except psutil.Error:
                pass
            for member in _group_members(record.get("pgid") or record["pid"]):
                found[member.pid] = member
    prefix = f"{state}{_SEPARATOR}"
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and process.environ().get(MARKER, "").startswith(prefix):
                found[process.pid] = process
        except psutil.Error:
            continue
    return _the_platforms(list(found.values()), state)


def stop_stale_services(state: Path) -> list[str]:
    """Stop what services of an earlier run on `state` left running (SIGTERM, then SIGKILL); what was stopped."""
    stale = stale_service_processes(state)
    described = []
    for process in stale:
        try:
            described.append(f"{process.pid} ({' '.join(process.cmdline())[:80]})")
            process.terminate()
        except psutil.Error:
            continue
    _kill_all(_wait_gone(stale, STOP_GRACE_S))
    for record_file in (state / "services").glob("*.json"):
        record_file.unlink(missing_ok=True)
    return described


def running_hub(state: Path) -> psutil.Process | None:
    """The hub `gpupool up` runs on `state` (the PID and start time of `hub.json`), or None when none runs."""
    record = _read_json(state / "hub.json")
    if not _alive(record.get("pid"), record.get("started")):
        return None
    try:
        return next(iter(_the_platforms([psutil.Process(record["pid"])], state)), None)
    except psutil.Error:
        return None


def left_proxy(state: Path) -> psutil.Process | None:
    """The proxy a hub on `state` started (`state/proxy.pid`), when it still runs: a crashed hub leaves it."""
    try:
        process = psutil.Process(int((state / "proxy.pid").read_text()))
        # The file outlives its proxy: the PID may since be another program's.
        if (_running(process) and "configurable-http-proxy" in " ".join(process.cmdline())
                and _the_platforms([process], state)):
            return process
    except (OSError, ValueError, psutil.Error):
        pass
    return None


def stop_platform(state: Path, timeout: float = 120) -> list[str]:
    """Stop the platform on `state`: its hub (SIGTERM: it stops its services and proxy, and leaves users'
    servers running, `cleanup_servers = False`), then whatever of it is still left (the services and proxy of
    a crashed hub, or of one that did not end within `timeout`). What was stopped, in words."""
    stopped = []
    hub = running_hub(state)
    if hub is not None:
        hub.terminate()
        if _wait_gone([hub], timeout):
            _kill_all([hub])
            stopped.append(f"the hub (pid {hub.pid}, killed after {timeout:.0f} s)")
        else:
            stopped.append(f"the hub (pid {hub.pid})")
    services = stop_stale_services(state)
    if services:
        stopped.append(f"{len(services)} service process(es) left running")
    proxy = left_proxy(state)
    if proxy is not None:
        proxy.terminate()
        _kill_all(_wait_gone([proxy], STOP_GRACE_S))
        stopped.append(f"the proxy (pid {proxy.pid})")
    return stopped


def ports_in_use(ports: dict[int, str]) -> list[str]:
    """Which of `ports` (port → what gpupool runs there) something already listens on, on 127.0.0.1."""
    import socket

    taken = []
    for port, what in sorted(ports.items()):
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                taken.append(f"{port} ({what})")
    return taken


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 4 or argv[2] != "--":
        print("usage: python -m gpupool.hub.lifecycle STATE_DIR NAME -- COMMAND...", file=sys.stderr)
        return 2
    return supervise(Path(argv[0]), argv[1], argv[3:])


if __name__ == "__main__":
    sys.exit(main())
