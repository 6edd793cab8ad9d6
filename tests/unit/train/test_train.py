"""gpupool.train: checkpoints are whole or absent, the newest committed one is what a run resumes from, and
SIGTERM becomes a flag the loop stops at.

Real processes are killed for real (SIGKILL between two files of a save, mid-run; SIGTERM for a graceful
stop); the PyTorch run is a tiny CPU model (tests/train_loop.py) whose resumed weights must equal an
uninterrupted run's bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from gpupool.train import Checkpoints, should_stop
from gpupool.train.checkpoints import MARKER, step_folder

HERE = Path(__file__).resolve().parents[2]  # the tests folder (train_loop.py)


def run_python(code: str, *args: str, env: dict | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def wait_for_file(path: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            raise AssertionError(f"exited {process.returncode} before {path.name}: {process.stderr.read()[-2000:]}")
        assert time.monotonic() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.02)


# --- the commit protocol -----------------------------------------------------------------------------------

def test_save_and_load_latest_round_trip_every_kind_of_value(tmp_path):
    ckpt = Checkpoints(tmp_path, keep=2, handle_sigterm=False)
    assert ckpt.load_latest() is None
    saved = ckpt.save({"weights.bin": b"\x00\x01", "state": {"lr": 0.1, "epoch": 3},
                       "export": lambda path: (path.mkdir(), (path / "config.json").write_text("{}"))},
                      7, metadata={"loss": 0.5})
    latest = ckpt.load_latest()
    assert latest == saved and latest.step == 7 and latest.path == tmp_path / step_folder(7)
    assert latest.read_bytes("weights.bin") == b"\x00\x01"
    assert latest.unpickle("state") == {"lr": 0.1, "epoch": 3}
    assert (latest.file("export") / "config.json").read_text() == "{}"
    assert latest.metadata == {"loss": 0.5}
    assert latest.files == {"weights.bin": 2, "state": latest.file("state").stat().st_size, "export": 2}
    with pytest.raises(KeyError, match="has no 'missing'; it has: export, state, weights.bin"):
        latest.file("missing")
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_folder(7)]  # nothing else left behind


def test_keeps_the_newest_committed_and_removes_older_only_after_a_commit(tmp_path):
    ckpt = Checkpoints(tmp_path, keep=2, handle_sigterm=False)
    for step in (10, 20, 30):
        ckpt.save({"w": str(step).encode()}, step)
    assert [c.step for c in ckpt.committed()] == [20, 30]

    def broken(path):
        path.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ckpt.save({"w": b"40", "optimizer": broken}, 40)
    # The failed save took nothing away and left nothing behind.
    assert [c.step for c in ckpt.committed()] == [20, 30]
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_folder(20), step_folder(30)]
    assert ckpt.load_latest().read_bytes("w") == b"30"


def test_saving_a_step_again_replaces_it(tmp_path):
    # A resumed run redoes the steps after its last checkpoint and saves the same step numbers again.
    ckpt = Checkpoints(tmp_path, handle_sigterm=False)
    ckpt.save({"w": b"first"}, 5)
    ckpt.save({"w": b"second"}, 5)
    assert [(c.step, c.read_bytes("w")) for c in ckpt.committed()] == [(5, b"second")]
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_folder(5)]


def test_uncommitted_and_damaged_checkpoints_are_skipped(tmp_path):
    ckpt = Checkpoints(tmp_path, keep=5, handle_sigterm=False)
    for step in (1, 2, 3, 4):
        ckpt.save({"w": b"x" * 10, "o": b"y" * 10}, step)
    (tmp_path / step_folder(4) / "o").write_bytes(b"y" * 3)  # truncated after its commit
    (tmp_path / step_folder(3) / MARKER).unlink()  # never committed (a copy by hand, say)
    marker = json.loads((tmp_path / step_folder(2) / MARKER).read_text())
    (tmp_path / step_folder(2) / MARKER).write_text(json.dumps({**marker, "step": 9}))  # not its own marker
    (tmp_path / step_folder(5)).mkdir()  # an empty folder
    assert ckpt.load_latest().step == 1
    assert [c.step for c in ckpt.committed()] == [1]


@pytest.mark.parametrize(("state", "step", "message"), [
    ({"w": b""}, -1, "a checkpoint's step is a whole number ≥ 0, not -1"),
    ({"w": b""}, 1.5, "a checkpoint's step is a whole number ≥ 0, not 1.5"),
    ({}, 1, "a checkpoint needs at least one file"),
    ({"a/b": b""}, 1, "checkpoint file names are plain names .*not 'a/b'"),
    ({MARKER: b""}, 1, "checkpoint file names are plain names .*not 'COMMITTED.json'"),
])
def test_bad_saves_are_refused_and_write_nothing(tmp_path, state, step, message):
    ckpt = Checkpoints(tmp_path, handle_sigterm=False)
    with pytest.raises(ValueError, match=message):
        ckpt.save(state, step)
    with pytest.raises(TypeError):
        ckpt.save({"w": b""}, 1, metadata={"not json": object()})
    assert list(tmp_path.iterdir()) == []


def test_the_folder_comes_from_the_jobs_environment_or_is_asked_for(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUPOOL_CHECKPOINT_DIR", raising=False)
    with pytest.raises(ValueError, match="no checkpoint folder: pass Checkpoints\\(directory\\) or set "
                                         "GPUPOOL_CHECKPOINT_DIR"):
        Checkpoints(handle_sigterm=False)
    monkeypatch.setenv("GPUPOOL_CHECKPOINT_DIR", str(tmp_path / "job-7"))
    assert Checkpoints(handle_sigterm=False).directory == tmp_path / "job-7"
    assert (tmp_path / "job-7").stat().st_mode & 0o777 == 0o700  # private to the user
    with pytest.raises(ValueError, match="keep is how many committed checkpoints stay"):
        Checkpoints(tmp_path, keep=0, handle_sigterm=False)


# --- at the disk's speed: streamed, handed to the disk as it grows, one fsync per file ----------------------

@pytest.mark.parametrize("writeback", ["sync_file_range", "refused", "none"])
def test_values_go_straight_into_their_files_handed_to_the_disk_as_they_grow_each_fsynced_once(
        tmp_path, monkeypatch, writeback):
    from gpupool.train import checkpoints
    from gpupool.train.checkpoints import Stream

    if writeback == "sync_file_range" and sys.platform.startswith("linux"):
        assert checkpoints._sync_file_range is not None  # libc's, found
    if writeback == "refused":  # a file system that refuses the hint (some network ones): left to the fsync
        def refusing(fd, offset, length, flags):
            import ctypes, errno
            ctypes.set_errno(errno.EINVAL)
            return -1
        monkeypatch.setattr(checkpoints, "_sync_file_range", refusing)
    elif writeback == "none":  # not Linux
        monkeypatch.setattr(checkpoints, "_sync_file_range", None)
    monkeypatch.setattr(checkpoints, "WRITEBACK_CHUNK", 4096)
    started, fsynced = [], []
    real_start, real_fsync = checkpoints._start_writeback, os.fsync

    def start(fd, offset, length):
        started.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length))
        real_start(fd, offset, length)

    def fsync(fd):
        fsynced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(checkpoints, "_start_writeback", start)
    monkeypatch.setattr(os, "fsync", fsync)
    weights = {"w": torch.arange(30_000, dtype=torch.float32), "v": -torch.arange(20_000, dtype=torch.float32)}
    state = {"model.pt": Stream(lambda file: torch.save(weights, file)), "raw": bytes(range(256)) * 100,
             "pickled": list(range(20_000)),
             "export": lambda path: (path.mkdir(), (path / "config.json").write_text("{}"))}
    ckpt = Checkpoints(tmp_path, handle_sigterm=False)
    saved = ckpt.save(state, 3)

    loaded = torch.load(saved.file("model.pt"), weights_only=True)
    assert torch.equal(loaded["w"], weights["w"]) and torch.equal(loaded["v"], weights["v"])
    assert saved.read_bytes("raw") == bytes(range(256)) * 100 and saved.unpickle("pickled") == list(range(20_000))
    assert saved.files["model.pt"] == saved.file("model.pt").stat().st_size > 200_000
    assert ckpt.load_latest() == saved
    assert (checkpoints._sync_file_range is None) == (writeback != "sync_file_range")  # a refusal: not asked again
    # Each streamed file was handed to the disk in order, chunk after chunk, while it was written; the writer's
    # file after it was made (whole).
    for name in ("model.pt", "raw", "pickled"):
        ranges = [(offset, length) for path, offset, length in started if path.endswith(f"/{name}")]
        assert len(ranges) >= 2 and all(length >= 4096 for _, length in ranges[:-1]) and ranges[-1][1] > 0
        assert [offset for offset, _ in ranges] == [0] + [o + n for o, n in ranges[:-1]]
        assert sum(length for _, length in ranges) == saved.files[name]  # all of it, the rest at its end
    assert [length for path, _o, length in started if path.endswith("/export/config.json")] == [2]
    # One fsync per file and per folder: the files, the writer's folder, the marker, the checkpoint's folder
    # (before its rename) and the run's folder (after it).
    (work,) = [Path(path) for path in fsynced if Path(path).name.startswith(f".tmp-{step_folder(3)}-")]
    assert sorted(fsynced) == sorted([str(work / "model.pt"), str(work / "raw"), str(work / "pickled"),
                                      str(work / "export" / "config.json"), str(work / "export"),
                                      str(work / MARKER), str(work), str(tmp_path)])


def test_a_stream_that_fails_half_way_leaves_the_last_checkpoint_and_nothing_else(tmp_path):
    from gpupool.train.checkpoints import Stream

    ckpt = Checkpoints(tmp_path, handle_sigterm=False)
    ckpt.save({"w": Stream(lambda file: file.write(b"one"))}, 1)

    def half(file):
        file.write(b"x" * 100_000)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ckpt.save({"w": Stream(half)}, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_folder(1)]
    assert ckpt.load_latest().read_bytes("w") == b"one"
    with pytest.raises(TypeError, match="Stream takes a function that writes into a file, not b'w'"):
        Stream(b"w")


# --- killed for real ---------------------------------------------------------------------------------------

def test_a_save_killed_between_two_files_is_skipped_and_its_leftovers_cleaned(tmp_path):
    # The process commits step 1, then dies (SIGKILL, nothing runs after it) between the files of step 2.
    process = run_python("""
        import os, signal, sys
        from gpupool.train import Checkpoints
        ckpt = Checkpoints(sys.argv[1], keep=1)
        ckpt.save({"model": b"m1", "optimizer": b"o1"}, 1)
        def die(path):
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.save({"model": b"m2" * 1000, "optimizer": die}, 2)
    """, str(tmp_path))
    process.communicate(timeout=120)
    assert process.returncode == -signal.SIGKILL
    (leftover,) = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert (leftover / "model").read_bytes() == b"m2" * 1000  # the first file was written, the commit never
    ckpt = Checkpoints(tmp_path, keep=1, handle_sigterm=False)  # a new run: the dead writer's folder goes
    latest = ckpt.load_latest()
    assert (latest.step, latest.read_bytes("model"), latest.read_bytes("optimizer")) == (1, b"m1", b"o1")
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_folder(1)]


def test_a_save_killed_in_the_middle_of_a_streamed_file_is_skipped_and_its_leftovers_cleaned(tmp_path):
    # SIGKILL while a Stream is writing, its write-back under way: a part of the file is on disk, no marker.
    process = run_python("""
        import os, signal, sys
        from gpupool.train import Checkpoints, checkpoints
        checkpoints.WRITEBACK_CHUNK = 4096
        ckpt = Checkpoints(sys.argv[1], keep=1)
        ckpt.save({"model": b"m1"}, 1)
        def half(file):
            for _ in range(5):
                file.write(b"m2" * 100_000)
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.save({"model": checkpoints.Stream(half)}, 2)
    """, str(tmp_path))
    process.communicate(timeout=120)
    assert process.returncode == -signal.SIGKILL
    (leftover,) = [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    written = (leftover / "model").read_bytes()  # what reached the file (the last writes may have been buffered)
    assert 0 < len(written) <= 1_000_000 and written == (b"m2" * 500_000)[:len(written)]
    assert not (leftover / MARKER).exists()
    ckpt = Checkpoints(tmp_path, keep=1, handle_sigterm=False)
    assert (ckpt.load_latest().step, ckpt.load_latest().read_bytes("model")) == (1, b"m1")
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_folder(1)]


def test_sigterm_sets_should_stop_and_the_loop_saves_and_exits(tmp_path):
    process = run_python("""
        import sys, time
        from gpupool.train import Checkpoints, should_stop
        ckpt = Checkpoints(sys.argv[1])
        step = 0
        while not should_stop():
            step += 1
            if step == 3:
                print("running", flush=True)
            time.sleep(0.001)
        ckpt.save({"step": str(step).encode()}, step)
        print("saved", step, flush=True)
    """, str(tmp_path))
    assert process.stdout.readline() == "running\n"
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    step = int(out.split()[-1])
    assert Checkpoints(tmp_path, handle_sigterm=False).load_latest().read_bytes("step") == str(step).encode()
    assert not should_stop()  # this process was never asked to stop: the flag is per process


def test_a_second_sigterm_while_the_handler_runs_neither_hangs_it_nor_loses_the_stop(tmp_path):
    # A second SIGTERM (the group's and another sender's: a preemption seen twice, a node drain) can make Python
    # run the handler again between two bytecodes of its first run. The trace function below does exactly that,
    # deterministically: at every line the first run goes through (the handler's, and whatever it calls), the
    # handler runs once more. A handler that takes a lock (threading.Event.set did) waits for itself forever:
    # seen in CI as a preempted job that never saved and was SIGKILLed at the end of its grace period.
    process = run_python("""
        import signal, sys
        from gpupool.train import checkpoints, should_stop
        checkpoints.install_sigterm_handler()
        handler, nested = signal.getsignal(signal.SIGTERM), []

        def trace(frame, event, arg):
            if event == "line" and len(nested) < 50:
                nested.append(frame.f_code.co_name)
                handler(signal.SIGTERM, None)  # not traced itself: a trace function runs untraced
            return trace

        def first(frame, event, arg):  # the handler's frame and every frame it calls are traced
            inside = frame.f_code is handler.__code__ or frame.f_back is not None and frame.f_back.f_trace
            return trace if event == "call" and inside else None

        sys.settrace(first)
        handler(signal.SIGTERM, None)
        sys.settrace(None)
        print(should_stop(), len(nested), flush=True)
    """)
    try:
        out, err = process.communicate(timeout=60)  # the old handler never returned
    finally:
        process.kill()
    assert process.returncode == 0, err
    stopped, nested = out.split()
    assert stopped == "True" and int(nested) >= 1, out


def launched(tmp_path: Path, code: str, **kwargs) -> subprocess.Popen:
    """`python -m gpupool.train.launch EXIT_FILE -- python -c CODE`, in a session of its own, as the runner starts
    a run."""
    return subprocess.Popen([sys.executable, "-m", "gpupool.train.launch", str(tmp_path / "exit-status"), "--",
                             sys.executable, "-c", textwrap.dedent(code), str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)


def test_the_launcher_does_not_pass_a_signal_on_the_command_already_heard_from_its_group(tmp_path):
    # The runner signals the run's whole group; the launcher only outlives it. Signalled alone (what its old
    # forwarding did to the command after every group signal), it passes nothing on: the command hears it once.
    process = launched(tmp_path, """
        import pathlib, signal, sys, time
        heard = []
        signal.signal(signal.SIGTERM, lambda *a: heard.append(time.monotonic()))
        pathlib.Path(sys.argv[1], "ready").write_text("")
        while not heard:
            time.sleep(0.01)
        time.sleep(2)  # a second SIGTERM would come within this
        print(len(heard), flush=True)
        sys.exit(3)
    """)
    wait_for_file(tmp_path / "ready", process)
    os.kill(process.pid, signal.SIGTERM)  # the launcher alone: it stays, and the command does not hear it
    time.sleep(1)
    assert process.poll() is None and not (tmp_path / "exit-status").exists()
    os.killpg(process.pid, signal.SIGTERM)  # as the runner stops a run
    out, err = process.communicate(timeout=60)
    assert out.split() == ["1"], (out, err)
    assert process.returncode == 3 and (tmp_path / "exit-status").read_text() == "3\n"


def test_the_command_hears_sigterm_even_when_the_launchers_starter_ignored_it(tmp_path):
    # An ignored signal stays ignored across exec; a caught one does not. The launcher catches SIGTERM before it
    # starts the command, so the command starts with the default (it ends on SIGTERM), whatever the hub had.
    process = launched(tmp_path, """
        import pathlib, sys, time
        pathlib.Path(sys.argv[1], "ready").write_text("")
        time.sleep(120)
    """, preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
    wait_for_file(tmp_path / "ready", process)
    os.killpg(process.pid, signal.SIGTERM)
    process.communicate(timeout=60)
    assert (tmp_path / "exit-status").read_text() == f"{-signal.SIGTERM}\n"
    assert process.returncode == 128 + signal.SIGTERM


# --- PyTorch: resumed exactly ------------------------------------------------------------------------------

def train(out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE / "train_loop.py"), str(out), *args],
                            env={k: v for k, v in os.environ.items() if k != "GPUPOOL_CHECKPOINT_DIR"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(process: subprocess.Popen) -> str:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    return out


def steps_of(out: Path) -> list[int]:
    return [int(line) for line in (out / "steps").read_text().split()]


def test_a_run_killed_mid_way_resumes_from_its_last_checkpoint_to_the_same_weights(tmp_path):
    steps, every, kill_at = 60, 10, 25
    finished(train(tmp_path / "whole", "--steps", str(steps), "--every", str(every)))
    assert steps_of(tmp_path / "whole") == list(range(1, steps + 1))

    interrupted = tmp_path / "killed"
    first = train(interrupted, "--steps", str(steps), "--every", str(every), "--pause-at", str(kill_at))
    wait_for_file(interrupted / "paused", first)
    first.kill()  # SIGKILL: no handler runs, nothing is saved on the way out
    first.communicate(timeout=60)
    assert steps_of(interrupted) == list(range(1, kill_at + 1))
    resumed_from = Checkpoints(interrupted / "checkpoints", handle_sigterm=False).load_latest().step
    assert resumed_from == kill_at - kill_at % every  # the last periodic save before the kill

    out = finished(train(interrupted, "--steps", str(steps), "--every", str(every)))
    assert f"resumed from step {resumed_from}" in out
    done = steps_of(interrupted)
    # The step counter goes on from the checkpoint: the steps after it are redone (at most `every`), then on.
    assert done == list(range(1, kill_at + 1)) + list(range(resumed_from + 1, steps + 1))
    assert kill_at - resumed_from <= every
    whole = torch.load(tmp_path / "whole" / "final.pt")
    again = torch.load(interrupted / "final.pt")
    assert whole.keys() == again.keys()
    for name in whole:
        assert torch.equal(whole[name], again[name]), name  # bit for bit, dropout and shuffling included


def test_sigterm_mid_run_saves_at_the_step_boundary_and_resumes_there(tmp_path):
    steps, every = 60, 25
    finished(train(tmp_path / "whole", "--steps", str(steps), "--every", str(every)))
    out = tmp_path / "preempted"
    first = train(out, "--steps", str(steps), "--every", str(every), "--pause-at", "12")
    wait_for_file(out / "paused", first)
    first.terminate()  # SIGTERM while it sleeps in step 12: it goes on, sees should_stop() and saves
    said = finished(first)
    assert "asked to stop: saved step 12" in said
    assert Checkpoints(out / "checkpoints", handle_sigterm=False).load_latest().step == 12
    assert "resumed from step 12" in finished(train(out, "--steps", str(steps), "--every", str(every)))
    assert steps_of(out) == list(range(1, steps + 1))  # nothing redone
    whole, again = torch.load(tmp_path / "whole" / "final.pt"), torch.load(out / "final.pt")
    assert all(torch.equal(whole[name], again[name]) for name in whole)


def test_the_worked_example_in_the_docs_trains_and_resumes(tmp_path):
    # docs/jobs.md's loop, as a user runs it: `python train.py` in a folder of theirs, then again.
    text = (HERE.parent / "docs" / "jobs.md").read_text()
    start = text.index("```python\nimport itertools, torch")
    (tmp_path / "train.py").write_text(text[text.index("\n", start) + 1:text.index("```\n", start + 10)])
    env = {k: v for k, v in os.environ.items() if k != "GPUPOOL_CHECKPOINT_DIR"}
    first = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.strip() == "trained to step 300"
    ckpt = Checkpoints(tmp_path / "checkpoints" / "demo", handle_sigterm=False)
    assert [c.step for c in ckpt.committed()] == [250, 300]  # every 50, the newest two kept
    again = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0 and again.stdout.strip() == "trained to step 300"  # resumed at the end: done


# --- transformers: the Trainer's checkpoints committed, SIGTERM a save and a stop ----------------------------

HF_LOOP = """
import sys, time
from pathlib import Path
import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from gpupool.train import should_stop
from gpupool.train.hf import CommitCheckpoints, last_committed_checkpoint

