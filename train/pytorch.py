"""PyTorch on gpupool's checkpoints: model, optimizer, scheduler, RNG states and your data position, resumed
exactly, so a job killed at any moment goes on from its last committed step as if it had never stopped.

    ckpt = TorchCheckpoints(model, optimizer, scheduler, every=100)
    step = ckpt.resume()                  # 0 on the first run; otherwise all state is back as it was
    while step < total_steps:
        ... one training step ...
        step += 1
        if ckpt.step_done(step):          # saved every 100 steps, and now if the job was asked to stop
            break

Whatever decides the order of your data must be part of what resumes: keep it in `position` (an epoch and the
batches done in it, say) and derive each epoch's shuffle from a seed and the epoch, so the resumed run sees
the batches it would have seen.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Mapping
from typing import Any

import torch

from gpupool.train.checkpoints import Checkpoint, Checkpoints, Stream, should_stop


def rng_states() -> dict[str, Any]:
    """The random number generators' states: torch's (CPU and every CUDA device), Python's, NumPy's global one."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")  # only if the program uses NumPy (never imported on its behalf)
    if numpy is not None:
        states["numpy"] = numpy.random.get_state()
    return states


def set_rng_states(states: Mapping[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy" in states and numpy is not None:
        numpy.random.set_state(states["numpy"])


def _torch_writer(value: Any) -> Stream:
    # Into the file Checkpoints opens: straight from the tensors to the disk, its write-back under way as it grows.
    return Stream(lambda file: torch.save(value, file))


class TorchCheckpoints:
    """A PyTorch training loop's checkpoints (`Checkpoints` underneath: atomic, newest committed on resume).

    `every`: save each `every` steps (the guarantee: at most `every` steps are redone after a kill);
    `keep`: how many committed checkpoints stay; `directory`: default `$GPUPOOL_CHECKPOINT_DIR`.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 scheduler: Any | None = None, *, every: int = 100, keep: int = 2, directory=None):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every is how many steps between saves, a whole number ≥ 1, not {every!r}")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.every = every
        self.checkpoints = Checkpoints(directory, keep=keep)
        #: What `save` was given as `position` (your data-loader position), as of the resumed checkpoint.
        self.position: dict[str, Any] = {}
        #: What `save` was given as `extra`, as of the resumed checkpoint.
        self.extra: dict[str, Any] = {}
        #: The checkpoint `resume()` went on from (None: a fresh start).
        self.resumed: Checkpoint | None = None

    def save(self, step: int, position: Mapping[str, Any] | None = None,
             extra: Mapping[str, Any] | None = None) -> Checkpoint:
        """Commit the training state as of `step` (steps done). `position`: where your data loader is."""
        if position is not None:
            self.position = dict(position)
        if extra is not None:
            self.extra = dict(extra)
        state = {"model.pt": _torch_writer(self.model.state_dict())}
        if self.optimizer is not None:
            state["optimizer.pt"] = _torch_writer(self.optimizer.state_dict())
        if self.scheduler is not None:
            state["scheduler.pt"] = _torch_writer(self.scheduler.state_dict())
        state["loop.pt"] = _torch_writer({"step": step, "rng": rng_states(), "position": self.position,
                                          "extra": self.extra})
        return self.checkpoints.save(state, step, metadata={"step": step})

    def resume(self, map_location: Any = "cpu") -> int:
        """Load the newest committed checkpoint into the model, optimizer, scheduler and RNGs; its step (steps
        done), or 0 when there is none. Torn or uncommitted checkpoints are skipped."""
        latest = self.checkpoints.load_latest()
        self.resumed = latest
        if latest is None:
            return 0

        # The run's own files, in its private folder: full unpickling (RNG states are not plain tensors).
        def load(name: str) -> Any:
            return torch.load(latest.file(name), map_location=map_location, weights_only=False)

        self.model.load_state_dict(load("model.pt"))
        if self.optimizer is not None:
            self.optimizer.load_state_dict(load("optimizer.pt"))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(load("scheduler.pt"))
        loop = load("loop.pt")
        set_rng_states(loop["rng"])
        self.position, self.extra = dict(loop["position"]), dict(loop["extra"])
        return int(loop["step"])

    def step_done(self, step: int, position: Mapping[str, Any] | None = None,
                  extra: Mapping[str, Any] | None = None) -> bool:
        """Call after each step with the steps done: saves every `every` steps, and at once when the job was
        asked to stop (SIGTERM: preemption, cancel); True when the loop should return now."""
        stopping = should_stop()
        if stopping or step % self.every == 0:
            self.save(step, position, extra)
        return stopping
