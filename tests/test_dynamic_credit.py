"""Dynamic sampling credits the kept batch (verl's DAPO order: filter, pool, truncate, then estimate).

The collector's rounds are scripted: the toy plugin samples as usual and the scores of each round are replaced by
chosen values, so that the test knows which groups have spread, which rounds are drawn and which samples are kept.
Every expected advantage is recomputed here, by hand, on the kept batch; the group-local estimators are also
checked against the per-round estimate the trainer made before (bit for bit).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from mmrl.algos import advantage_estimators, select_kept
from mmrl.reward import ScoredBatch
from mmrl.rollout import Rollout
from mmrl.trainer import Trainer
from mmrl.trainer.collect import Collector
from mmrl.trainer.credit import sample_advantages
from tests.helpers import toy_config

G, GROUPS = 4, 8  # the toy config's group size and prompts per step: 32 samples per round, one process
WEIGHTS = torch.tensor([1.0, 0.5])
# Which of a round's 8 groups have a reward spread: 3 + 4 + 3 groups of 4 = 40 kept samples >= 32 after round 3.
SPREAD = [[0, 3, 5], [1, 2, 4, 7], [0, 1, 6]]


def _round_scores(round_index: int) -> torch.Tensor:
    """``[32, 2]`` scores of a round: groups in SPREAD[round] get values with spread (zeros among them, for gpg's
    nonzero count), the others a constant in each column."""
    generator = torch.Generator().manual_seed(100 + round_index)
    scores = torch.randint(0, 4, (GROUPS * G, 2), generator=generator).float() / 2  # [32, 2] in {0, .5, 1, 1.5}
    for group in range(GROUPS):
        rows = slice(group * G, (group + 1) * G)
        if group in SPREAD[round_index]:
            scores[group * G, 0] = 2.0  # a spread in the combined reward, whatever was drawn
        else:
            scores[rows] = scores[group * G]  # the first member's values for all: no spread
    return scores


def _scripted(trainer: Trainer, invalid: dict[int, list[int]] | None = None) -> list[dict[str, torch.Tensor]]:
    """Replace each round's scores by :func:`_round_scores` (``invalid``: round → rows made invalid, as
    ``rewards.on_nonfinite: skip`` leaves them: score 0, valid False); return what each round drew."""
    original = trainer.collector.sample_and_score
    drawn: list[dict[str, torch.Tensor]] = []

    def sample_and_score(policy, batch, timings, scorer=None):
        rollout, _ = original(policy, batch, timings, scorer)
        k = len(drawn)
        scores, valid = _round_scores(k), torch.ones(len(rollout), dtype=torch.bool)
        for row in (invalid or {}).get(k, []):
            scores[row], valid[row] = 0.0, False
        drawn.append({"scores": scores, "valid": valid, "group_ids": rollout.group_ids.clone()})
        return rollout, ScoredBatch(scores=scores, valid=valid)

    trainer.collector.sample_and_score = sample_and_score
    return drawn


def _trainer(tmp_path, advantage: str, *overrides: str) -> Trainer:
    return Trainer(toy_config(
        tmp_path, "rewards.functions=[{name: exact_match}, {name: token_accuracy, weight: 0.5}]",
        "rollout.dynamic_sampling.enabled=true", "rollout.dynamic_sampling.max_rounds=5", "run.max_steps=1",
        f"algorithm.advantage={advantage}", "algorithm.advantage_clip=null", *overrides))


def _kept_batch(drawn: list[dict[str, torch.Tensor]], target: int = GROUPS * G):
    """The test's own selection: groups whose valid combined rewards differ, their valid members in sampling order,
    the first ``target`` trained; credited = every valid member of a group with a trained member."""
    scores = torch.cat([d["scores"] for d in drawn])
    valid = torch.cat([d["valid"] for d in drawn])
    group_ids = torch.cat([d["group_ids"] for d in drawn])
    combined = scores @ WEIGHTS
    keep = torch.zeros_like(valid)
    for group in group_ids.unique():
        members = (group_ids == group) & valid
        keep |= members & (combined[members].max() > combined[members].min())
    trained = keep.nonzero().flatten()[:target]
    credited = valid & torch.isin(group_ids, group_ids[trained])
    return scores, combined, group_ids, trained, credited


def _group_mean_std(values: torch.Tensor, group_ids: torch.Tensor, rows: torch.Tensor):
    """Per-row group mean and Bessel std over ``rows`` (the credited ones), by looping over the groups."""
    mean, std = torch.zeros_like(values), torch.zeros_like(values)
    for group in group_ids[rows].unique():
        members = rows[group_ids[rows] == group]
        mean[members] = values[members].mean()
        std[members] = values[members].std() if len(members) > 1 else 0.0
    return mean, std


def _expected(name: str, options: dict, order: str, scores, combined, group_ids, credited) -> torch.Tensor:
    """The advantages of the credited rows, by hand: each estimator's formula over the kept batch."""
    rows = credited.nonzero().flatten()
    scores, combined = scores.double(), combined.double()
    mean, std = _group_mean_std(combined, group_ids, rows)
    centred = (combined - mean)[rows]
    if order == "normalize_then_sum":  # GDPO: grpo per reward (0 without spread), Σ w_k A_k, whitened (Bessel)
        summed = torch.zeros(len(rows), dtype=torch.float64)
        for k in range(scores.shape[1]):
            m, s = _group_mean_std(scores[:, k], group_ids, rows)
            column = torch.where(s[rows] > 0, (scores[rows, k] - m[rows]) / (s[rows] + 1e-6), 0.0)
            summed += float(WEIGHTS[k]) * column
        return (summed - summed.mean()) / (summed.std() + 1e-4)
    if name == "batch_std":  # population std of the kept batch's combined rewards
        return centred / (combined[rows].std(unbiased=False) + 1e-4)
    if name == "reinforce_pp_baseline":  # whitened over the kept batch (population variance, its mean is 0)
        return centred / ((centred**2).mean() + 1e-8).sqrt()
    if name == "gpg":
        counted = combined[rows] != 0 if options.get("alpha_count") == "nonzero_rewards" else std[rows] > 0
        alpha = len(rows) / counted.sum()
        return alpha * centred
    if name == "grpo":
        return torch.where(std[rows] > 0, centred / (std[rows] + 1e-6), 0.0)
    raise AssertionError(name)


