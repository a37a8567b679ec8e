"""Aspect-ratio buckets (``plugin.buckets``): each row generated at the bucket nearest its aspect ratio (an editing
row's input image's, as the diffusers editing pipelines size their output by it), a bucketed rollout equal to a run
at that size, the training forward at the rollout's size (ratio 1), and the refusals."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from mmrl.rollout import RolloutError
from tests.flow.checks import assert_ratio_one_for_any_split, perturb_lora, write_image_rows

BUCKETS = [[16, 16], [16, 32], [32, 16]]


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny pipelines plus a tiny FLUX.1 Kontext, Chroma, Sana and LongCat-Image, built once per
    session."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    root = tmp_path_factory.mktemp("flow_buckets")
    return {**pipelines, **{kind: save_tiny_pipeline(kind, root / f"tiny-{kind}")
                            for kind in ("flux_kontext", "chroma", "sana", "longcat_image")}}


def write_prompt_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def bucket_batch(rows, group_size, *, first_seed=100, training=True):
    """A PromptBatch of the plugin's own ``rows`` (their buckets set), each repeated ``group_size`` times."""
    from tests.flow.conftest import prompt_batch

    batch = prompt_batch([row["prompt"] for row in rows], group_size, first_seed=first_seed, training=training)
    batch.rows = [row for row in rows for _ in range(group_size)]
    return batch


# ---------------------------------------------------------------------------------------------- choosing a bucket
def test_the_nearest_bucket_is_by_log_aspect_ratio_and_a_tie_goes_to_the_earlier():
    from mmrl.plugins.flow.buckets import nearest_bucket

    buckets = [(16, 16), (16, 32), (32, 16)]
    assert nearest_bucket(1.9, buckets) == (16, 32)
    assert nearest_bucket(0.6, buckets) == (32, 16)
    assert nearest_bucket(1.3, buckets) == (16, 16)  # log 1.3 = 0.26 is nearer 0 than log 2 = 0.69
    # 1.45 is nearer 1 than 2 as a ratio (0.45 against 0.55) but nearer 2 on a log scale (0.32 against 0.37)
    assert nearest_bucket(1.45, buckets) == (16, 32)
    assert nearest_bucket(1.0, [(32, 32), (16, 16)]) == (32, 32)  # the same ratio: the earlier
    assert nearest_bucket(1.0, [(16, 16), (32, 32)]) == (16, 16)


def test_aspect_ratios_and_input_sizes_by_hand():
    from mmrl.plugins.flow.buckets import condition_size_for, parse_aspect_ratio

    assert parse_aspect_ratio(1.5, "w") == 1.5
    assert parse_aspect_ratio("16:9", "w") == pytest.approx(16 / 9)
    for bad in ("wide", "16:0", "1:2:3", -1, 0, True, float("nan"), None):
        with pytest.raises(ValueError, match=r"^f.jsonl row 3: 'aspect_ratio' must be width / height"):
            parse_aspect_ratio(bad, "f.jsonl row 3")
    assert condition_size_for((16, 32), None, 4) is None  # the generated size
    # 32 x 32's area (1024) at 16 x 32's ratio: 22.6 x 45.3, to multiples of 4 and of 16
    assert condition_size_for((16, 32), (32, 32), 4) == (24, 44)
    assert condition_size_for((16, 32), (32, 32), 16) == (16, 48)
    assert condition_size_for((32, 16), (16, 16), 16) == (16, 16)  # never below one multiple
    height, width = condition_size_for((48, 64), (480, 640), 16)  # the same ratio: the condition size itself
    assert (height, width) == (480, 640)


