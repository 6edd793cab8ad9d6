"""Checkpoints that are either whole or absent: an atomic commit protocol, the newest committed one on resume.

A save writes every file into a temporary folder beside the checkpoints, fsyncs each file, writes the commit
marker last (the list of files with their sizes), fsyncs the folder, renames it to `step-<step>` and fsyncs
the parent. A reader trusts only a `step-*` folder whose marker is there and agrees with the files, so a save
killed at any point (between two files, before the rename) leaves the previous checkpoint as the newest. Old
checkpoints are removed only after the new one is committed, by renaming them out of sight first, so a
clean-up interrupted half-way never leaves a half-deleted folder that looks committed.

Framework-agnostic: a checkpoint is a mapping of file names to values, each written as raw bytes, by a
function of yours (`writer(path)`, e.g. a model's `save_pretrained`), or pickled. `gpupool.train.pytorch`
adds the PyTorch conveniences on top.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The folder a gpupool job's checkpoints go to (set by the platform for every job: in the team's storage,
#: private to the user).
CHECKPOINT_DIR_ENV = "GPUPOOL_CHECKPOINT_DIR"
#: The commit marker, written last: a checkpoint folder without it is not a checkpoint.
MARKER = "COMMITTED.json"
#: The marker's format; a reader skips checkpoints of a format it does not know.
FORMAT = 1

_STEP = re.compile(r"step-(\d{12})")
#: Folders being written (`.tmp-`) or removed (`.trash-`), with the writer's PID: `.tmp-<step>-<pid>-<n>`.
_WORK = re.compile(r"\.(tmp|trash)-.*-(\d+)-\d+")

#: A value of a checkpoint: bytes are written as they are, a callable is called with the path to write (a
#: file or a folder of its own), anything else is pickled.
Writer = Callable[[Path], Any]


def step_folder(step: int) -> str:
    """The folder name of checkpoint `step` (zero-padded, so names sort as steps)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"a checkpoint's step is a whole number ≥ 0, not {step!r}")
    return f"step-{step:012d}"


