"""Full fine-tuning of a small text classifier (gpupool template `classifier-finetune`).

    python train.py                      # config.yaml beside this file
    gpupool jobs submit --profile cpu --image finetune -- python train.py

A plain PyTorch loop, every weight trained: it picks precision and micro-batch for the share it runs on, reads
text/label pairs (a file here, or a version of the team's dataset registry), checkpoints model, optimizer, RNG
and data position through gpupool.train every few steps (a killed or preempted job resumes exactly, in the same
MLflow run), logs loss and held-out accuracy to MLflow, and registers the model as a new version of the team's
model, then checks the registered copy predicts what the trained one does.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
from pathlib import Path

import mlflow
import torch
import yaml
from transformers import AutoModelForSequenceClassification

from gpupool.train import should_stop
from gpupool.train.data import dataset_source, read_jsonl
from gpupool.train.fit import choose
from gpupool.train.models import load_model
from gpupool.train.pytorch import TorchCheckpoints
from gpupool.train.tracking import MetricsBuffer, register_folder, resumable_run, team_model_name

HERE = Path(__file__).resolve().parent


def batches(rows: list[dict], size: int, seed: int, epoch: int):
    """The epoch's batches, shuffled by seed and epoch: a resumed run sees the batches it would have seen."""
    order = list(range(len(rows)))
    random.Random(seed * 100_003 + epoch).shuffle(order)
    return [[rows[i] for i in order[start:start + size]] for start in range(0, len(order), size)]


def encode(tokenizer, rows: list[dict], max_length: int, device: str) -> dict:
    inputs = tokenizer([r["text"] for r in rows], padding=True, truncation=True, max_length=max_length,
                       return_tensors="pt")
    inputs["labels"] = torch.tensor([int(r["label"]) for r in rows])
    return {k: v.to(device) for k, v in inputs.items()}


@torch.no_grad()
def predict(model, tokenizer, rows: list[dict], max_length: int, device: str) -> torch.Tensor:
    model.eval()
    logits = model(**{k: v for k, v in encode(tokenizer, rows, max_length, device).items() if k != "labels"}).logits
    model.train()
    return logits.float().cpu()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=HERE / "config.yaml")
    parser.add_argument("--output", type=Path, default=None,
                        help="checkpoints and the model (default: $GPUPOOL_CHECKPOINT_DIR in a job, else ./output)")
    args = parser.parse_args(argv)
    config = yaml.safe_load(args.config.read_text())
    output = args.output or Path(os.environ.get("GPUPOOL_CHECKPOINT_DIR") or args.config.parent / "output")
    output.mkdir(parents=True, exist_ok=True)
    train, labels = config["train"], list(config["labels"])
    seed, max_length = int(train.get("seed", 0)), int(train.get("max_length", 128))

    fit = choose(int(train["batch_size"]), float(train.get("memory_per_sample_gib", 0.1)))
    print(fit.says(), flush=True)
    data = dataset_source(config["dataset"], args.config.parent, output)
    rows = read_jsonl(data.path)
    for number, row in enumerate(rows, 1):
        if not isinstance(row.get("text"), str) or row.get("label") not in range(len(labels)):
            raise SystemExit(f"{data.path}:{number}: each row has a string 'text' and a 'label' from 0 to "
                             f"{len(labels) - 1} ({', '.join(labels)})")
    held = max(1, int(len(rows) * float(config.get("validation_fraction", 0.2))))
    validation, rows = rows[:held], rows[held:]

    torch.manual_seed(seed)
    tokenizer, model, source = load_model(
        config["model"], AutoModelForSequenceClassification, config.get("model_hub") == "download",
        num_labels=len(labels), id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)})
    print(f"gpupool: model {source.describe()}", flush=True)
    model.to(fit.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(train["learning_rate"]))
    steps = int(train["steps"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    checkpoints = TorchCheckpoints(model, optimizer, scheduler, every=int(train["checkpoint_every"]),
                                   directory=output / "checkpoints")
    step = checkpoints.resume(map_location=fit.device)
    print(f"gpupool: resuming from step {step}" if step else "gpupool: starting at step 0", flush=True)
    epoch, done_in_epoch = checkpoints.position.get("epoch", 0), checkpoints.position.get("batch", 0)
    autocast = torch.autocast(fit.device, dtype=fit.torch_dtype, enabled=fit.precision != "fp32")

    with resumable_run(output, run_name=config["register"]["name"]) as run:
        mlflow.log_params({"model": config["model"], "model.source": source.describe()[:500], "steps": steps,
                           "batch_size": fit.batch_size, "learning_rate": train["learning_rate"],
                           "precision": fit.precision, "labels": ",".join(labels), **data.params})
        metrics = MetricsBuffer()
        model.train()
        while step < steps:
            epoch_batches = batches(rows, fit.batch_size, seed, epoch)
            for batch in epoch_batches[done_in_epoch:]:
                loss_total = 0.0
                for start in range(0, len(batch), fit.micro_batch):
                    with autocast:
                        part = batch[start:start + fit.micro_batch]
                        loss = model(**encode(tokenizer, part, max_length, fit.device)).loss * len(part) / len(batch)
                    loss.backward()
                    loss_total += loss.item()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                step, done_in_epoch = step + 1, done_in_epoch + 1
                metrics.add({"loss": loss_total}, step)  # sent in batches: a step never waits for MLflow
                if step % checkpoints.every == 0 or should_stop():
                    metrics.flush()  # before the checkpoint: the history has every step its checkpoint has
                if checkpoints.step_done(step, position={"epoch": epoch, "batch": done_in_epoch}):
                    print(f"gpupool: stopped at step {step} (asked to stop; saved)", flush=True)
                    return 128 + signal.SIGTERM
                if step >= steps:
                    break
            else:
                epoch, done_in_epoch = epoch + 1, 0
        metrics.flush()
        logits = predict(model, tokenizer, validation, max_length, fit.device)
        accuracy = (logits.argmax(-1) == torch.tensor([r["label"] for r in validation])).float().mean().item()
        mlflow.log_metric("validation_accuracy", accuracy, step=step)
        print(f"gpupool: step {step} of {steps}; validation accuracy {accuracy:.3f} on {len(validation)} examples",
              flush=True)
        folder = output / "model"
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    name = team_model_name(config["register"]["name"])
    version = register_folder(run.info.run_id, folder, "model", name,
                              description=f"{config['model']} fine-tuned {step} steps (run {run.info.run_id})")
    print(f"gpupool: registered {name} version {version.version}", flush=True)

    registered = mlflow.artifacts.download_artifacts(f"models:/{name}/{version.version}",
                                                     dst_path=str(output / "registered"))
    reloaded = AutoModelForSequenceClassification.from_pretrained(registered, local_files_only=True).to(fit.device)
    difference = (predict(reloaded, tokenizer, validation, max_length, fit.device) - logits).abs().max().item()
    if difference > 1e-4:
        print(f"gpupool: the registered model does not reproduce the trained one (logits differ by up to "
              f"{difference:.2e})", file=sys.stderr)
        return 1
    print(f"gpupool: the registered model gives the trained model's logits (max difference {difference:.1e})",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
