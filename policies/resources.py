"""GPU share → what the cluster or the local machine is asked for. Pure functions, no I/O.

`card_share` gives the share in card units that quotas, queues and bills count; `gpu_resources` gives the
Kubernetes resource limits, node selector, annotations and tolerations of each sharing backend, with the
resource names of HAMi, Volcano's deviceshare plugin and the NVIDIA device plugin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from gpupool.policies.model import (
    MIG_PROFILE,
    GPUModel,
    GPURequest,
    Policy,
    Profile,
    mig_slices,
    product_label,
)

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
NVIDIA_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}

#: HAMi's resource names per vendor: (count, memory, memory unit, cores, model-pinning annotation).
#: Memory units follow each vendor's HAMi device plugin: NVIDIA takes a percentage, Hygon MiB, MetaX GiB.
HAMI_NAMES: dict[str, dict[str, str | None]] = {
    "nvidia": {
        "count": "nvidia.com/gpu", "memory": "nvidia.com/gpumem-percentage", "memory_unit": "percent",
        "cores": "nvidia.com/gpucores", "type_annotation": "nvidia.com/use-gputype",
    },
    "hygon": {
        "count": "hygon.com/dcunum", "memory": "hygon.com/dcumem", "memory_unit": "MiB",
        "cores": "hygon.com/dcucores", "type_annotation": "hygon.com/use-dcutype",
    },
    "metax": {
        "count": "metax-tech.com/sgpu", "memory": "metax-tech.com/vmemory", "memory_unit": "GiB",
        "cores": "metax-tech.com/vcore", "type_annotation": None,
    },
}


@dataclass(frozen=True)
class GPUResources:
    """The GPU part of a pod spec for one profile."""

    backend: str
    model: str
    share: Fraction
    limits: dict[str, int] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, str]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "limits": dict(self.limits),
            "node_selector": dict(self.node_selector),
            "annotations": dict(self.annotations),
            "tolerations": [dict(t) for t in self.tolerations],
        }


def _percent(share: Fraction, backend: str) -> int:
    percent = share * 100
    if percent.denominator != 1:
        raise ValueError(
            f"{backend} takes whole percents of a card: share {share} is {float(percent):.2f}% "
            "(accepted: multiples of 0.01)"
        )
    return int(percent)


def card_share(request: GPURequest, model: GPUModel) -> Fraction:
    """The share of one card `request` holds: 0.25, 1/7 for a 1g MIG slice of a 7-slice card, 2 for two cards."""
    if request.count is not None:
        return Fraction(request.count)
    if request.mig is not None:
        match = MIG_PROFILE.fullmatch(request.mig)
        assert match is not None  # the policy model checked the name
        return Fraction(int(match.group(1)), mig_slices(request.model, model))
    assert request.share is not None
    return request.share


def gpu_resources(request: GPURequest, model: GPUModel) -> GPUResources:
    """Kubernetes limits, node selector, annotations and tolerations for `request` on `model`.

    Raises ValueError naming what is wrong when the model's backends cannot deliver the request.
    """
    backend = request.backend_for(model)
    share = card_share(request, model)
    name = request.model
    product = product_label(name, model)
    tolerations = list(model.tolerations) if model.tolerations is not None else (
        [dict(NVIDIA_TOLERATION)] if model.vendor == "nvidia" else []
    )
    limits: dict[str, int]
    node_selector: dict[str, str] = {}
    annotations: dict[str, str] = {}

    if backend == "hami":
        names = HAMI_NAMES.get(model.vendor)
        if names is None:
            raise ValueError(
                f"gpupool does not know HAMi's resource names for vendor {model.vendor!r} "
                f"(supported: {', '.join(HAMI_NAMES)})"
            )
        count, per_card = (request.count, Fraction(1)) if request.count is not None else (1, share)
        percent = _percent(per_card, "HAMi")
        memory = {
            "percent": percent,
            "MiB": math.floor(per_card * model.memory_gib * 1024),
            "GiB": math.floor(per_card * model.memory_gib),
        }[names["memory_unit"]]
        if memory < 1:
            raise ValueError(f"share {share} of a {model.memory_gib} GiB card leaves no device memory")
        limits = {names["count"]: count, names["memory"]: memory, names["cores"]: percent}
        if names["type_annotation"]:
            annotations[names["type_annotation"]] = name
        if model.vendor == "nvidia":
            # HAMi's type annotation is read by HAMi's scheduler only: any other scheduler (Volcano's, the
            # default one) would place the share on any card with room, an A100 for an H200 profile.
            node_selector[GPU_PRODUCT_LABEL] = product
    elif backend == "volcano-vgpu":
        limits = {
            "volcano.sh/vgpu-number": 1,
            "volcano.sh/vgpu-memory": math.floor(share * model.memory_gib * 1024),
            "volcano.sh/vgpu-cores": _percent(share, "Volcano vGPU"),
        }
        node_selector[GPU_PRODUCT_LABEL] = product
    elif backend == "mig":
        assert model.mig is not None and request.mig is not None
        if request.mig not in model.mig.profiles:
            raise ValueError(
                f"MIG profile {request.mig} is not configured for {name} "
                f"(configured: {', '.join(model.mig.profiles)})"
            )
        if model.mig.strategy == "mixed":
            limits = {f"nvidia.com/mig-{request.mig}": 1}
            node_selector[GPU_PRODUCT_LABEL] = product
        else:
            limits = {"nvidia.com/gpu": 1}
            node_selector[GPU_PRODUCT_LABEL] = f"{product}-MIG-{request.mig}"
    elif backend == "timeslice":
        assert model.timeslice is not None
        replicas = share * model.timeslice.replicas
        if replicas.denominator != 1:
            raise ValueError(
                f"{name} is time-sliced into {model.timeslice.replicas} replicas: "
                f"accepted shares are multiples of 1/{model.timeslice.replicas}, not {share}"
            )
        limits = {"nvidia.com/gpu.shared": int(replicas)}
        node_selector[GPU_PRODUCT_LABEL] = product
    else:  # whole
        limits = {"nvidia.com/gpu": int(share)}
        node_selector[GPU_PRODUCT_LABEL] = product
    return GPUResources(backend, name, share, limits, node_selector, annotations, tolerations)


def profile_gpu(profile: Profile, policy: Policy) -> GPUResources | None:
    """The GPU part of `profile` under `policy`, or None for a CPU-only profile."""
    if profile.gpu is None:
        return None
    return gpu_resources(profile.gpu, policy.models[profile.gpu.model])


def profile_share(profile: Profile, policy: Policy) -> Fraction:
    """Card units `profile` holds (0 for CPU-only profiles)."""
    if profile.gpu is None:
        return Fraction(0)
    return card_share(profile.gpu, policy.models[profile.gpu.model])