out, pause_at = Path(sys.argv[1]), int(sys.argv[2])

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)
    def forward(self, x, labels):
        return {"loss": nn.functional.mse_loss(self.layer(x), labels)}

class Pause(TrainerCallback):  # waits at step `pause_at` to be told to stop (SIGTERM)
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == pause_at:
            (out / "paused").write_text("")
            while not should_stop():
                time.sleep(0.01)

g = torch.Generator().manual_seed(0)
data = [{"x": x, "labels": x.sum(dim=0, keepdim=True)} for x in torch.randn(64, 4, generator=g)]
args = TrainingArguments(output_dir=str(out), max_steps=40, save_steps=10, save_total_limit=2,
                         per_device_train_batch_size=8, report_to="none", use_cpu=True, logging_strategy="no",
                         disable_tqdm=True, seed=1)
trainer = Trainer(model=Model(), args=args, train_dataset=data, callbacks=[Pause(), CommitCheckpoints()])
resume = last_committed_checkpoint(out)
print("resume", resume, flush=True)
trainer.train(resume_from_checkpoint=resume)
print("stopped at", trainer.state.global_step, flush=True)
"""


def test_a_trainer_stopped_by_sigterm_saves_commits_and_resumes_past_a_torn_checkpoint(tmp_path):
    from gpupool.train.checkpoints import read_commit
    from gpupool.train.hf import last_committed_checkpoint

    out = tmp_path / "run"
    out.mkdir()
    first = run_python(HF_LOOP, str(out), "25")
    wait_for_file(out / "paused", first, timeout=300)
    first.send_signal(signal.SIGTERM)  # a preemption: saved at step 25, then the Trainer stops
    said, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert "stopped at 25" in said
    assert read_commit(out / "checkpoint-25", 25) is not None and read_commit(out / "checkpoint-20", 20) is not None
    # A save killed half-way leaves a newer folder without its commit: never resumed from.
    torn = out / "checkpoint-30"
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"\0" * 10)
    assert last_committed_checkpoint(out) == str(out / "checkpoint-25")
    again = run_python(HF_LOOP, str(out), "0")
    said, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    assert f"resume {out / 'checkpoint-25'}" in said and "stopped at 40" in said
    assert last_committed_checkpoint(out) == str(out / "checkpoint-40")
    state = json.loads((out / "checkpoint-40" / "trainer_state.json").read_text())
    assert state["global_step"] == 40