def test_each_row_takes_the_bucket_of_its_input_image_or_its_aspect_ratio(tmp_path):
    from mmrl.plugins.flow.buckets import assign_buckets
    from mmrl.plugins.flow.config import FlowPluginConfig, load_rows

    edits = write_image_rows(tmp_path / "edits", [("wide", (40, 16)), ("square", (24, 20)), ("tall", (10, 30))])
    rows = load_rows(FlowPluginConfig(model="m", dataset=str(edits)), "train", images="flux_kontext")
    assign_buckets(rows, [tuple(b) for b in BUCKETS], default=(16, 16), aspect_image="first", source="edits")
    assert [row["output_size"] for row in rows] == [[16, 32], [16, 16], [32, 16]]

    # several images: the first's or the last's aspect ratio (Qwen-Image-Edit-Plus sizes its output by the last)
    lines = [json.dumps({"prompt": "two", "image": ["images/0.png", "images/2.png"]}) + "\n"]
    (tmp_path / "edits" / "pair.jsonl").write_text("".join(lines))
    for which, expected in (("first", [16, 32]), ("last", [32, 16])):
        pair = load_rows(FlowPluginConfig(model="m", dataset=str(tmp_path / "edits" / "pair.jsonl")), "train",
                         images="qwen_image_edit", max_images=None)
        assign_buckets(pair, [tuple(b) for b in BUCKETS], default=(16, 16), aspect_image=which, source="pair")
        assert pair[0]["output_size"] == expected

    prompts = [{"prompt": "a", "aspect_ratio": "2:1"}, {"prompt": "b", "aspect_ratio": 0.5}, {"prompt": "c"}]
    assign_buckets(prompts, [tuple(b) for b in BUCKETS], default=(32, 16), aspect_image=None, source="p")
    assert [row["output_size"] for row in prompts] == [[16, 32], [32, 16], [32, 16]]  # c: the run's 32 x 16

    with pytest.raises(ValueError, match=r"^p row 1 has an 'output_size' key, which the flow plugin sets"):
        assign_buckets(prompts, [(16, 16)], default=(16, 16), aspect_image=None, source="p")
    rows = load_rows(FlowPluginConfig(model="m", dataset=str(edits)), "train", images="flux_kontext")
    rows[1]["aspect_ratio"] = 2
    with pytest.raises(ValueError, match=r"^edits row 2: 'aspect_ratio' is for text-to-image rows"):
        assign_buckets(rows, [(16, 16)], default=(16, 16), aspect_image="first", source="edits")


# ---------------------------------------------------------------------------------------------- config refusals
@pytest.mark.parametrize(("options", "key", "allowed"), [
    ({"buckets": []}, "buckets", "null or a non-empty list of [height, width] sizes"),
    ({"buckets": [[16, 16], [16]]}, "buckets", "null or a non-empty list of [height, width] sizes"),
    ({"buckets": [[16, 16], [16, 0]]}, "buckets", "null or a non-empty list of [height, width] sizes"),
    ({"buckets": [[16, 16], [16, 16]]}, "buckets", "distinct [height, width] sizes"),
    ({"eval_buckets": [[16, 16]]}, "eval_buckets", "null without plugin.buckets"),
    ({"buckets": [[16, 16]], "eval_height": 32}, "eval_height", "null with plugin.buckets"),
])
def test_malformed_buckets_are_refused_in_one_line(options, key, allowed):
    from mmrl.config import ConfigError, from_dict
    from mmrl.plugins.flow.config import FlowPluginConfig

    pattern = rf"^config key 'plugin.{key}': got .*; allowed: {re.escape(allowed)}[^\n]*$"
    with pytest.raises(ConfigError, match=pattern):
        from_dict(FlowPluginConfig, {"model": "m", "prompts": ["a"], **options}, "plugin")


def test_a_bucket_off_the_adapter_grid_is_refused(make_plugin):
    from mmrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"^config key 'plugin.buckets': got .*; allowed: \[height, width\] sizes of "
                                          r"multiples of 4 for [^\n]*; \[16, 18\] is not$"):
        make_plugin("flux", buckets=[[16, 16], [16, 18]])


