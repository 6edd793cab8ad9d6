"""What a training run can afford on the share it runs on: device, precision and micro-batch.

    fit = choose(batch_size=16, memory_per_sample_gib=0.4)
    print(fit.says())   # "gpupool: 1/4 × H200 (35.2 GiB of 140.8): bf16, batch 16 = 8 × 2 accumulated"

The platform says the share in `GPUPOOL_SHARE` (a fraction of one card: `1/4`, `1`, `0` for CPU-only) and the
card model in `GPUPOOL_GPU_MODEL`; CUDA says the card's memory and whether it computes in bf16. A fraction of a
card gets that fraction of its memory (HAMi and MPS enforce it), so the micro-batch is what fits there, and
gradient accumulation makes up the batch you asked for: the same optimisation on any share, only slower on a
smaller one. bf16 where the card has it, fp16 on older cards, fp32 on the CPU.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from fractions import Fraction

SHARE_ENV = "GPUPOOL_SHARE"
MODEL_ENV = "GPUPOOL_GPU_MODEL"
#: Memory kept back for the CUDA context, the allocator's slack and activations the estimate misses.
HEADROOM = 0.8


def share_from_env(environ=os.environ) -> Fraction | None:
    """The card share of this server or job (None outside gpupool)."""
    text = environ.get(SHARE_ENV)
    if not text:
        return None
    try:
        share = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"{SHARE_ENV}={text!r}: a card share is a fraction like 1/4 or a number like 0.5") from None
    if share < 0:
        raise ValueError(f"{SHARE_ENV}={text!r}: a card share is not negative")
    return share


@dataclass(frozen=True)
class Fit:
    device: str  # "cuda" or "cpu"
    precision: str  # "bf16", "fp16" or "fp32"
    batch_size: int  # the batch asked for, one optimiser step
    micro_batch: int  # samples per forward pass
    accumulation: int  # forward passes per optimiser step
    memory_gib: float | None  # the share's memory (None on the CPU)
    share: Fraction | None
    gpu_model: str | None

    def says(self) -> str:
        if self.device == "cpu":
            where = "CPU (no GPU in this share)" if not self.share else "CPU (CUDA sees no card)"
        else:
            share = "" if self.share in (None, 1) else f"{self.share} × "
            where = f"{share}{self.gpu_model or 'GPU'} ({self.memory_gib:.1f} GiB)"
        split = (f"batch {self.batch_size}" if self.accumulation == 1
                 else f"batch {self.batch_size} = {self.micro_batch} × {self.accumulation} accumulated")
        return f"gpupool: on {where}: {self.precision}, {split}"

    @property
    def torch_dtype(self):
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.precision]


def plan(batch_size: int, memory_per_sample_gib: float, *, cuda: bool, memory_gib: float | None = None,
         bf16: bool = False, share: Fraction | None = None, gpu_model: str | None = None) -> Fit:
    """The pure choice (`choose` reads the machine): the largest micro-batch that divides the batch and fits in
    the share's memory, at least one."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size is a whole number ≥ 1, not {batch_size!r}")
    if not cuda:
        return Fit("cpu", "fp32", batch_size, batch_size, 1, None, share, gpu_model)
    precision = "bf16" if bf16 else "fp16"
    fits = max(1, math.floor(memory_gib * HEADROOM / memory_per_sample_gib)) if memory_per_sample_gib > 0 else batch_size
    micro = max(d for d in range(1, min(batch_size, fits) + 1) if batch_size % d == 0)  # the batch stays exact
    return Fit("cuda", precision, batch_size, micro, batch_size // micro, memory_gib, share, gpu_model)


def choose(batch_size: int, memory_per_sample_gib: float = 0.5, environ=os.environ) -> Fit:
    """The fit on this machine: CUDA if a card is visible, its memory times the share."""
    import torch

    share = share_from_env(environ)
    gpu_model = environ.get(MODEL_ENV)
    if not torch.cuda.is_available():
        return plan(batch_size, memory_per_sample_gib, cuda=False, share=share, gpu_model=gpu_model)
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    memory = total * float(share) if share and share < 1 else total
    return plan(batch_size, memory_per_sample_gib, cuda=True, memory_gib=memory,
                bf16=torch.cuda.is_bf16_supported(), share=share, gpu_model=gpu_model)
