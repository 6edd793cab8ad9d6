"""Checkpoints that are either whole or absent: an atomic commit protocol, the newest committed one on resume.

A save writes every file into a temporary folder beside the checkpoints, writes the commit marker last (the
list of files with their sizes), fsyncs every file, the marker and the folder, renames it to `step-<step>` and
fsyncs the parent. A reader trusts only a `step-*` folder whose marker is there and agrees with the files, so a
save killed at any point (between two files, in the middle of one, before the rename) leaves the previous
checkpoint as the newest. Old checkpoints are removed only after the new one is committed, by renaming them out
of sight first, so a clean-up interrupted half-way never leaves a half-deleted folder that looks committed.

Framework-agnostic: a checkpoint is a mapping of file names to values, each written as raw bytes, into a file
by a function of yours (`Stream(write)`: `write(file)`, e.g. `torch.save(state, file)`), at a path by a function
of yours (`writer(path)`, e.g. a model's `save_pretrained`), or pickled. `gpupool.train.pytorch` adds the
PyTorch conveniences on top.

At the disk's speed: bytes, pickled values and streams go straight into their file (no copy of the state in
memory; small writes gathered), and the file is handed to the disk as it grows (Linux's `sync_file_range`: the
write-back of each few MiB starts while the next are serialised); files a `writer(path)` made are handed to the
disk when it returns. The fsyncs, one per file and folder, are then issued at the same time: the file system
writes what is left and commits its journal once for all of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
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

#: A value of a checkpoint: bytes are written as they are, a `Stream` into the file it is given, another callable
#: is called with the path to write (a file or a folder of its own), anything else is pickled.
Writer = Callable[[Path], Any]


def step_folder(step: int) -> str:
    """The folder name of checkpoint `step` (zero-padded, so names sort as steps)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"a checkpoint's step is a whole number ≥ 0, not {step!r}")
    return f"step-{step:012d}"


class Stream:
    """A checkpoint value written into a file that `Checkpoints.save` opens: `write(file)` is called with a binary
    file object (`write`, `flush`, `tell`), e.g. `Stream(lambda f: torch.save(state, f))`. What it writes goes
    straight to the disk as it comes: no copy of it is kept in memory."""

    __slots__ = ("write",)

    def __init__(self, write: Callable[[Any], Any]):
        if not callable(write):
            raise TypeError(f"Stream takes a function that writes into a file, not {write!r}")
        self.write = write

    def __repr__(self) -> str:
        return f"Stream({self.write!r})"


#: Bytes written to a file between two starts of its write-back (`_start_writeback`).
WRITEBACK_CHUNK = 16 * 2**20
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start write-out of the range's dirty pages, do not wait for it


def _load_sync_file_range():
    """libc's `sync_file_range` (Linux), or None where there is none (elsewhere, the fsync does all the work)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        function = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    function.restype = ctypes.c_int
    return function


_sync_file_range = _load_sync_file_range()


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing `length` bytes of `fd` from `offset` to the disk, and return at once: the
    disk works while the writer goes on. A hint only: the fsync that follows is the guarantee, so a file system
    that refuses it (EINVAL, ENOSYS: some network ones) is left to the fsync."""
    global _sync_file_range
    if _sync_file_range is None or length <= 0:
        return
    if _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE) != 0:
        if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.ESPIPE, errno.EOPNOTSUPP):
            _sync_file_range = None  # not on this file system: stop asking


class _StreamedFile(io.FileIO):
    """A new file, written unbuffered (straight from the caller's memory to the kernel), its write-back started
    every `WRITEBACK_CHUNK` bytes and, by `finish()`, for the rest."""

    def __init__(self, path: Path):
        super().__init__(path, "xb")
        self._written = 0
        self._handed = 0  # bytes whose write-back has been started

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        while view:  # in chunks (a big tensor's write-back starts before its end); a short write goes on
            done = super().write(view[:WRITEBACK_CHUNK])
            view = view[done:]
            self._written += done
            if self._written - self._handed >= WRITEBACK_CHUNK:
                _start_writeback(self.fileno(), self._handed, self._written - self._handed)
                self._handed = self._written
        return total

    def finish(self) -> int:
        """Start the write-back of what is left (the fsync comes later, with the others); the file's size."""
        if self._written > self._handed:
            _start_writeback(self.fileno(), self._handed, self._written - self._handed)
            self._handed = self._written
        return os.fstat(self.fileno()).st_size


#: Small writes (a zip record's header, a small tensor) are gathered up to this many bytes; bigger ones go from
#: the caller's memory to the file without a copy.
_BUFFER = 256 * 1024