def _fsync_folder(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    """fsync every file under `path` and every folder, deepest first (what a writer of yours wrote too)."""
    for folder, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_folder(Path(folder))


def _size(path: Path) -> int:
    """Bytes under `path` (a file, or a folder a writer made)."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint: its step, folder, the files it holds and the metadata saved with it."""

    step: int
    path: Path
    files: Mapping[str, int]
    metadata: Mapping[str, Any] = field(default_factory=dict)
    saved_at: float = 0.0

    def file(self, name: str) -> Path:
        """The path of file (or folder) `name` of this checkpoint."""
        if name not in self.files:
            raise KeyError(f"checkpoint step {self.step} has no {name!r}; it has: {', '.join(sorted(self.files))}")
        return self.path / name

    def read_bytes(self, name: str) -> bytes:
        return self.file(name).read_bytes()

    def unpickle(self, name: str) -> Any:
        """A value that `save` pickled. Only load checkpoints you (or your job) wrote: pickle runs code."""
        with self.file(name).open("rb") as f:
            return pickle.load(f)


def _read_marker(folder: Path) -> Checkpoint | None:
    """The checkpoint in `folder` if it is committed and whole, else None (torn, uncommitted, foreign)."""
    match = _STEP.fullmatch(folder.name)
    return None if match is None else read_commit(folder, int(match.group(1)))


def read_commit(folder: Path, step: int) -> Checkpoint | None:
    """The checkpoint of `step` in `folder` if its commit marker is there and agrees with the files."""
    try:
        marker = json.loads((folder / MARKER).read_text())
        if marker.get("format") != FORMAT or marker.get("step") != step:
            return None
        files = {str(name): int(size) for name, size in marker["files"].items()}
        for name, size in files.items():
            if _size(folder / name) != size:
                return None
        return Checkpoint(marker["step"], folder, files, marker.get("metadata") or {}, float(marker.get("saved_at", 0)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def commit(folder: Path, step: int, metadata: Mapping[str, Any] | None = None) -> Checkpoint:
    """Commit what is in `folder` as checkpoint `step`: fsync every file and folder in it, then write the
    marker (its files and their sizes) last, fsynced. For a folder another library wrote in place (the
    transformers Trainer's `checkpoint-N`): a reader that trusts only committed folders then skips one that
    was torn mid-write."""
    folder = Path(folder)
    extra = json.loads(json.dumps(dict(metadata or {})))
    (folder / MARKER).unlink(missing_ok=True)
    files = {p.name: _size(p) for p in sorted(folder.iterdir())}
    _fsync_tree(folder)
    saved_at = _write_marker(folder, step, files, extra)
    _fsync_folder(folder.parent)
    committed = Checkpoint(step, folder, files, extra, saved_at)
    announce(committed)
    return committed


def _write_marker(folder: Path, step: int, files: Mapping[str, int], metadata: Mapping[str, Any]) -> float:
    """Write `folder`'s commit marker, fsynced with the folder (every file in it must be on disk already)."""
    saved_at = time.time()
    with (folder / MARKER).open("w") as f:
        json.dump({"format": FORMAT, "step": step, "files": dict(files), "saved_at": saved_at,
                   "metadata": dict(metadata)}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_folder(folder)
    return saved_at


def _human_size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def announce(checkpoint: Checkpoint) -> None:
    """One line on stderr per committed checkpoint: its step, when, its size and folder. A job's log (and so
    `gpupool jobs show` and `logs`) then says which checkpoint a resumed run can start from; stdout stays the
    program's own."""
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(checkpoint.saved_at))
    size = _human_size(sum(checkpoint.files.values()))
    line = f"gpupool.train: checkpoint step {checkpoint.step} committed at {when}, {size} ({checkpoint.path})"
    tqdm = getattr(sys.modules.get("tqdm"), "tqdm", None)
    if tqdm is not None and hasattr(tqdm, "write"):
        # A progress bar drawing (a training loop's, the Trainer's): tqdm clears it, writes the line and draws it
        # again below, where a plain print would glue the line to the bar's text.
        tqdm.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr, flush=True)


class Checkpoints:
    """The checkpoints of one training run, in `directory` (default: `$GPUPOOL_CHECKPOINT_DIR`).

        ckpt = Checkpoints(keep=3)
        latest = ckpt.load_latest()                       # None on the first run
        step = latest.step if latest else 0
        ...
        ckpt.save({"weights.bin": data, "state": {"lr": lr}}, step)   # bytes, pickled, or writer(path)

    Only one process writes a run's checkpoints (in distributed training, rank 0). `keep`: how many committed
    checkpoints stay (the newest ones); older ones go once a newer one is committed.
    """

    def __init__(self, directory: str | os.PathLike | None = None, keep: int = 2, *, handle_sigterm: bool = True):
        if directory is None:
            directory = os.environ.get(CHECKPOINT_DIR_ENV)
            if not directory:
                raise ValueError(f"no checkpoint folder: pass Checkpoints(directory) or set {CHECKPOINT_DIR_ENV} "
                                 "(a gpupool job has it set: a folder in its team's storage, private to its user)")
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep is how many committed checkpoints stay, a whole number ≥ 1, not {keep!r}")
        self.directory = Path(directory)
        self.keep = keep
        self._serial = 0
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._clean_work()
        if handle_sigterm:
            install_sigterm_handler()

    # --- reading ---------------------------------------------------------------------------------------

    def committed(self) -> list[Checkpoint]:
        """Every committed, whole checkpoint, oldest first (torn and uncommitted ones are not there)."""
        found = (_read_marker(p) for p in self.directory.iterdir() if p.is_dir() and _STEP.fullmatch(p.name))
        return sorted((c for c in found if c is not None), key=lambda c: c.step)

    def load_latest(self) -> Checkpoint | None:
        """The newest committed checkpoint, or None when there is none yet. Torn or uncommitted ones (a save
        killed mid-write) are skipped: the one before is the newest."""
        candidates = sorted((p for p in self.directory.iterdir() if _STEP.fullmatch(p.name)), reverse=True)
        for folder in candidates:
            checkpoint = _read_marker(folder)
            if checkpoint is not None:
                return checkpoint
        return None

    # --- writing ---------------------------------------------------------------------------------------

    def save(self, state: Mapping[str, bytes | Writer | Any], step: int,
             metadata: Mapping[str, Any] | None = None) -> Checkpoint:
        """Commit `state` as checkpoint `step`, atomically; then drop all but the newest `keep`.

        `state` maps file names to values: `bytes` are written as they are, a callable is called with the
        path to write (it may make a file or a folder there), anything else is pickled. `metadata`: JSON-able
        facts kept in the marker (`Checkpoint.metadata`). Saving a step that is already committed (a resumed
        run redoing steps) replaces it.
        """
        final = self.directory / step_folder(step)
        if not state:
            raise ValueError("a checkpoint needs at least one file: state maps file names to values")
        for name in state:
            if not isinstance(name, str) or not name or name in (".", "..", MARKER) or "/" in name or "\\" in name:
                raise ValueError(f"checkpoint file names are plain names (not {MARKER!r}, no '/'), not {name!r}")
        extra = json.dumps(dict(metadata or {}))  # not JSON-able: refused before anything is written
        work = self._work_folder("tmp", step)
        try:
            work.mkdir(mode=0o700)
            files = {}
            for name, value in state.items():
                path = work / name
                if isinstance(value, (bytes, bytearray, memoryview)):
                    path.write_bytes(value)
                elif callable(value):
                    value(path)
                    if not path.exists():
                        raise ValueError(f"the writer of {name!r} wrote nothing at {path}")
                else:
                    buffer = io.BytesIO()
                    pickle.dump(value, buffer, protocol=pickle.HIGHEST_PROTOCOL)
                    path.write_bytes(buffer.getvalue())
                files[name] = _size(path)
            _fsync_tree(work)
            saved_at = _write_marker(work, step, files, json.loads(extra))  # the commit: after every file
            if final.exists():  # the same step again: the old copy leaves first (out of sight), then the new comes
                old = self._work_folder("trash", step)
                final.rename(old)
                work.rename(final)
                _fsync_folder(self.directory)
                shutil.rmtree(old, ignore_errors=True)
            else:
                work.rename(final)
                _fsync_folder(self.directory)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        committed = Checkpoint(step, final, files, json.loads(extra), saved_at)
        announce(committed)
        self._prune()
        hold_if_drilled(step)
        return committed

    def _work_folder(self, kind: str, step: int) -> Path:
        self._serial += 1
        return self.directory / f".{kind}-{step_folder(step)}-{os.getpid()}-{self._serial}"

    def _prune(self) -> None:
        """Drop committed checkpoints beyond the newest `keep`: renamed out of sight first, then removed."""
        for old in self.committed()[:-self.keep]:
            trash = self._work_folder("trash", old.step)
            with contextlib.suppress(OSError):
                old.path.rename(trash)
                shutil.rmtree(trash, ignore_errors=True)
        self._clean_work()

    def _clean_work(self) -> None:
        """Remove what writers that are gone left behind (a save or clean-up killed half-way)."""
        for path in self.directory.iterdir():
            match = _WORK.fullmatch(path.name)
            if match and (int(match.group(2)) != os.getpid() and not _pid_alive(int(match.group(2)))):
                shutil.rmtree(path, ignore_errors=True)


# --- stopping on SIGTERM -----------------------------------------------------------------------------------

#: Set by SIGTERM (or `request_stop`). A plain flag, not a `threading.Event`: a signal handler may run again inside
#: itself (a second SIGTERM between two bytecodes of the first), and `Event.set` takes a lock it would then wait
#: for forever, in the main thread: the loop never saw the flag and the save was lost to the SIGKILL.
_stopping = False
_installed = False


def install_sigterm_handler() -> None:
    """From now on SIGTERM (a preemption, a cancel, a node drain) sets `should_stop()` instead of killing the
    process: the loop saves at its next step boundary and returns. Idempotent; only the main thread can
    install signal handlers, elsewhere this does nothing (the platform's SIGKILL after the grace period
    still ends the process, and the periodic saves are the guarantee)."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _on_sigterm)
    _installed = True


def _on_sigterm(signum, frame) -> None:
    global _stopping
    _stopping = True  # one store: safe however often, and however nested, the handler runs


def should_stop() -> bool:
    """Whether the job was asked to stop (SIGTERM): save now and exit. Cheap: check it every step."""
    return _stopping


def request_stop() -> None:
    """Ask the loop to stop, as SIGTERM does (for your own signals or a time limit); any thread may call it."""
    global _stopping
    _stopping = True


# --- resume drills ---------------------------------------------------------------------------------------

#: `RESUME_DRILL_AFTER_CHECKPOINT=N` (not GPUPOOL_: those are the platform's): once checkpoint N is committed, the process says so and waits there to
#: be killed, so that a resume can be drilled at a known point (kill it, watch the job come back from N).
HOLD_ENV = "RESUME_DRILL_AFTER_CHECKPOINT"


def hold_if_drilled(step: int) -> None:
    """Wait here, forever, when the drill variable names `step` (see `HOLD_ENV`); otherwise return at once.
    A resumed run goes on from `step` and never commits it again, so it does not hold."""
    if os.environ.get(HOLD_ENV, "").strip() != str(step):
        return
    print(f"gpupool.train: checkpoint {step} committed; holding here for a resume drill ({HOLD_ENV}): "
          f"kill process {os.getpid()}", flush=True)
    while True:
        time.sleep(3600)
