"""The group-coupled ``dgpo`` loss trains identically on one and two CPU processes (gloo).

DGPO's group sums need a group's samples together (Luo-Yihong/DGPO@01ceb4b ``scripts/train_sd3_dgpo.py`` L162-193
all-reduces them over GPUs); mmrl keeps whole groups per process and per micro-batch instead
(:func:`mmrl.trainer.sampler.group_minibatch_partition`). On the reference (toy) plugin, whose columns are token
log-probs and whose forward returns the reference's, two mini-batches of whole groups per step must give the same
losses and weights on one process and on two.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_two_processes import COMMON, _run

DGPO = [*[option for option in COMMON if not option.startswith(("algorithm.minibatches", "algorithm.micro_batch"))],
        "algorithm.minibatches=2", "algorithm.micro_batch_size=4", "rollout.layout=contiguous",
        "algorithm.policy_loss={name: dgpo, beta_dpo: 5.0}",
        "algorithm.kl_coef=1.0e-3"]  # a small velocity-KL-like term beside the loss, as the released recipes keep


@pytest.mark.slow
def test_dgpo_trains_alike_on_one_and_two_processes(tmp_path):
    single = _run(tmp_path / "one", 1, *DGPO)
    double = _run(tmp_path / "two", 2, *DGPO)
    assert double["losses"] == pytest.approx(single["losses"], abs=1e-6)
    assert any(abs(loss) > 1e-6 for loss in single["losses"])
    for name, tensor in single["params"].items():
        torch.testing.assert_close(double["params"][name], tensor, rtol=1e-5, atol=1e-6)