BATCH_LEVEL = [("batch_std", {}, "sum_then_normalize"), ("reinforce_pp_baseline", {}, "sum_then_normalize"),
               ("gpg", {}, "sum_then_normalize"), ("gpg", {"alpha_count": "nonzero_rewards"}, "sum_then_normalize"),
               ("grpo", {}, "normalize_then_sum")]


def _advantage_override(name: str, options: dict) -> str:
    if not options:
        return name
    return "{name: " + name + ", " + ", ".join(f"{k}: {v}" for k, v in options.items()) + "}"


@pytest.mark.parametrize(("name", "options", "order"), BATCH_LEVEL,
                         ids=["batch_std", "reinforce_pp_baseline", "gpg", "gpg-nonzero", "normalize_then_sum"])
def test_batch_statistics_span_the_kept_batch(tmp_path, name, options, order):
    """Three rounds (10 of 24 groups with spread), the first 32 kept samples trained: the advantages are the
    estimator's on those samples, not on each round before the filter."""
    trainer = _trainer(tmp_path, _advantage_override(name, options), f"rewards.multi_reward={order}")
    drawn = _scripted(trainer)
    batch = trainer.collector.collect(trainer.policy, 0, {})
    assert len(drawn) == 3 and batch.metrics["samples/rounds"] == 3 and batch.metrics["samples/padded"] == 0
    scores, combined, group_ids, trained, credited = _kept_batch(drawn)
    assert torch.equal(credited.nonzero().flatten(), trained)  # whole groups: the kept batch is what is trained
    assert torch.equal(batch.rollout.group_ids, group_ids[trained])  # kept samples first, in sampling order
    expected = _expected(name, options, order, scores, combined, group_ids, credited)
    torch.testing.assert_close(batch.advantages.double(), expected, rtol=1e-5, atol=1e-6)
    assert batch.metrics["advantage/std"] == pytest.approx(float(expected.std(unbiased=False)), rel=1e-5)

    # Estimated per round and then filtered (the old order), they differ: the rounds' groups without spread count.
    per_round = torch.cat([
        sample_advantages(d["scores"], d["valid"], d["group_ids"], WEIGHTS, trainer.collector.estimator,
                          trainer.config.algorithm.advantage.options, order=order, clip=None).advantages
        for d in drawn])[trained]
    assert (per_round.double() - expected).abs().max() > 0.05


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "grpo_passk"])
def test_group_local_estimators_give_the_per_round_advantages_bit_for_bit(tmp_path, name):
    """A group's advantage reads its own members only, so estimating on the kept batch changes nothing: the same
    bits as the per-round estimate (what the trainer computed before), and grpo's values by hand."""
    trainer = _trainer(tmp_path, name)
    drawn = _scripted(trainer)
    batch = trainer.collector.collect(trainer.policy, 0, {})
    scores, combined, group_ids, trained, credited = _kept_batch(drawn)
    per_round = torch.cat([
        sample_advantages(d["scores"], d["valid"], d["group_ids"], WEIGHTS, advantage_estimators[name], {},
                          order="sum_then_normalize", clip=None).advantages
        for d in drawn])[trained]
    assert torch.equal(batch.advantages.cpu(), per_round)
    if name == "grpo":
        expected = _expected("grpo", {}, "sum_then_normalize", scores, combined, group_ids, credited)
        torch.testing.assert_close(batch.advantages.double(), expected, rtol=1e-5, atol=1e-6)


