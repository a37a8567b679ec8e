"""Two CPU processes (gloo) and one process must train identically, in both group layouts.

These tests launch real processes with ``accelerate launch --multi_gpu --num_processes 2`` (on a machine without
GPUs mmrl then forms a gloo group; ``accelerate launch --cpu`` alone starts a single process in Accelerate 1.x).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("record_toy.py")
# Adam's eps is raised so that parameters with near-zero gradients do not turn float summation-order noise
# (gradients reduced over 2 processes vs summed in one) into visible update differences: with eps = 1e-8 an
# entry whose gradient is ~1e-9 moves by lr·g/(|g| + eps), which depends on g's last bits.
COMMON = ["run.max_steps=3", "eval.at_start=false", "eval.num_prompts=8", "algorithm.minibatches=1",
          "algorithm.micro_batch_size=8", "rollout.prompts_per_step=8", "rollout.group_size=4", "optim.eps=1e-3"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(out: Path, processes: int, *overrides: str, timeout: int = 240, config_file: str | None = None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    if processes == 1:
        command = [sys.executable, str(SCRIPT), str(out), *overrides]
    else:
        # This interpreter runs the launcher (not the `accelerate` script beside it, whose shebang may name another
        # environment's Python, e.g. in a copied venv), so that every process imports this checkout's mmrl.
        launcher = [sys.executable, "-m", "accelerate.commands.launch"]
        if config_file:  # a recipe from configs/accelerate, as users launch it
            launcher += ["--config_file", config_file, "--mixed_precision", "no"]
        else:
            launcher += ["--multi_gpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        command = [*launcher, "--num_processes", str(processes), "--main_process_port", str(_free_port()),
                   str(SCRIPT), str(out), *overrides]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(processes)]
    assert all(rank["num_processes"] == processes for rank in ranks)
    advantages = {}
    for rank in ranks:
        advantages.update(rank["advantages"])
    return {"advantages": advantages, "losses": ranks[0]["losses"], "rewards": ranks[0]["rewards"],
            "params": torch.load(out / "params.pt"), "gradients": torch.load(out / "gradients.pt"), "ranks": ranks}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("single"), 1, *COMMON)


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "config_file"), [("spread", "configs/accelerate/multi_gpu_ddp.yaml"),
                                                     ("contiguous", None)])
def test_two_processes_match_one(tmp_path, single, layout, config_file):
    double = _run(tmp_path, 2, *COMMON, f"rollout.layout={layout}", config_file=config_file)
    assert len(double["advantages"]) == len(single["advantages"]) == 3 * 8 * 4
    for seed, value in single["advantages"].items():
        assert double["advantages"][seed] == pytest.approx(value, abs=1e-6), seed
    assert double["rewards"] == pytest.approx(single["rewards"], abs=1e-6)
    assert double["losses"] == pytest.approx(single["losses"], abs=1e-6)
    for name, tensor in single["params"].items():
        torch.testing.assert_close(double["params"][name], tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_bucketed_rows_train_alike_on_one_and_two_processes(tmp_path):
    """Rows that cannot share a batch (``Plugin.row_buckets``; tests.helpers.BucketToy, whose rollout fails on a batch
    that mixes buckets) over two processes: at every step both processes draw that step's bucket, the one process
    draws at that step, the optimizer steps apply the same gradients (to float reduction order, as above), and the
    evaluation's per-bucket sample files hold the same samples. A process that drew its own bucket would fail in its
    rollout or train other rows."""
    overrides = [*COMMON, "plugin.min_length=3", "plugin.max_length=5", "eval.num_prompts=12",
                 "eval.samples_per_prompt=2"]
    single = _run(tmp_path / "one", 1, "--bucketed", *overrides)
    double = _run(tmp_path / "two", 2, "--bucketed", *overrides)

    def per_step(buckets: list[str]) -> list[str]:  # each step's one bucket, from its rollout calls' buckets
        calls = len(buckets) // 3
        assert len(buckets) == 3 * calls and calls > 0
        steps = [buckets[k * calls:(k + 1) * calls] for k in range(3)]
        assert all(len(set(step)) == 1 for step in steps), steps
        return [step[0] for step in steps]

    drawn = per_step(single["ranks"][0]["buckets"])
    assert len(set(drawn)) > 1  # the steps do change bucket (three buckets of prompt lengths 3 to 5)
    assert [per_step(rank["buckets"]) for rank in double["ranks"]] == [drawn, drawn]
    for step, (one, two) in enumerate(zip(single["gradients"], double["gradients"], strict=True)):
        assert float((one - two).norm() / one.norm()) < 1e-4, step
    for seed, value in single["advantages"].items():
        assert double["advantages"][seed] == pytest.approx(value, abs=1e-6), seed

    def samples(out: Path) -> dict[str, list[str]]:  # bucket -> its records, over the processes' files
        folder = out / "run" / "samples" / "step_000003"
        found: dict[str, list[str]] = {}
        for path in sorted(folder.iterdir()):  # eval_{bucket}.jsonl, or eval_rank{r}_{bucket}.jsonl on 2 processes
            bucket = path.stem.rsplit("_", 1)[-1]
            found[bucket] = sorted([*found.get(bucket, []), *path.read_text().splitlines()])
        return found

    written = samples(tmp_path / "one")
    assert sorted(written) == ["len3", "len4", "len5"] and sum(map(len, written.values())) == 24
    assert samples(tmp_path / "two") == written
    assert len(list((tmp_path / "two" / "run" / "samples" / "step_000003").glob("eval_rank1_len*.jsonl"))) > 0


@pytest.mark.slow
def test_two_processes_without_old_logp_match_one_with_it(tmp_path, single):
    """μ = 1, one mini-batch: two processes whose plugin computes old_logp train like one process whose rollouts
    omit them (the toy's: the learner uses the detached training log-probs)."""
    double = _run(tmp_path, 2, *COMMON, "--plugin-old-logp", "rollout.layout=contiguous")
    assert double["losses"] == pytest.approx(single["losses"], abs=1e-6)
    for name, tensor in single["params"].items():
        torch.testing.assert_close(double["params"][name], tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_synced_reference_trains_alike_on_one_and_two_processes(tmp_path):
    """algorithm.ref_sync_every: every process moves its own reference copy after each optimizer step; the KL term of
    steps 2 and 3 (β = 0.1) is taken against the synced reference, so the losses and weights agree only if every
    process synced alike."""
    sync = ["algorithm.kl_coef=0.1", "algorithm.ref_sync_every=1", "algorithm.ref_sync_mix=0.6"]
    _same_training(_run(tmp_path / "one", 1, *COMMON, *sync),
                   _run(tmp_path / "two", 2, *COMMON, *sync, "rollout.layout=contiguous"))


@pytest.mark.slow
def test_the_entropy_threshold_and_the_adaptive_entropy_coefficient_are_shared_by_the_processes(tmp_path):
    """algorithm.top_entropy_quantile gathers each backward pass's active entropies over the processes (TRL's
    get_high_entropy_mask): with one micro-batch per process and step, two processes select, over their 32 samples
    together, the actions one process selects over the same 32 in one micro-batch; contiguous layout, so each process
    holds whole groups (and so its own mean entropy differs from the joint one). In the same runs
    algorithm.entropy_target's measurement (the mean entropy of the trained actions) sums the entropies and action
    counts of both processes before it divides (TRL's window reduce): both processes take the same coefficient, whose
    bonus (open from the second step, the target above the toy's entropy) trains as one process does."""
    select = ["algorithm.top_entropy_quantile=0.2", "rollout.layout=contiguous", "algorithm.entropy_coef=0.05",
              "algorithm.entropy_target=10.0", "algorithm.entropy_coef_delta=0.05"]
    one = _run(tmp_path / "one", 1, *COMMON, *select, "algorithm.micro_batch_size=32")
    two = _run(tmp_path / "two", 2, *COMMON, *select, "algorithm.micro_batch_size=16")
    _same_training(one, two)
    expected = one["ranks"][0]["entropy_control"]
    assert expected["updates"] == 3 and expected["coef"] == pytest.approx(0.2)
    for rank in two["ranks"]:
        assert rank["entropy_control"]["last_entropy"] == pytest.approx(expected["last_entropy"], rel=1e-6)
        assert rank["entropy_control"]["coef"] == pytest.approx(expected["coef"], abs=1e-12)


def _same_training(one: dict, two: dict) -> None:
    """The same losses and final weights (float summation order aside)."""
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-6)
    for name, tensor in one["params"].items():
        torch.testing.assert_close(two["params"][name], tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_dynamic_sampling_does_not_hang_when_one_process_filters_everything(tmp_path):
    """Process 1's groups never have spread (a constant reward there); process 0 keeps sampling alongside it and
    both pad after the bounded rounds instead of waiting on each other."""
    double = _run(
        tmp_path, 2, *COMMON, "rollout.layout=contiguous", "rollout.dynamic_sampling.enabled=true",
        "rollout.dynamic_sampling.max_rounds=3", "rewards.functions=[{name: test_constant_on_rank_1}]",
        timeout=180,
    )
    rank0, rank1 = double["ranks"]
    assert all(p > 0 for p in rank0["padded"])  # the global count includes process 1's padding
    assert len(double["losses"]) == 3


@pytest.mark.slow
def test_dynamic_sampling_credits_the_same_kept_batch_on_one_and_two_processes(tmp_path):
    """Dynamic sampling with a batch statistic (batch_std's std over the kept batch): with layout spread and 2
    processes dividing G = 4, each process holds 2 members of every group, so both keep the same groups and cut at
    the same one; the kept batch, gathered in process order and put back in sampling order, is the one process's,
    and so are the advantages of every generated sample (0 outside the kept groups), the losses and the weights.
    Token accuracy of the untrained toy often ties within a group (all 0), so steps draw more than one round."""
    dynamic = [*COMMON, "rollout.layout=spread", "rollout.dynamic_sampling.enabled=true",
               "rollout.dynamic_sampling.max_rounds=3", "rewards.functions=[{name: token_accuracy}]",
               "algorithm.advantage=batch_std"]
    one = _run(tmp_path / "one", 1, *dynamic)
    two = _run(tmp_path / "two", 2, *dynamic)
    values = list(one["advantages"].values())
    assert len(values) > 3 * 8 * 4 and 0 < sum(v != 0 for v in values) < len(values)  # several rounds, some kept
    assert one["ranks"][0]["padded"] == two["ranks"][0]["padded"]
    assert two["advantages"].keys() == one["advantages"].keys()
    for seed, value in one["advantages"].items():
        assert two["advantages"][seed] == pytest.approx(value, abs=1e-6), seed
    _same_training(one, two)


# The shipped reference recipe as users run it: 16 prompts x 8, two mini-batches per step, Adam's default eps.
SHIPPED = ["--config", "configs/toy.yaml", "run.max_steps=3", "eval.at_start=false", "eval.num_prompts=8"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["spread", "contiguous"])
def test_the_shipped_recipe_applies_the_same_gradients_on_one_and_two_processes(tmp_path, layout):
    """The mini-batch partition is drawn over the global batch from the seed alone, so every optimizer step sees
    the same samples on 1 and 2 processes (issue 25: each process shuffled its own samples, and the gradients
    of the first mini-batch differed by 70% of their norm).

    What is compared is the gradient each optimizer step applies (reduced over processes, clipped), relative to
    its norm, not the parameters: with Adam's default eps an entry whose true gradient is zero or tiny (the key
    bias of the toy model, whose gradient is zero because it shifts every attention logit of a query alike) moves
    by about lr per step in a direction set by float rounding, so parameters can differ by ~1e-4 after a few
    steps even when every gradient agrees. Float32 reduction order (gloo's all-reduce of two halves against one
    sum, other micro-batch splits) gives relative differences of ~1e-6 per gradient, and the parameters'
    rounding-level differences perturb later gradients by as little; 1e-4 leaves margin, and a different
    partition is ~1 off.
    """
    single = _run(tmp_path / "one", 1, *SHIPPED, f"rollout.layout={layout}")
    double = _run(tmp_path / "two", 2, *SHIPPED, f"rollout.layout={layout}")
    assert single["gradients"].shape == double["gradients"].shape == (6, single["gradients"].shape[1])  # 3 x 2
    for step, (one, two) in enumerate(zip(single["gradients"], double["gradients"], strict=True)):
        assert float((one - two).norm() / one.norm()) < 1e-4, step
    assert double["losses"] == pytest.approx(single["losses"], rel=1e-5)
    for seed, value in single["advantages"].items():
        assert double["advantages"][seed] == pytest.approx(value, abs=1e-5), seed


# Each modality's shipped recipe, shortened: (config, overrides, optimizer steps per training step, samples per step).
MODALITY_RECIPES = {
    "dllm": ("configs/dllm/toy.yaml", ["plugin.eval_size=8"], 2, 16 * 8),  # μ = 2: one optimizer step per epoch
    # The canvas model (a tiny DiffusionGemma): its encoder runs outside the DDP wrapper's forward (the decoder
    # passes go through it), so this checks that the encoder's share of the gradient is synchronised too.
    "dllm_canvas": ("configs/dllm/toy_canvas.yaml", ["plugin.eval_size=8"], 2, 16 * 8),
    "flow": ("configs/flow/shapes.yaml", [], 2, 8 * 8),  # two mini-batches
    # Image editing (the edit world's Kontext recipe): every process reads and encodes its rows' input images, which
    # ride in the replay and reach the rewards in the payload; each sample its own initial noise.
    "flow_edit": ("configs/flow/shapes_edit.yaml", [], 2, 8 * 8),
    # Two mini-batches (the core's old-policy pass runs too); each training sample decoded alone, so that it depends
    # on its own seed only; a random tiny model never earns the recipe's format and iou rewards (all 0: no
    # gradient), so the completion length (record_toy.py) is added to give every group spread.
    "vlm": ("configs/vlm/toy_grounding.yaml",
            ["--rollout-per-sample", "algorithm.minibatches=2",
             "rewards.functions=[{name: format}, {name: iou}, {name: test_completion_length}]"], 2, 4 * 4),
}


@pytest.mark.slow
@pytest.mark.parametrize("plugin", sorted(MODALITY_RECIPES))
def test_each_modality_recipe_applies_the_same_gradients_on_one_and_two_processes(tmp_path, plugin):
    """The diffusion-LLM recipe (μ = 2 inner epochs, each with its own mask plan drawn from per-sample streams, a KL
    reference pass, the core's old-policy pass), the shapes-world flow recipe (SDE noise per sample, 3 trained
    denoising steps, two mini-batches), the edit world's recipe (the same with an input image per row) and the vlm
    grounding recipe (a tiny Qwen2.5-VL with LoRA, the KL reference as the adapter-disabled model, two mini-batches),
    2 steps each on 1 and 2 processes in the spread layout, where
    each process holds other samples of every group: the same advantages and the same gradient at every optimizer
    step (to float reduction order; see the shipped-recipe test above for the tolerance). A mask plan or a noise
    stream tied to a sample's local index instead of its global seed would differ by order 1.

    The vlm plugin's samples depend on the batch composition by design (docs/vlm.md, Seeding: one RNG stream per
    decode call), so its training batches are decoded one sample at a time here (``--rollout-per-sample``); the
    rest of its path is the plugin's own: on 2 processes the policy is wrapped by DistributedDataParallel, so the
    training and old-policy passes take the plain teacher-forced pass through the wrapper instead of the shared
    prompt forward that 1 process runs, the reference toggles the adapter of the unwrapped model, and the decode
    loop runs the unwrapped model. Without the per-sample decode the gradients differ by more than their norm."""
    config, overrides, steps_per_step, samples = MODALITY_RECIPES[plugin]
    if plugin == "vlm":  # the recipe's tiny Qwen2.5-VL, built once here for both runs
        from mmrl.plugins.vlm.testing import build_tiny_model

        overrides = [*overrides, f"plugin.model={build_tiny_model('qwen2_5_vl', tmp_path / 'tiny-qwen2_5_vl')}"]
    recipe = ["--config", config, "run.max_steps=2", "eval.at_start=false", "eval.every=0", "rollout.layout=spread",
              *overrides]
    single = _run(tmp_path / "one", 1, *recipe, timeout=400)
    double = _run(tmp_path / "two", 2, *recipe, timeout=400)
    assert single["gradients"].shape == double["gradients"].shape == (2 * steps_per_step,
                                                                      single["gradients"].shape[1])
    for step, (one, two) in enumerate(zip(single["gradients"], double["gradients"], strict=True)):
        assert float((one - two).norm() / one.norm()) < 1e-4, step
    assert double["losses"] == pytest.approx(single["losses"], rel=1e-4, abs=1e-6)  # flow's are ~1e-6 on policy
    assert len(single["advantages"]) == 2 * samples
    for seed, value in single["advantages"].items():
        assert double["advantages"][seed] == pytest.approx(value, abs=1e-6), seed
