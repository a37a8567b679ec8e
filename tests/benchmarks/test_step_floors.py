"""benchmarks/step_floors.py beyond its smoke test: the floor replays the learner's loop on the captured batch, and a
restored step samples the same batch again (what makes the timed steps comparable and the floor the step's own)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import step_floors  # noqa: E402
from floors import capturing  # noqa: E402


def toy_trainer(tmp_path: Path):
    # 6 prompts x 4 samples = 24; 2 inner epochs x 2 mini-batches of 12 x micro-batches of 5 (5, 5, 2):
    # 2 * 2 * 3 = 12 backward passes and 2 * 2 = 4 optimizer steps per training step.
    args = step_floors.parse_args(["--plugin", "toy", "--override", "rollout.prompts_per_step=6",
                                   "rollout.group_size=4", "algorithm.inner_epochs=2", "algorithm.minibatches=2",
                                   "algorithm.micro_batch_size=5", "algorithm.kl_coef=0.1", "plugin.train_size=32",
                                   "plugin.eval_size=4"])
    return step_floors.build_trainer(args, tmp_path)


def test_the_floor_replays_the_learners_passes(tmp_path):
    trainer = toy_trainer(tmp_path)
    try:
        passes = []  # the tokens of the samples of each training forward the learner makes, in order
        forward = trainer.plugin.forward

        def recorded(policy, rollout, **kwargs):
            if torch.is_grad_enabled():
                passes.append(rollout.replay["tokens"].clone())
            return forward(policy, rollout, **kwargs)

        trainer.plugin.forward = recorded
        steps_before = trainer.learner.optimizer_steps
        with capturing(trainer) as capture:
            trainer.training_step()
        del trainer.plugin.forward
        optimizer_steps = trainer.learner.optimizer_steps - steps_before
        floor = step_floors.floor_class("toy")(trainer, capture)

        assert (len(passes), optimizer_steps) == (12, 4)
        assert (floor.backward_passes(), len(floor.schedule)) == (12, 4)
        assert [len(unit.indices) for minibatch in floor.schedule for unit in minibatch] == [5, 5, 2] * 4
        floor_tokens = [unit.inputs[1] for minibatch in floor.schedule for unit in minibatch]
        for learner_tokens, replayed in zip(passes, floor_tokens, strict=True):
            assert torch.equal(learner_tokens, replayed)
        # Every inner epoch covers every sample once.
        for epoch in range(2):
            seen = sorted(i for minibatch in floor.schedule for unit in minibatch if unit.epoch == epoch
                          for i in unit.indices)
            assert seen == list(range(24))
        # kl_coef > 0: the reference pass is timed as an extra; the toy runs no separate old-policy pass.
        assert set(floor.extras()) == {"reference", "logprob_math"}
        parts = floor.run()
        assert set(parts) == {"generation", "forward_backward", "optimizer"} and all(v > 0 for v in parts.values())
    finally:
        trainer.close()


def test_a_restored_step_samples_the_same_batch_and_the_floor_leaves_the_weights(tmp_path):
    trainer = toy_trainer(tmp_path)
    try:
        trainer.training_step()  # a step with Adam state, so that the snapshot holds some
        snapshot = step_floors.Snapshot(trainer)
        with capturing(trainer) as first:
            trainer.training_step()
        after_first = [p.detach().clone() for p in trainer.policy.parameters()]
        snapshot.restore(trainer)
        with capturing(trainer) as second:
            trainer.training_step()
        for a, b in zip(first.rollouts, second.rollouts, strict=True):
            assert torch.equal(a.replay["tokens"], b.replay["tokens"])
        for a, b in zip(after_first, trainer.policy.parameters(), strict=True):
            torch.testing.assert_close(a, b.detach())
        # The floor's optimizer has learning rate 0 and no weight decay moves (lr 0): the weights stay put, so the
        # floor does not change what the next timed step samples.
        floor = step_floors.floor_class("toy")(trainer, second)
        before = [p.detach().clone() for p in trainer.policy.parameters()]
        floor.run()
        for a, b in zip(before, trainer.policy.parameters(), strict=True):
            assert torch.equal(a, b.detach())
    finally:
        trainer.close()


def test_the_vlm_floor_shares_each_prompt_forward_as_the_plugin_does(tmp_path):
    """The vlm recipe's plugin runs each distinct prompt once per teacher-forced pass (share_prompt_forward): the
    floor does too, and its shared pass computes the plain pass's completion logits (up to float rounding)."""
    args = step_floors.parse_args(["--plugin", "vlm", "--threads", "1"])
    trainer = step_floors.build_trainer(args, tmp_path)
    try:
        with capturing(trainer) as capture:
            trainer.training_step()
        floor = step_floors.floor_class("vlm")(trainer, capture)
        assert floor.shares_prompts
        units = [unit.inputs for minibatch in floor.schedule for unit in minibatch]
        assert units and all(inputs["shared"] is not None for inputs in units)  # G = 4: every pass repeats prompts
        with torch.no_grad():
            for inputs in units:
                distinct = inputs["shared"]["prefix"]["input_ids"].shape[0]
                assert distinct < inputs["teacher"]["input_ids"].shape[0]
                shared = floor.teacher_forced(floor.hf, inputs)  # [n, C, V]
                plain = floor.teacher_forced(floor.hf, {**inputs, "shared": None})
                assert shared.shape == plain.shape == (*inputs["teacher"]["input_ids"][:, -inputs["completion"]:]
                                                       .shape, plain.shape[-1])
                # the completions' own positions (right padding of shorter completions is never scored)
                real = inputs["teacher"]["attention_mask"][:, -inputs["completion"]:].bool()  # [n, C]
                torch.testing.assert_close(shared[real], plain[real], rtol=0, atol=1e-5)
        assert "prompt forward shared per distinct prompt: [True" in floor.describe()["forward_backward"]
    finally:
        trainer.close()


