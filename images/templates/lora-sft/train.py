"""LoRA supervised fine-tuning of a causal language model (gpupool template `lora-sft`).

    python train.py                      # config.yaml beside this file
    gpupool jobs submit --profile h200-quarter --image finetune -- python train.py

Everything it does is set in config.yaml. It picks precision and micro-batch for the share it runs on, reads
prompt/completion pairs (a file here, or a version of the team's dataset registry), trains LoRA adapters with
the transformers Trainer, checkpoints through gpupool.train (a killed or preempted job resumes from its last
committed checkpoint, with the same step counter and the same MLflow run), then registers the adapter as a new
version of the team's model in MLflow and checks that the registered adapter gives the trained model's logits.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import mlflow
import torch
import yaml
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import Trainer, TrainingArguments, set_seed

from gpupool.train import should_stop
from gpupool.train.data import dataset_source, read_jsonl
from gpupool.train.fit import choose
from gpupool.train.hf import CommitCheckpoints, LogToMLflow, last_committed_checkpoint
from gpupool.train.models import load_causal_lm
from gpupool.train.tracking import register_folder, resumable_run, team_model_name

HERE = Path(__file__).resolve().parent
PROBE = "What is 2 + 2?"


def chat(tokenizer, prompt: str, completion: str | None = None) -> str:
    """The model's own chat format where it has one (an instruct model), else plain text."""
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}]
        if completion is None:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": completion}],
                                             tokenize=False)
    return f"{prompt}\n" + ("" if completion is None else f"{completion}{tokenizer.eos_token}")


def examples(tokenizer, rows: list[dict], max_length: int) -> list[dict]:
    """Tokenised pairs; the loss is on the completion only (the prompt's labels are -100)."""
    out = []
    for number, row in enumerate(rows, 1):
        if not isinstance(row.get("prompt"), str) or not isinstance(row.get("completion"), str):
            raise SystemExit(f"row {number}: each row has a string 'prompt' and 'completion'")
        prompt = tokenizer(chat(tokenizer, row["prompt"]), add_special_tokens=False)["input_ids"]
        whole = tokenizer(chat(tokenizer, row["prompt"], row["completion"]), add_special_tokens=False)["input_ids"]
        whole = whole[:max_length]
        labels = [-100] * min(len(prompt), len(whole)) + whole[len(prompt):]
        out.append({"input_ids": whole, "labels": labels})
    return out


def collate(pad_id: int):
    def pad(batch: list[dict]) -> dict:
        width = max(len(item["input_ids"]) for item in batch)
        ids = torch.full((len(batch), width), pad_id)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, item in enumerate(batch):
            n = len(item["input_ids"])
            ids[row, :n] = torch.tensor(item["input_ids"])
            labels[row, :n] = torch.tensor(item["labels"])
            mask[row, :n] = 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
    return pad


@torch.no_grad()
def probe_logits(model, tokenizer) -> torch.Tensor:
    model.eval()
    inputs = tokenizer(chat(tokenizer, PROBE), return_tensors="pt", add_special_tokens=False).to(model.device)
    return model(**inputs).logits.float().cpu()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=HERE / "config.yaml")
    parser.add_argument("--output", type=Path, default=None,
                        help="checkpoints and the adapter (default: $GPUPOOL_CHECKPOINT_DIR in a job, else ./output)")
    args = parser.parse_args(argv)
    config = yaml.safe_load(args.config.read_text())
    output = args.output or Path(os.environ.get("GPUPOOL_CHECKPOINT_DIR") or args.config.parent / "output")
    output.mkdir(parents=True, exist_ok=True)
    train, lora = config["train"], config["lora"]

    fit = choose(int(train["batch_size"]), float(train.get("memory_per_sample_gib", 0.5)))
    print(fit.says(), flush=True)
    data = dataset_source(config["dataset"], args.config.parent, output)
    set_seed(int(train.get("seed", 0)))
    tokenizer, model, source = load_causal_lm(config["model"], config.get("model_hub") == "download",
                                              dtype=fit.torch_dtype)
    print(f"gpupool: model {source.describe()}", flush=True)
    model = get_peft_model(model, LoraConfig(r=int(lora["r"]), lora_alpha=int(lora["alpha"]),
                                             lora_dropout=float(lora.get("dropout", 0.0)),
                                             target_modules=list(lora["targets"]), task_type="CAUSAL_LM"))
    rows = examples(tokenizer, read_jsonl(data.path), int(train.get("max_length", 256)))

    checkpoints = output / "trainer"
    resume = last_committed_checkpoint(checkpoints)
    print(f"gpupool: resuming from {Path(resume).name}" if resume else "gpupool: starting at step 0", flush=True)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=str(checkpoints), max_steps=int(train["steps"]), learning_rate=float(train["learning_rate"]),
            per_device_train_batch_size=fit.micro_batch, gradient_accumulation_steps=fit.accumulation,
            bf16=fit.precision == "bf16", fp16=fit.precision == "fp16", use_cpu=fit.device == "cpu",
            logging_steps=1, save_steps=int(train["checkpoint_every"]), save_total_limit=2,
            seed=int(train.get("seed", 0)), report_to="none", disable_tqdm=True, remove_unused_columns=False),
        train_dataset=rows, data_collator=collate(tokenizer.pad_token_id),
        callbacks=[LogToMLflow(), CommitCheckpoints()])  # the metrics flushed before each checkpoint commits

    with resumable_run(output, run_name=config["register"]["name"]) as run:
        mlflow.log_params({"model": config["model"], "model.source": source.describe()[:500],
                           "lora.r": lora["r"], "lora.alpha": lora["alpha"], "lora.targets": ",".join(lora["targets"]),
                           "steps": train["steps"], "batch_size": fit.batch_size, "learning_rate": train["learning_rate"],
                           "precision": fit.precision, **data.params})
        trainer.train(resume_from_checkpoint=resume)
        done = trainer.state.global_step
        print(f"gpupool: step {done} of {train['steps']}", flush=True)
        if should_stop() and done < int(train["steps"]):  # asked to stop (a preemption): saved, comes back
            return 128 + signal.SIGTERM
        adapter = output / "adapter"
        model.save_pretrained(adapter)
        tokenizer.save_pretrained(adapter)
        trained = probe_logits(model, tokenizer)
    name = team_model_name(config["register"]["name"])
    version = register_folder(run.info.run_id, adapter, "adapter", name,
                              description=f"LoRA adapter of {config['model']} ({done} steps, run {run.info.run_id})")
    print(f"gpupool: registered {name} version {version.version}", flush=True)

    # What the registry now holds, loaded as anyone would: the base model again, the adapter from MLflow.
    registered = mlflow.artifacts.download_artifacts(f"models:/{name}/{version.version}",
                                                     dst_path=str(output / "registered"))
    _, base, _ = load_causal_lm(config["model"], config.get("model_hub") == "download", dtype=fit.torch_dtype)
    reloaded = PeftModel.from_pretrained(base.to(model.device), registered)
    difference = (probe_logits(reloaded, tokenizer) - trained).abs().max().item()
    if difference > 1e-4:
        print(f"gpupool: the registered adapter does not reproduce the trained model (logits differ by up to "
              f"{difference:.2e})", file=sys.stderr)
        return 1
    print(f"gpupool: the registered adapter gives the trained model's logits (max difference {difference:.1e})",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
