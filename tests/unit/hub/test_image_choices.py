"""Which images the default profiles offer, and how a server's choice or a job naming an image a profile does not
offer is refused with the way out: policy checks that need no server (moved from tests/e2e/test_images.py, which
builds and lints the images themselves).
"""

from __future__ import annotations

import pytest

from gpupool.hub import __version__
from gpupool.hub.accounting.jobs import JobRefused, JobSubmission, resolve
from gpupool.policies import DEFAULT_POLICY_DIR, load_policy
from gpupool.policies.choice import ChoiceRefused, check_choice


def test_every_default_gpu_profile_offers_jupyterlab_and_the_finetune_image_of_this_version():
    """Issue 33: docs/finetune.md's first fine-tune runs on the default policies: each GPU profile offers the
    fine-tuning image beside JupyterLab (preselected), as the containers `docker build` tags at this version."""
    policy = load_policy(DEFAULT_POLICY_DIR)
    for slug, profile in policy.profiles.items():
        offered = {key: (i.environment, i.image, i.default) for key, i in profile.images.items()}
        assert offered == ({} if profile.gpu is None else {
            "base": ("base", f"gpupool/base:{__version__}", True),
            "finetune": ("finetune", f"gpupool/finetune:{__version__}", False)}), slug


def test_an_image_a_profile_does_not_offer_is_refused_with_the_way_out():
    """Issue 33: `profile 'h200-quarter' has no image 'finetune' (options: none)` did not say what to do: the
    refusals of a server's choice and of a job name the profiles of the person's teams that offer the image, or
    the policy field through which an administrator offers it."""
    policy = load_policy(DEFAULT_POLICY_DIR)
    with pytest.raises(ChoiceRefused) as refused:
        check_choice(policy, "alice", ["nlp"], {"profile": "cpu", "image": "finetune"})
    assert refused.value.message == ("No such image for cpu: 'finetune'. Options include: none; 'finetune' is offered "
                                     "by profiles h200-quarter, h200-mig-1g")
    job = JobSubmission(profile="cpu", image="finetune", command=["python", "train.py"], workdir="/tmp")
    with pytest.raises(JobRefused) as refused:
        resolve(policy, "alice", ["vision"], job)
    assert str(refused.value) == ("profile 'cpu' has no image 'finetune' (options: none); 'finetune' is offered by "
                                  "profiles h200-quarter, h200-half, h200-mig-1g, h200-whole")
    job = JobSubmission(profile="h200-quarter", image="tensorflow", command=["python"], workdir="/tmp")
    with pytest.raises(JobRefused) as refused:
        resolve(policy, "alice", ["vision"], job)
    assert "no profile of your teams offers 'tensorflow': an administrator adds it to a profile's `images:` in the " \
           "policy (profiles.PROFILE.images.tensorflow; see docs/finetune.md)" in str(refused.value)
    assert resolve(policy, "alice", ["vision"], JobSubmission(profile="h200-quarter", command=["python"],
                                                               workdir="/tmp")).image == "base"