def test_the_dllm_floor_scores_the_old_policy_where_the_learner_does(tmp_path):
    """μ = 2 with a plan per epoch and two mini-batches: the learner's old-policy pass scores plan 0 for the second
    mini-batch only (the first is its own old policy) and plan 1 for every sample; the floor's ``old_logp`` extra
    scores the same samples."""
    args = step_floors.parse_args(["--plugin", "dllm", "--override", "rollout.prompts_per_step=4",
                                   "rollout.group_size=4", "algorithm.minibatches=2", "algorithm.micro_batch_size=8",
                                   "plugin.train_size=64", "plugin.eval_size=4"])
    trainer = step_floors.build_trainer(args, tmp_path)
    try:
        plugin, scored = trainer.plugin, []  # (plan, samples) of every no-grad forward in the learner
        forward = plugin.forward

        def recorded(policy, rollout, **kwargs):
            if not torch.is_grad_enabled():
                scored.append((plugin._inner_epoch, sorted(rollout.replay["sample_index"].tolist())))
            return forward(policy, rollout, **kwargs)

        plugin.forward = recorded
        collect = trainer.collector.collect

        def numbered(*a, **k):  # tag each sample with its index, to see which ones the pass scores
            batch = collect(*a, **k)
            batch.rollout.replay["sample_index"] = torch.arange(len(batch.rollout))
            return batch

        trainer.collector.collect = numbered
        with capturing(trainer) as capture:
            trainer.training_step()
        del plugin.forward
        floor = step_floors.floor_class("dllm")(trainer, capture)
        expected = floor.old_policy_samples()
        assert [len(samples) for samples in expected] == [8, 16]
        assert scored == [(plan, samples) for plan, samples in enumerate(expected)]
        assert "old_logp" in floor.extras()
    finally:
        trainer.close()


def test_the_canvas_floor_runs_the_model_calls_the_plugin_scores_with(tmp_path):
    """The canvas floor's scoring passes (encoder, self-conditioning and decoder passes per canvas, on the stored
    noise plan) give, once reduced as the plugin reduces them, the plugin's own scores; its generation replays the
    rollout's batched decoder calls."""
    args = step_floors.parse_args(["--plugin", "dllm_canvas", "--override", "rollout.prompts_per_step=2",
                                   "rollout.group_size=4", "plugin.eval_size=4"])
    trainer = step_floors.build_trainer(args, tmp_path)
    try:
        with capturing(trainer) as capture:
            trainer.training_step()
        floor = step_floors.floor_class("dllm_canvas")(trainer, capture)
        plugin, replay = trainer.plugin, floor.rollout.replay
        indices = list(range(len(floor.rollout)))
        inputs = floor.plan_inputs(indices, 0)
        with torch.no_grad():
            logits = floor.passes(floor.module, inputs)
            expected = plugin.score_canvas(floor.module, replay, plan=0)  # [n, G]
        length, draws = floor.canvas_length, replay["plan_masked"].shape[2]
        ours = torch.zeros(len(indices) * draws, replay["completion_ids"].shape[1])
        for k, canvas in enumerate(logits):
            columns = slice(k * length, (k + 1) * length)
            picked = canvas.float().log_softmax(-1).gather(-1, inputs["clean"][:, columns].unsqueeze(-1)).squeeze(-1)
            ours[:, columns] = picked * inputs["scored"][:, columns]
        assert torch.allclose(ours.view(len(indices), draws, -1).mean(dim=1), expected, atol=1e-5)
        calls = sum(int(call.metrics["decoder_calls"]) for call in capture.rollouts)
        assert calls == sum(c for *_, c in floor.calls) and calls >= sum(c for *_, c, _ in floor.calls)
    finally:
        trainer.close()
