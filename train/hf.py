"""gpupool.train in a transformers `Trainer`: its checkpoints committed, a torn one never resumed from, and
SIGTERM (a preemption, a cancel) turned into a save and a clean stop at the next step.

    trainer = Trainer(..., args=TrainingArguments(output_dir=out, save_steps=100, save_total_limit=2),
                      callbacks=[CommitCheckpoints()])
    trainer.train(resume_from_checkpoint=last_committed_checkpoint(out))

The Trainer writes `checkpoint-N` in place (model, optimizer, scheduler, RNG and trainer state); once it has,
the callback fsyncs the folder and writes gpupool's commit marker into it. `resume_from_checkpoint=True` would
take the newest `checkpoint-*` folder whatever state it is in; `last_committed_checkpoint` takes the newest
committed one. The Trainer removes checkpoints beyond `save_total_limit` before the callback commits the new
one: keep `save_total_limit` at 2 or more so a committed one is always left.
"""

from __future__ import annotations

import re
from pathlib import Path

from transformers import TrainerCallback

from gpupool.train.checkpoints import commit, hold_if_drilled, install_sigterm_handler, read_commit, should_stop

_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


class CommitCheckpoints(TrainerCallback):
    """Commits every checkpoint the Trainer saves; on SIGTERM saves at the next step and stops training."""

    def __init__(self):
        install_sigterm_handler()

    def on_step_end(self, args, state, control, **kwargs):
        if should_stop():
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if folder.is_dir():
                commit(folder, state.global_step, {"epoch": state.epoch})
                hold_if_drilled(state.global_step)
        return control


def last_committed_checkpoint(output_dir: str | Path) -> str | None:
    """The newest `checkpoint-N` in `output_dir` that was committed and is whole (for `resume_from_checkpoint`),
    or None: start from scratch."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    found = []
    for folder in output_dir.iterdir():
        match = _CHECKPOINT.fullmatch(folder.name)
        if match and folder.is_dir():
            found.append((int(match.group(1)), folder))
    for step, folder in sorted(found, reverse=True):
        if read_commit(folder, step) is not None:
            return str(folder)
    return None


class LogToMLflow(TrainerCallback):
    """Every log of the Trainer (loss, learning rate, grad norm) as MLflow metrics at its global step, in the
    active run (`gpupool.train.tracking.resumable_run`): a resumed job's history goes on where it was.

    Sent in batches (`gpupool.train.tracking.MetricsBuffer`): at every checkpoint (put this callback before
    `CommitCheckpoints`, so the metrics are sent before the commit), every `every_seconds` and at the end, so a
    training step never waits for the tracking server and a resumed run's history has every step."""

    def __init__(self, every_seconds: float = 30.0):
        from gpupool.train.tracking import MetricsBuffer

        self.buffer = MetricsBuffer(every_seconds)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            self.buffer.add({key: value for key, value in logs.items()
                             if isinstance(value, (int, float)) and not isinstance(value, bool)}, state.global_step)
        return control

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.buffer.flush()
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.buffer.flush()
        return control
