"""Share translation: each profile of the example cluster → exact Kubernetes fragments and card units."""

from __future__ import annotations

from fractions import Fraction

import pytest

from gpupool.policies import DEFAULT_POLICY_DIR, EXAMPLES_DIR, load_policy
from gpupool.policies.model import GPUModel, GPURequest
from gpupool.policies.resources import card_share, gpu_resources, profile_gpu, profile_share

NVIDIA_TAINT = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]

# Every GPU profile of policies/examples: backend, share in card units, and the rendered fragment.
EXPECTED = {
    "h200-quarter": ("hami", Fraction(1, 4), {
        "limits": {"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 25, "nvidia.com/gpucores": 25},
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
        "annotations": {"nvidia.com/use-gputype": "H200"},
        "tolerations": NVIDIA_TAINT,
    }),
    "h200-mig-1g": ("mig", Fraction(1, 7), {
        "limits": {"nvidia.com/mig-1g.18gb": 1},
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
        "annotations": {},
        "tolerations": NVIDIA_TAINT,
    }),
    "h200-whole-2": ("whole", Fraction(2), {
        "limits": {"nvidia.com/gpu": 2},
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
        "annotations": {},
        "tolerations": NVIDIA_TAINT,
    }),
    "a100-half-hami": ("hami", Fraction(1, 2), {
        "limits": {"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 50, "nvidia.com/gpucores": 50},
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
        "annotations": {"nvidia.com/use-gputype": "A100-80GB"},
        "tolerations": NVIDIA_TAINT,
    }),
    "a100-quarter-vgpu": ("volcano-vgpu", Fraction(1, 4), {
        "limits": {"volcano.sh/vgpu-number": 1, "volcano.sh/vgpu-memory": 20480, "volcano.sh/vgpu-cores": 25},
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
        "annotations": {},
        "tolerations": NVIDIA_TAINT,
    }),
    "a100-mig-3g": ("mig", Fraction(3, 7), {
        "limits": {"nvidia.com/gpu": 1},
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB-MIG-3g.40gb"},
        "annotations": {},
        "tolerations": NVIDIA_TAINT,
    }),
    "a100-whole": ("whole", Fraction(1), {
        "limits": {"nvidia.com/gpu": 1},
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
        "annotations": {},
        "tolerations": NVIDIA_TAINT,
    }),
    "rtx4090-quarter": ("timeslice", Fraction(1, 4), {
        "limits": {"nvidia.com/gpu.shared": 1},
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-GeForce-RTX-4090"},
        "annotations": {},
        "tolerations": NVIDIA_TAINT,
    }),
    "rtx4090-whole": ("whole", Fraction(1), {
        "limits": {"nvidia.com/gpu": 1},
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-GeForce-RTX-4090"},
        "annotations": {},
        "tolerations": NVIDIA_TAINT,
    }),
    "k100-half": ("hami", Fraction(1, 2), {
        "limits": {"hygon.com/dcunum": 1, "hygon.com/dcumem": 32768, "hygon.com/dcucores": 50},
        "node_selector": {},
        "annotations": {"hygon.com/use-dcutype": "K100"},
        "tolerations": [],
    }),
}


@pytest.fixture(scope="module")
def cluster():
    return load_policy(EXAMPLES_DIR)


def test_every_gpu_profile_of_the_example_set_is_covered(cluster):
    gpu_profiles = {slug for slug, p in cluster.profiles.items() if p.gpu is not None}
    assert gpu_profiles == set(EXPECTED)
    covered = {(cluster.profiles[s].gpu.model, backend) for s, (backend, _, _) in EXPECTED.items()}
    offered = {(name, b) for name, m in cluster.models.items() for b in m.backends}
    assert covered == offered, "every backend of every model has a profile in the example set"


@pytest.mark.parametrize("slug", sorted(EXPECTED))
def test_translation(cluster, slug):
    backend, share, fragment = EXPECTED[slug]
    resources = profile_gpu(cluster.profiles[slug], cluster)
    assert resources.backend == backend
    assert resources.share == share
    assert profile_share(cluster.profiles[slug], cluster) == share
    assert resources.as_dict() == fragment


def test_cpu_profile_has_no_gpu(cluster):
    assert profile_gpu(cluster.profiles["cpu"], cluster) is None
    assert profile_share(cluster.profiles["cpu"], cluster) == 0


def test_default_set_shares():
    policy = load_policy(DEFAULT_POLICY_DIR)
    shares = {slug: profile_share(p, policy) for slug, p in policy.profiles.items()}
    assert shares == {"cpu": 0, "h200-quarter": Fraction(1, 4), "h200-half": Fraction(1, 2),
                      "h200-mig-1g": Fraction(1, 7), "h200-whole": 1}


def _model(**kw) -> GPUModel:
    base = {"vendor": "nvidia", "memory_gib": 80, "backends": ["hami"]}
    return GPUModel.model_validate({**base, **kw})


def test_mig_single_strategy_and_a30_slices():
    a30 = _model(memory_gib=24, backends=["mig"], mig={"strategy": "single", "profiles": ["2g.12gb"]})
    request = GPURequest.model_validate({"model": "A30", "mig": "2g.12gb"})
    assert card_share(request, a30) == Fraction(2, 4)
    assert gpu_resources(request, a30).node_selector == {"nvidia.com/gpu.product": "NVIDIA-A30-MIG-2g.12gb"}


def test_hami_whole_cards_are_exclusive():
    resources = gpu_resources(GPURequest.model_validate({"model": "A100", "count": 2}), _model(backends=["hami"]))
    assert resources.limits == {"nvidia.com/gpu": 2, "nvidia.com/gpumem-percentage": 100, "nvidia.com/gpucores": 100}


def test_metax_memory_in_gib():
    metax = _model(vendor="metax", memory_gib=64)
    resources = gpu_resources(GPURequest.model_validate({"model": "C500", "share": 0.25}), metax)
    assert resources.limits == {"metax-tech.com/sgpu": 1, "metax-tech.com/vmemory": 16, "metax-tech.com/vcore": 25}
    assert resources.annotations == {} and resources.tolerations == []


@pytest.mark.parametrize(
    ("model", "request_", "message"),
    [
        ({"backends": ["hami"]}, {"share": "1/3"}, "whole percents"),
        ({"backends": ["timeslice"], "timeslice": {"replicas": 4}}, {"share": 0.3}, "multiples of 1/4"),
        ({"backends": ["hami", "volcano-vgpu"]}, {"share": 0.5}, "several backends fit"),
        ({"backends": ["whole"]}, {"share": 0.5}, "offers no backend"),
        ({"backends": ["hami"]}, {"share": 0.5, "backend": "mig"}, "cannot deliver"),
        ({"backends": ["hami"]}, {"share": 0.5, "backend": "volcano-vgpu"}, "not offered"),
        ({"backends": ["mig"], "mig": {"profiles": ["1g.10gb"]}}, {"mig": "2g.20gb"}, "not configured"),
    ],
)
def test_undeliverable_requests(model, request_, message):
    request = GPURequest.model_validate({"model": "X", **request_})
    with pytest.raises(ValueError, match=message):
        gpu_resources(request, _model(**model))