# ---------------------------------------------------------------------------------------------- rollouts
@pytest.mark.parametrize("kind", ["flux", "sd3", "chroma", "sana", "longcat_image"])
def test_a_bucketed_rollout_is_a_run_at_its_size_and_the_forward_follows_it(make_plugin, tmp_path, kind):
    # Sana's sides are multiples of 32 (SanaPipeline.check_inputs): its buckets and run are twice the others'.
    # LongCat-Image takes its pipeline's fixed 512 text tokens only.
    s = 2 if kind == "sana" else 1
    text = {"max_sequence_length": 512} if kind == "longcat_image" else {}
    prompts = write_prompt_rows(tmp_path / "prompts.jsonl", [
        {"prompt": "a cat", "aspect_ratio": "2:1"}, {"prompt": "a red dog"}, {"prompt": "a car", "aspect_ratio": 2}])
    plugin = make_plugin(kind, prompts=None, dataset=str(prompts), resolution=16 * s,
                         buckets=[[16 * s * h, 16 * s * w] for h, w in ((1, 1), (1, 2), (2, 1))], **text)
    perturb_lora(plugin)
    rows = plugin.dataset("train")
    side, wide_size = 16 * s, (16 * s, 32 * s)
    assert plugin.row_buckets("train") == [f"{side}x{2 * side}", f"{side}x{side}", f"{side}x{2 * side}"]
    wide = plugin.rollout(plugin.policy(), bucket_batch([rows[0], rows[2]], 3)).validate()
    assert wide.payload["images"].shape == (6, 3, *wide_size)
    assert wide.replay["output_size"].tolist() == [list(wide_size)] * 6
    assert plugin.adapter.size == (side, side)  # back at the run's size
    square = plugin.rollout(plugin.policy(), bucket_batch([rows[1]], 2, first_seed=7)).validate()
    assert square.payload["images"].shape == (2, 3, side, side)

    fixed = make_plugin(kind, height=wide_size[0], width=wide_size[1], **text)  # the same weights, every row wide
    perturb_lora(fixed)
    expected = fixed.rollout(fixed.policy(), bucket_batch([rows[0], rows[2]], 3))
    torch.testing.assert_close(wide.payload["images"], expected.payload["images"], rtol=0, atol=1e-6)
    torch.testing.assert_close(wide.old_logp, expected.old_logp, rtol=0, atol=1e-5)
    # the forward runs at the rollout's size whatever the adapter was left at (a 16 x 16 rollout came between)
    assert_ratio_one_for_any_split(plugin, wide)

    mixed = re.escape(f"[({side}, {side}), {wide_size}]")
    with pytest.raises(RolloutError, match=rf"^a batch mixes the output sizes {mixed} of plugin"):
        plugin.rollout(plugin.policy(), bucket_batch(rows, 1))


def test_an_aspect_ratio_without_buckets_is_refused(make_plugin, tmp_path):
    prompts = write_prompt_rows(tmp_path / "prompts.jsonl", [{"prompt": "a cat"}, {"prompt": "a dog",
                                                                                   "aspect_ratio": "2:1"}])
    with pytest.raises(ValueError, match=r"prompts.jsonl row 2 names an 'aspect_ratio', which only plugin.buckets "
                                         r"reads [^\n]*: set plugin.buckets$"):
        make_plugin("flux", prompts=None, dataset=str(prompts))


def test_evaluation_rows_take_the_evaluation_buckets(make_plugin, tmp_path):
    prompts = write_prompt_rows(tmp_path / "prompts.jsonl", [{"prompt": "a cat", "aspect_ratio": "1:2"}])
    plugin = make_plugin("flux", prompts=None, eval_prompts=None, dataset=str(prompts), eval_dataset=str(prompts),
                         buckets=BUCKETS, eval_buckets=[[16, 16], [32, 24]], eval_num_steps=3)
    assert plugin.row_buckets("train") == ["32x16"]
    assert plugin.row_buckets("eval") == ["32x24"]  # the same file's row, nearest among eval_buckets
    evaluation = plugin.rollout(plugin.policy(), bucket_batch(plugin.dataset("eval"), 2, training=False)).validate()
    assert evaluation.payload["images"].shape == (2, 3, 32, 24)
    assert make_plugin("flux").row_buckets("train") is None