def test_a_group_split_by_the_cut_keeps_its_whole_group_statistics(tmp_path):
    """A kept group of round 1 lost a member to ``on_nonfinite: skip``: 11 + 16 samples are kept after two rounds,
    and round 3's first kept group (4) plus one member of its second fill the 32. The cut splits that group (1 of
    its 4 trained): its group statistics stay those of its 4 valid members, which also count in the batch
    statistics (batch_std's std here); the invalid sample counts nowhere."""
    trainer = _trainer(tmp_path, "batch_std", "rewards.on_nonfinite=skip")
    drawn = _scripted(trainer, invalid={0: [1]})  # round 0, group 0 (spread): one member invalid
    batch = trainer.collector.collect(trainer.policy, 0, {})
    scores, combined, group_ids, trained, credited = _kept_batch(drawn)
    assert len(trained) == 32 and int(credited.sum()) == 35  # 11 + 16 + 4 + 4: the 3 cut members credited
    split = group_ids[trained[-1]]
    assert int((group_ids[trained] == split).sum()) == 1 and int((group_ids[credited] == split).sum()) == 4
    expected = _expected("batch_std", {}, "sum_then_normalize", scores, combined, group_ids, credited)
    position = {int(row): k for k, row in enumerate(credited.nonzero().flatten())}
    torch.testing.assert_close(batch.advantages.double(), expected[[position[int(r)] for r in trained]],
                               rtol=1e-5, atol=1e-6)
    assert batch.advantages[-1] != 0  # the lone trained member still has its group's baseline