def _write_file(path: Path, value: Any) -> int:
    """Write a value that is not a `writer(path)` into the new file `path`, all of it handed to the disk (not
    fsynced yet: `_fsync_all` does, with the rest of the checkpoint); its size."""
    with _StreamedFile(path) as raw, io.BufferedWriter(raw, buffer_size=_BUFFER) as file:
        if isinstance(value, Stream):
            value.write(file)
        elif isinstance(value, (bytes, bytearray, memoryview)):
            file.write(value)
        else:
            pickle.dump(value, file, protocol=pickle.HIGHEST_PROTOCOL)
        file.flush()
        return raw.finish()


def _fsync_folder(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path, also: list[Path] = ()) -> None:
    """fsync every file under `path` and every folder, `path` included (what a writer of yours wrote too), and
    `also`, once each, all at once."""
    for entry in sorted(path.iterdir()):
        _hand_to_disk(entry)
    _fsync_all(_tree(path) + list(also))


def _tree(path: Path) -> list[Path]:
    """`path` and, when it is a folder, every file and folder in it."""
    if not path.is_dir():
        return [path]
    found = []
    for folder, _dirs, names in os.walk(path):
        found.append(Path(folder))
        found.extend(Path(folder, name) for name in names)
    return found


def _hand_to_disk(path: Path) -> None:
    """Start the write-back of every file a `writer(path)` made at `path`, while the next value is written."""
    for entry in _tree(path):
        if entry.is_file():
            fd = os.open(entry, os.O_RDONLY)
            try:
                _start_writeback(fd, 0, os.fstat(fd).st_size)
            finally:
                os.close(fd)


def _fsync_all(paths: list[Path]) -> None:
    """fsync each of `paths` (files and folders) once, all at the same time (a thread each, the first in this
    one): the file system writes what is left of them together and commits its journal for all of them at once,
    where one fsync after another would wait for a journal commit each. Raises the first error."""
    descriptors: list[int] = []
    errors: list[BaseException] = []

    def fsync(fd: int) -> None:
        try:
            os.fsync(fd)
        except BaseException as error:  # noqa: BLE001 - handed to the caller below
            errors.append(error)

    try:
        for path in paths:
            descriptors.append(os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)))
        threads = [threading.Thread(target=fsync, args=(fd,), daemon=True) for fd in descriptors[1:]]
        for thread in threads:
            thread.start()
        if descriptors:
            fsync(descriptors[0])
        for thread in threads:
            thread.join()
    finally:
        for fd in descriptors:
            os.close(fd)
    if errors:
        raise errors[0]


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
    _fsync_tree(folder, also=[folder.parent])  # the files, the folder, its entry in the parent: then the marker
    saved_at = _write_marker(folder, step, files, extra)
    committed = Checkpoint(step, folder, files, extra, saved_at)
    announce(committed)
    return committed


def _write_marker(folder: Path, step: int, files: Mapping[str, int], metadata: Mapping[str, Any], *,
                  sync: bool = True) -> float:
    """Write `folder`'s commit marker; `sync`: fsynced, then the folder (every file in it must be on disk
    already). Without: the caller fsyncs it before anything trusts it (a folder renamed into place after)."""
    saved_at = time.time()
    with (folder / MARKER).open("w") as f:
        json.dump({"format": FORMAT, "step": step, "files": dict(files), "saved_at": saved_at,
                   "metadata": dict(metadata)}, f)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    if sync:
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
        ckpt.save({"weights.bin": data, "state": {"lr": lr}}, step)   # bytes, pickled, Stream(write) or writer(path)

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

    def save(self, state: Mapping[str, bytes | Stream | Writer | Any], step: int,
             metadata: Mapping[str, Any] | None = None) -> Checkpoint:
        """Commit `state` as checkpoint `step`, atomically; then drop all but the newest `keep`.

        `state` maps file names to values: `bytes` are written as they are, a `Stream(write)` is called with
        the file to write into, another callable with the path to write (it may make a file or a folder there),
        anything else is pickled. `metadata`: JSON-able
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
                if callable(value) and not isinstance(value, Stream):
                    value(path)
                    if not path.exists():
                        raise ValueError(f"the writer of {name!r} wrote nothing at {path}")
                    files[name] = _size(path)
                    _hand_to_disk(path)
                else:  # bytes, a stream, or pickled: straight into the file, handed to the disk as it grows
                    files[name] = _write_file(path, value)
            saved_at = _write_marker(work, step, files, json.loads(extra), sync=False)
            # Every file (the marker too) and folder on disk, one fsync each, all at once, before the rename that
            # makes the folder a checkpoint: until then nothing in it is trusted, so their order does not matter.
            _fsync_all(_tree(work))
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
