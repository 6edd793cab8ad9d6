"""Training jobs: seconds from a SIGKILL to the first resumed step, and what checkpointing costs.

The job is tests/train_loop.py (a small CPU PyTorch model with gpupool.train's `TorchCheckpoints`). Two
figures, each against a baseline run in this same process:

- resume: the run is SIGKILLed mid-way (between checkpoints), started again at once, and timed from the
  kill to its first step after the resume (a new Python, PyTorch's import, the checkpoint's load, the
  redone steps up to the first new one). Baseline: the same fresh start with no checkpoint to load.
- overhead: the training loop's seconds with a checkpoint every K steps against the same loop without
  checkpoints, runs alternating so both see the same machine load; the ratio is the cost of the guarantee.

The restart itself is this script's (the job runner adds its queue pass and back-off on top).

    .venv/bin/python bench/jobs.py [--repeats 5] [--steps 400] [--every 50] [--width 512]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOOP = Path(__file__).resolve().parent.parent / "tests" / "train_loop.py"


def start(out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(LOOP), str(out), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def steps_done(out: Path) -> int:
    try:
        return len((out / "steps").read_text().split())
    except FileNotFoundError:
        return 0


def wait(predicate, process: subprocess.Popen, timeout: float = 600) -> float:
    deadline = time.monotonic() + timeout
    while not predicate():
        if process.poll() is not None and not predicate():
            raise SystemExit(f"the run exited {process.returncode}: {process.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        time.sleep(0.002)
    return time.perf_counter()


def loop_seconds(out: Path, *args: str) -> float:
    done = subprocess.run([sys.executable, str(LOOP), str(out), *args], capture_output=True, text=True, check=True)
    return float(done.stdout.split("loop seconds ")[1].split()[0])


def time_to_first_step(out: Path, args: list[str]) -> float:
    """Seconds from starting the run in `out` to its next step (`steps` one line longer)."""
    before = steps_done(out)
    began = time.perf_counter()
    process = start(out, *args)
    first = wait(lambda: steps_done(out) > before, process)
    process.kill()
    process.communicate()
    return first - began


def resume_after_kill(out: Path, args: list[str], kill_at: int) -> float:
    first = start(out, *args, "--pause-at", str(kill_at))
    wait(lambda: (out / "paused").exists(), first)
    killed = time.perf_counter()
    first.kill()
    first.communicate()
    before = steps_done(out)
    process = start(out, *args)
    resumed = wait(lambda: steps_done(out) > before, process)
    process.kill()
    process.communicate()
    return resumed - killed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()
    common = ["--steps", str(args.steps), "--every", str(args.every), "--width", str(args.width)]
    kill_at = args.every * 2 + args.every // 2
    fresh, resumed, plain, checkpointed = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            fresh.append(time_to_first_step(Path(tmp) / f"fresh-{i}", common))
            resumed.append(resume_after_kill(Path(tmp) / f"killed-{i}", common, kill_at))
            plain.append(loop_seconds(Path(tmp) / f"plain-{i}", *common, "--no-checkpoints"))
            checkpointed.append(loop_seconds(Path(tmp) / f"ckpt-{i}", *common))
    rows = [
        ("fresh start → first step (s)", fresh),
        (f"SIGKILL at step {kill_at} → first resumed step (s)", resumed),
        (f"{args.steps} steps, no checkpoints (s)", plain),
        (f"{args.steps} steps, checkpoint every {args.every} (s)", checkpointed),
    ]
    print(f"{'measure':<48} {'median':>9} {'min':>9} {'max':>9}")
    for name, values in rows:
        print(f"{name:<48} {statistics.median(values):>9.3f} {min(values):>9.3f} {max(values):>9.3f}")
    print(f"resume ratio (kill → resumed step / fresh start → first step): "
          f"{statistics.median(resumed) / statistics.median(fresh):.3f}")
    print(f"checkpoint overhead ratio (every {args.every} / none): "
          f"{statistics.median(checkpointed) / statistics.median(plain):.3f}")


if __name__ == "__main__":
    main()