def test_an_edit_takes_its_input_images_bucket_and_its_inputs_follow(make_plugin, tmp_path):
    edits = write_image_rows(tmp_path, [("make it red", (40, 20)), ("add a dog", (20, 40))])
    plugin = make_plugin("flux_kontext", dataset=str(edits), prompts=None, eval_prompts=None, buckets=BUCKETS)
    rows = plugin.dataset("train")
    assert plugin.row_buckets("train") == ["16x32", "32x16"]
    rollout = plugin.rollout(plugin.policy(), bucket_batch(rows[:1], 2)).validate()
    assert rollout.payload["images"].shape == rollout.payload["condition_images"].shape == (2, 3, 16, 32)
    fixed = make_plugin("flux_kontext", dataset=str(edits), prompts=None, eval_prompts=None, height=16, width=32)
    expected = fixed.rollout(fixed.policy(), bucket_batch(fixed.dataset("train")[:1], 2))
    torch.testing.assert_close(rollout.payload["images"], expected.payload["images"], rtol=0, atol=1e-6)
    torch.testing.assert_close(rollout.payload["condition_images"], expected.payload["condition_images"], rtol=0,
                               atol=0)
    assert_ratio_one_for_any_split(plugin, plugin.rollout(plugin.policy(), bucket_batch(rows[1:], 6)),
                                   splits=([0, 1, 2, 3, 4, 5], [3]))

    # plugin.condition_size is then the inputs' area, at each bucket's aspect ratio: 32 x 32 → 24 x 44 at 16 x 32
    sized = make_plugin("flux_kontext", dataset=str(edits), prompts=None, eval_prompts=None, buckets=BUCKETS,
                        condition_size=[32, 32])
    tall = sized.rollout(sized.policy(), bucket_batch(sized.dataset("train")[:1], 2)).validate()
    assert tall.payload["condition_images"].shape == (2, 3, 24, 44)
    fixed = make_plugin("flux_kontext", dataset=str(edits), prompts=None, eval_prompts=None, height=16, width=32,
                        condition_size=[24, 44])
    expected = fixed.rollout(fixed.policy(), bucket_batch(fixed.dataset("train")[:1], 2))
    torch.testing.assert_close(tall.payload["images"], expected.payload["images"], rtol=0, atol=1e-6)
    assert math.isclose(24 * 44, 32 * 32, rel_tol=0.04)


# ---------------------------------------------------------------------------------------------- a whole run
def test_a_bucketed_run_draws_each_step_from_one_bucket_and_evaluates_each(train_config, tmp_path):
    from mmrl.trainer import Trainer
    from tests.flow.checks import train_two_steps

    prompts = write_prompt_rows(tmp_path / "prompts.jsonl", [
        {"prompt": "a cat", "aspect_ratio": "2:1"}, {"prompt": "a red dog"}, {"prompt": "a car", "aspect_ratio": 2.2},
        {"prompt": "a blue bird", "aspect_ratio": 1.1}])
    trainer = Trainer(train_config("flux", tmp_path / "run", prompts=None, eval_prompts=None, dataset=str(prompts),
                                   eval_dataset=str(prompts), buckets=BUCKETS))
    drawn = []
    rollout = trainer.plugin.rollout

    def recording(policy, batch):
        drawn.append((batch.training, {tuple(row["output_size"]) for row in batch.rows}))
        return rollout(policy, batch)

    trainer.plugin.rollout = recording
    train_two_steps(trainer)  # ratio 1 at each step's start, only the LoRA moves
    training = [sizes for is_training, sizes in drawn if is_training]
    assert len(training) == 2 and all(len(sizes) == 1 for sizes in training)
    assert {size for sizes in training for size in sizes} <= {(16, 16), (16, 32)}
    evaluated = {size for is_training, sizes in drawn if not is_training for size in sizes}
    assert evaluated == {(16, 16), (16, 32)}
    folder = tmp_path / "run" / "samples" / "step_000002"
    assert sorted(path.name for path in folder.glob("eval_*.png")) == ["eval_16x16.png", "eval_16x32.png"]
