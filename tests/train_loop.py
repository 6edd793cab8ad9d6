"""A tiny CPU PyTorch training job that checkpoints with gpupool.train (run as a script by the tests and the
benchmarks; the README's worked example is the same loop).

    python train_loop.py OUT_DIR [--steps N] [--every K] [--pause-at S] [--no-checkpoints]

Every step done is appended to OUT_DIR/steps (one number per line, flushed), the final weights go to
OUT_DIR/final.pt. `--pause-at S`: after step S it writes OUT_DIR/paused and waits there, to be killed or asked to stop (once: a
run that finds OUT_DIR/paused there already goes on, as a restarted job's run must).
Checkpoints go to $GPUPOOL_CHECKPOINT_DIR (a gpupool job has it set), else OUT_DIR/checkpoints.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gpupool.train import should_stop
from gpupool.train.pytorch import TorchCheckpoints

SEED = 1234


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--pause-at", type=int)
    parser.add_argument("--no-checkpoints", action="store_true")
    parser.add_argument("--width", type=int, default=32)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)

    data = torch.Generator().manual_seed(SEED)
    inputs = torch.randn(256, 8, generator=data)
    targets = (inputs.sum(dim=1, keepdim=True) > 0).float()
    dataset = TensorDataset(inputs, targets)
    model = nn.Sequential(nn.Linear(8, args.width), nn.ReLU(), nn.Dropout(0.1), nn.Linear(args.width, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=15, gamma=0.5)
    loss_fn = nn.BCEWithLogitsLoss()

    ckpt = None
    step, epoch, batch = 0, 0, 0
    if not args.no_checkpoints:
        directory = os.environ.get("GPUPOOL_CHECKPOINT_DIR") or args.out / "checkpoints"
        ckpt = TorchCheckpoints(model, optimizer, scheduler, every=args.every, directory=directory)
        step = ckpt.resume()
        epoch, batch = ckpt.position.get("epoch", 0), ckpt.position.get("batch", 0)
        if ckpt.resumed is not None:
            print(f"resumed from step {step}", flush=True)

    began = time.perf_counter()
    with (args.out / "steps").open("a") as log:
        while step < args.steps:
            # Each epoch's order comes from the seed and the epoch: a resumed run sees the same batches.
            loader = DataLoader(dataset, batch_size=16, shuffle=True,
                                generator=torch.Generator().manual_seed(SEED + epoch))
            for x, y in itertools.islice(loader, batch, None):
                optimizer.zero_grad()
                loss_fn(model(x), y).backward()
                optimizer.step()
                scheduler.step()
                step, batch = step + 1, batch + 1
                log.write(f"{step}\n")
                log.flush()
                if args.pause_at == step and not (args.out / "paused").exists():  # to be killed, or asked to stop
                    (args.out / "paused").write_text(str(os.getpid()))
                    while not should_stop():
                        time.sleep(0.01)
                if ckpt is not None and ckpt.step_done(step, position={"epoch": epoch, "batch": batch}):
                    print(f"asked to stop: saved step {step}", flush=True)
                    return 0
                if step == args.steps:
                    break
            else:
                epoch, batch = epoch + 1, 0
    torch.save(model.state_dict(), args.out / "final.pt")
    print(f"loop seconds {time.perf_counter() - began:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