def test_padding_gets_zero_and_is_left_out_of_the_batch_statistics(tmp_path):
    """With one round allowed, 12 samples are kept and 20 pad the batch: the kept samples' advantages are the
    estimator's over the 12 alone (reinforce_pp_baseline's variance would halve-ish with the padding's zeros)."""
    trainer = _trainer(tmp_path, "reinforce_pp_baseline", "rollout.dynamic_sampling.max_rounds=1")
    drawn = _scripted(trainer)
    batch = trainer.collector.collect(trainer.policy, 0, {})
    assert batch.metrics["samples/padded"] == 20
    scores, combined, group_ids, trained, credited = _kept_batch(drawn)
    assert len(trained) == 12
    expected = _expected("reinforce_pp_baseline", {}, "sum_then_normalize", scores, combined, group_ids, credited)
    torch.testing.assert_close(batch.advantages[:12].double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(batch.advantages[12:], torch.zeros(20))
    assert (batch.rollout.mask[12:] == 0).all()


def test_without_dynamic_sampling_every_valid_sample_is_credited(tmp_path):
    """One round, no filter: batch_std over the round's valid samples, groups without spread included (0)."""
    trainer = Trainer(toy_config(
        tmp_path, "rewards.functions=[{name: exact_match}, {name: token_accuracy, weight: 0.5}]",
        "algorithm.advantage=batch_std", "algorithm.advantage_clip=null", "run.max_steps=1"))
    drawn = _scripted(trainer)
    batch = trainer.collector.collect(trainer.policy, 0, {})
    scores, combined, group_ids = drawn[0]["scores"], drawn[0]["scores"] @ WEIGHTS, drawn[0]["group_ids"]
    expected = _expected("batch_std", {}, "sum_then_normalize", scores, combined, group_ids,
                         torch.ones(32, dtype=torch.bool))
    torch.testing.assert_close(batch.advantages.double(), expected, rtol=1e-5, atol=1e-6)


def test_per_action_credit_spans_the_kept_batch_per_column(tmp_path):
    """Per-action rewards (``Plugin.action_rewards``) under dynamic sampling: batch_std per action column, its std
    over the column's active entries of the kept batch (not of each round)."""
    trainer = _trainer(tmp_path, "batch_std")
    drawn = _scripted(trainer)
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def per_action(rollout, rewards):  # columns that differ in scale and shape, on the rollout's width
        columns = torch.arange(1, rollout.num_actions + 1, dtype=torch.float32)
        values = rewards.float().unsqueeze(1) * columns + (columns % 2) * rewards.float().unsqueeze(1) ** 2
        calls.append((values.clone(), rollout.mask.clone().float()))
        return values

    trainer.plugin.action_rewards = per_action
    batch = trainer.collector.collect(trainer.policy, 0, {})
    assert len(calls) == len(drawn) == 3
    _, _, group_ids, trained, credited = _kept_batch(drawn)
    values = torch.cat([v for v, _ in calls])[trained].double()  # [32, A]
    mask = torch.cat([m for _, m in calls])[trained]  # [32, A]
    groups = group_ids[trained]
    assert batch.advantages.shape == mask.shape and 0 < int((mask == 0).sum())  # the toy's samples end early
    expected = torch.zeros_like(values)
    for column in range(values.shape[1]):
        active = (mask[:, column] > 0).nonzero().flatten()
        mean, _ = _group_mean_std(values[:, column], groups, active)
        std = values[active, column].std(unbiased=False)
        expected[active, column] = (values[active, column] - mean[active]) / (std + 1e-4)
    torch.testing.assert_close(batch.advantages.double(), expected, rtol=1e-5, atol=1e-6)


def test_a_plugin_that_credits_actions_in_some_rounds_only_is_refused(tmp_path):
    from mmrl.rollout import RolloutError

    trainer = _trainer(tmp_path, "grpo")
    drawn = _scripted(trainer)
    trainer.plugin.action_rewards = lambda rollout, rewards: (
        rewards.float().unsqueeze(1).expand_as(rollout.mask).clone() if len(drawn) == 1 else None)
    with pytest.raises(RolloutError, match="per-action rewards in some sampling rounds"):
        trainer.collector.collect(trainer.policy, 0, {})


# ------------------------------------------------------------------------------------------- several processes
class _Hub:
    """What the simulated processes share: one slot each and a barrier, for :class:`_ThreadAccelerator`."""

    def __init__(self, processes: int):
        self.slots: list[torch.Tensor | None] = [None] * processes
        self.barrier = threading.Barrier(processes, timeout=20)


class _ThreadAccelerator:
    """One process of W, each a thread: ``gather`` concatenates every process's tensor in process order, as
    accelerate's gather does (the collectives :meth:`Collector.score_round` and :meth:`Collector.credit_kept` use)."""

    device = torch.device("cpu")

    def __init__(self, hub: _Hub, process_index: int):
        self.hub, self.process_index, self.num_processes = hub, process_index, len(hub.slots)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self.hub.barrier.wait()
        self.hub.slots[self.process_index] = tensor.clone()
        self.hub.barrier.wait()
        out = torch.cat(list(self.hub.slots))
        self.hub.barrier.wait()
        return out


W, P_MULTI, N_ROUNDS = 3, 6, 3  # 3 processes, 6 prompts x G = 4 = 24 samples per round (8 per process), 3 rounds
B_MULTI, N_LOCAL = P_MULTI * G, P_MULTI * G // W


def _multi_round_data():
    """Gathered-order inputs of 3 rounds on 3 processes with the ``spread`` layout (process p holds the round's
    samples s = p + 3i, so G = 4 members split 2/1/1 over the processes and every process cuts at other groups):
    scores ``[R, B, 2]``, valid ``[R, B]`` (a few skipped), group ids ``[R, B]`` and per-(process, round) action
    widths, all in gathered order (round r, process p, local sample i at row r·B + p·n + i)."""
    generator = torch.Generator().manual_seed(5)
    scores = torch.randint(0, 3, (N_ROUNDS, B_MULTI, 2), generator=generator).float() / 2
    valid = torch.ones(N_ROUNDS, B_MULTI, dtype=torch.bool)
    group_ids = torch.zeros(N_ROUNDS, B_MULTI, dtype=torch.long)
    for r in range(N_ROUNDS):
        for p in range(W):
            for i in range(N_LOCAL):
                sample = p + W * i  # the spread layout's global sample index
                group_ids[r, p * N_LOCAL + i] = 100 * r + sample // G
        for group in range(P_MULTI):  # every third group of a round without spread
            if (group + r) % 3 == 0:
                members = group_ids[r] == 100 * r + group
                scores[r, members] = scores[r, members][0]
    valid[0, 1] = valid[1, 2 * N_LOCAL + 3] = valid[2, N_LOCAL] = False  # skipped rewards, on different processes
    scores[~valid] = 0.0
    widths = [[3 + (p + r) % 3 for r in range(N_ROUNDS)] for p in range(W)]  # [W][R] per-action widths
    return scores, valid, group_ids, widths


def _run_processes(tmp_path, advantage: str, order: str, per_action: bool, rounds: int = N_ROUNDS):
    """Each simulated process scores its first ``rounds`` rounds (:meth:`Collector.score_round`), selects its 8
    kept samples (``select_kept``) and credits them (:meth:`Collector.credit_kept`); returns the advantages of each
    process's pooled samples and the action masks it sampled, keyed by (process, round)."""
    config = toy_config(tmp_path, "rewards.functions=[{name: exact_match}, {name: token_accuracy, weight: 0.5}]",
                        "rollout.dynamic_sampling.enabled=true", f"algorithm.advantage={advantage}",
                        "algorithm.advantage_clip=null", f"rewards.multi_reward={order}")
    scores, valid, group_ids, widths = _multi_round_data()
    hub = _Hub(W)
    results: dict[int, torch.Tensor] = {}
    masks: dict[tuple[int, int], torch.Tensor] = {}
    errors: list[BaseException] = []

    def process(p: int) -> None:
        try:
            local = slice(p * N_LOCAL, (p + 1) * N_LOCAL)

            def action_rewards(rollout, rewards):  # [n, A_(p, r)]; a shape that differs between columns
                if not per_action:
                    return None
                columns = torch.arange(1, rollout.num_actions + 1, dtype=torch.float32)
                return rewards.float().unsqueeze(1) * columns + (columns % 2) * rewards.float().unsqueeze(1) ** 2

            plugin = SimpleNamespace(action_rewards=action_rewards)
            scorer = SimpleNamespace(weights=WEIGHTS, names=["exact_match", "token_accuracy"])
            geometry = SimpleNamespace(group_size=G, local_samples=N_LOCAL)
            collector = Collector(config, _ThreadAccelerator(hub, p), geometry, plugin, scorer, None, [])
            scored = []
            for r in range(rounds):
                width = widths[p][r]
                mask = torch.ones(N_LOCAL, width)
                mask[::2, width - 1] = 0  # every other sample ends one action early
                masks[(p, r)] = mask
                rollout = Rollout(group_ids=group_ids[r, local].clone(), old_logp=None, mask=mask.clone())
                scored.append(collector.score_round(rollout, scores[r, local], valid[r, local]))
            selection = select_kept(torch.cat([r.keep for r in scored]), N_LOCAL)
            results[p] = collector.credit_kept(scored, selection)[0]
        except Exception as error:  # re-raised by the main thread; the others leave their barrier
            errors.append(error)
            hub.barrier.abort()

    threads = [threading.Thread(target=process, args=(p,)) for p in range(W)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results, masks


def _multi_expected_selection(rounds: int = N_ROUNDS):
    """The test's own kept batch of the 3 processes after ``rounds`` rounds: each process's pooled rows and the
    global rows it trains (fewer than 8 where it pads), and the credited rows."""
    scores, valid, group_ids, _ = _multi_round_data()
    scores, valid, group_ids = scores[:rounds], valid[:rounds], group_ids[:rounds]
    scores, valid, group_ids = scores.reshape(-1, 2), valid.reshape(-1), group_ids.reshape(-1)  # round-major rows
    combined = scores @ WEIGHTS
    keep = torch.zeros_like(valid)
    for group in group_ids.unique():
        members = (group_ids == group) & valid
        keep |= members & (combined[members].max() > combined[members].min())
    trained = {}
    for p in range(W):  # the process's pooled order: round by round, its own rows
        pooled = torch.cat([torch.arange(p * N_LOCAL, (p + 1) * N_LOCAL) + r * B_MULTI for r in range(rounds)])
        trained[p] = pooled, pooled[keep[pooled]][:N_LOCAL]
    all_trained = torch.cat([t for _, t in trained.values()])
    credited = valid & torch.isin(group_ids, group_ids[all_trained])
    return scores, combined, group_ids, trained, credited


@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_several_processes_credit_the_kept_batch_of_all_of_them(tmp_path, rounds):
    """Three processes (threads with a gather in process order), the spread layout with G = 4 split 2/1/1 over them,
    skipped rewards: every process computes batch_std over the same kept batch (every process's trained samples,
    and the cut members of their groups) and reads its own pooled rows, in its sampling order. One round leaves
    every process short (4, 6, 6 kept of 8: padded, 0, out of the statistics); after two every process has enough
    (10, 12, 10) and cuts at other groups; a third round's samples are never trained."""
    results, _ = _run_processes(tmp_path, "batch_std", "sum_then_normalize", per_action=False, rounds=rounds)
    scores, combined, group_ids, trained, credited = _multi_expected_selection(rounds)
    all_trained = torch.cat([t for _, t in trained.values()])
    if rounds == 1:
        assert len(all_trained) == 16 and int(credited.sum()) == 16  # padding: whole groups, nothing cut
    else:
        assert len(all_trained) == W * N_LOCAL and int(credited.sum()) > len(all_trained)  # some groups were split
    rows = credited.nonzero().flatten()
    mean, _ = _group_mean_std(combined.double(), group_ids, rows)
    expected = torch.zeros(len(combined), dtype=torch.float64)
    expected[rows] = (combined.double() - mean)[rows] / (combined[rows].double().std(unbiased=False) + 1e-4)
    for p in range(W):
        pooled, _ = trained[p]
        assert results[p].shape == (rounds * N_LOCAL,)
        torch.testing.assert_close(results[p].double(), expected[pooled], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("order", ["sum_then_normalize", "normalize_then_sum"])
def test_several_processes_credit_per_action_on_the_kept_batch(tmp_path, order):
    """Per-action credit on three processes whose action widths differ per process and round: batch_std per action
    column over the kept batch's active entries (every process's, padded to the widest); each process gets its
    widest round's width. normalize_then_sum: grpo per reward column and action position, then Σ w_k A_k whitened
    (Bessel) over the kept batch's active entries."""
    advantage = "batch_std" if order == "sum_then_normalize" else "grpo"
    results, masks = _run_processes(tmp_path, advantage, order, per_action=True)
    scores, combined, group_ids, trained, credited = _multi_expected_selection()
    _, valid, _, widths = _multi_round_data()
    valid = valid.reshape(-1)
    width = max(max(w) for w in widths)
    mask = torch.zeros(len(combined), width)  # [R·B, A] gathered order
    for (p, r), m in masks.items():
        mask[r * B_MULTI + p * N_LOCAL: r * B_MULTI + (p + 1) * N_LOCAL, :m.shape[1]] = m
    mask = mask * credited.float().unsqueeze(1)
    columns = torch.arange(1, width + 1, dtype=torch.float64)

    def values_of(rewards: torch.Tensor) -> torch.Tensor:  # [R·B] → [R·B, A], the hook's formula
        return rewards.unsqueeze(1) * columns + (columns % 2) * rewards.unsqueeze(1) ** 2

    expected = torch.zeros(len(combined), width, dtype=torch.float64)
    if order == "sum_then_normalize":
        values = values_of(torch.where(valid, combined, 0.0).double())
        for c in range(width):
            active = (mask[:, c] > 0).nonzero().flatten()
            mean, _ = _group_mean_std(values[:, c], group_ids, active)
            expected[active, c] = (values[active, c] - mean[active]) / (values[active, c].std(unbiased=False) + 1e-4)
    else:
        summed = torch.zeros(len(combined), width, dtype=torch.float64)
        for k in range(2):
            values = values_of(scores[:, k].double())
            for c in range(width):
                active = (mask[:, c] > 0).nonzero().flatten()
                mean, std = _group_mean_std(values[:, c], group_ids, active)
                summed[active, c] += float(WEIGHTS[k]) * torch.where(
                    std[active] > 0, (values[active, c] - mean[active]) / (std[active] + 1e-6), 0.0)
        active = mask > 0
        expected[active] = (summed[active] - summed[active].mean()) / (summed[active].std() + 1e-4)
    for p in range(W):
        pooled, _ = trained[p]
        assert results[p].shape == (N_ROUNDS * N_LOCAL, max(widths[p]))
        torch.testing.assert_close(results[p].double(), expected[pooled, :max(widths[p])], rtol=1e-5, atol=1e-5)


def test_the_action_hook_runs_once_per_round_and_what_it_sets_on_the_rollout_is_trained(tmp_path):
    """``Plugin.action_rewards`` under dynamic sampling: once per round with that round's rollout and combined reward,
    then once per reward column on a copy (``normalize_then_sum``); the action weights and metrics it sets on the
    round's rollout (the tree's width pruning does) reach the trained batch with their samples."""
    trainer = _trainer(tmp_path, "grpo", "rewards.multi_reward=normalize_then_sum")
    drawn = _scripted(trainer)
    calls: list[tuple[int, torch.Tensor]] = []

    def per_action(rollout, rewards):
        first = not calls or calls[-1][0] != len(drawn)  # the call with the combined reward, on the round's rollout
        calls.append((len(drawn), rewards.clone()))
        mark = float(len(drawn)) if first else 100.0  # the round (1-based); 100 on the copies
        rollout.action_weights = torch.full_like(rollout.mask, mark)
        rollout.metrics["hook_round"] = mark
        return rewards.float().unsqueeze(1).expand_as(rollout.mask).clone()

    trainer.plugin.action_rewards = per_action
    batch = trainer.collector.collect(trainer.policy, 0, {})
    assert len(drawn) == 3 and [k for k, _ in calls] == [1, 1, 1, 2, 2, 2, 3, 3, 3]  # combined, then 2 columns
    for k, d in enumerate(drawn):
        combined, by_column = calls[3 * k][1], [calls[3 * k + 1 + c][1] for c in range(2)]
        torch.testing.assert_close(combined, d["scores"] @ WEIGHTS)
        for c in range(2):
            torch.testing.assert_close(by_column[c], d["scores"][:, c])
    _, _, _, trained, _ = _kept_batch(drawn)
    rounds = (trained // (GROUPS * G) + 1).float()  # [32] the round each trained sample came from
    assert torch.equal(batch.rollout.action_weights[:, 0], rounds)  # the copies' 100 did not leak
    assert batch.metrics["rollout/hook_round"] == pytest.approx(2.0)  # the mean over the rounds (1, 2, 3)
