"""gpupool.train: checkpoints a training job can trust, in any server or job (no other gpupool module needed).

`Checkpoints.save` commits atomically and keeps the newest few; `load_latest` returns the newest committed
checkpoint; `should_stop()` turns SIGTERM (a preemption, a cancel) into a flag the loop checks at step
boundaries. `gpupool.train.pytorch.TorchCheckpoints` does model, optimizer, scheduler and RNG states.
"""

# Imported under its folder's name (`import train` from the repository root) it would be a second copy of
# every module in it (and a second SIGTERM flag): refused, as for the other folders.
if __name__ != "gpupool.train":
    raise ImportError(
        f"{__name__!r} is gpupool's train/ folder imported by its folder name: import gpupool.train "
        "instead (the folder is installed as gpupool.train: `make install`, or `pip install -e .`)"
    )

from gpupool.train.checkpoints import (
    CHECKPOINT_DIR_ENV,
    Checkpoint,
    Checkpoints,
    install_sigterm_handler,
    request_stop,
    should_stop,
)

__all__ = ["CHECKPOINT_DIR_ENV", "Checkpoint", "Checkpoints", "install_sigterm_handler", "request_stop",
           "should_stop"]
