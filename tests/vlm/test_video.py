"""Video inputs in the VLM plugin (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): rows with videos given as their frames, alone
and beside an image, against a plain transformers forward of the chat written by hand; the decode loop samples the
distribution the training pass scores (the M-RoPE continuation after a video); ``decoder: hf`` refuses the prompts
where ``generate`` would not; the feature cache; rows, JSONL records and their errors; GRPO steps through the
trainer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mmrl.config import load_config
from mmrl.plugins.vlm import data as vlm_data
from mmrl.plugins.vlm.plugin import row_video_fps, row_videos
from mmrl.trainer import Trainer
from mmrl.trainer.learn import old_policy_pass
from tests.vlm.conftest import assert_old_logp_is_a_plain_forward, make_plugin, plugin_options, prompt_batch
from tests.vlm.test_decode import assert_decode_scores_are_teacher_forced

ALL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe")
VIDEO_BOUNDS = {"video_min_pixels": 4 * 28 * 28, "video_max_pixels": 12 * 28 * 28}
VIDEO_PART = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE_PART = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def video_models(tiny_models, tmp_path_factory):
    from mmrl.plugins.vlm.adapters import vlm_adapters
    from mmrl.plugins.vlm.testing import build_tiny_model

    models = dict(tiny_models)
    for family in ("qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe"):
        if family in vlm_adapters:
            models[family] = build_tiny_model(family, tmp_path_factory.mktemp(family) / family)
    return models


def _model(video_models, family):
    if family not in video_models:
        pytest.skip(f"transformers has no {family}")
    return video_models[family]


def frames(count, height, width, seed):
    """``count`` random RGB frames of one size (PIL)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8")) for _ in range(count)]


def video_rows(factor):
    """Three prompts: an 8-frame video, a 5-frame video of another shape at another rate after an image, and two
    videos. Frame sides are multiples of the family's factor (patch × merge) within VIDEO_BOUNDS, so the adapter keeps
    their size and the hand-written forward can feed the same frames."""
    from PIL import Image

    image = Image.fromarray((np.random.default_rng(9).random((2 * factor, 2 * factor, 3)) * 255).astype("uint8"))
    return [
        {"prompt": "Which way does it move?", "video": frames(8, 2 * factor, 3 * factor, 0), "video_fps": 2.0,
         "solution": "left", "task": "motion"},
        {"prompt": "What changes?", "image": [image], "video": [frames(5, 3 * factor, 2 * factor, 1)],
         "video_fps": [4.0], "solution": "up", "task": "motion"},
        {"prompt": "Compare the clips.", "video": [frames(2, 2 * factor, 2 * factor, 2), frames(4, 2 * factor,
                                                                                             2 * factor, 3)],
         "solution": "same", "task": "motion"},
    ]


def _plugin(path, **overrides):
    return make_plugin(path, **{**VIDEO_BOUNDS, "max_new_tokens": 8, **overrides})


@pytest.mark.parametrize("family", ALL_FAMILIES)
@pytest.mark.parametrize("position", ["before", "after"])
def test_video_log_probs_equal_a_plain_transformers_forward(video_models, family, position):
    """Each sample's old log-probs (feature cache, shared prompt forward, collation of mixed prompts) equal a plain
    transformers forward of its chat written by hand, through the processor called directly on the same frames."""
    plugin = _plugin(_model(video_models, family), image_position=position)
    factor = plugin.adapter.image_factor
    rows = video_rows(factor)
    group = 2
    rollout = old_policy_pass(plugin, plugin.policy(),
                              plugin.rollout(plugin.policy(), prompt_batch(rows, group, seed=3))).validate()
    replay = rollout.replay
    assert "video_grid_thw" in replay and ("video_embeds" in replay) == plugin.cache_features
    if family == "qwen2_5_vl":  # seconds per temporal patch of 2 frames at the row's rate
        assert [t.tolist() for t in replay["second_per_grid_ts"][::group]] == [[1.0], [0.5], [1.0, 1.0]]
    assert rollout.metrics["video_tokens"] > 0

    def processor_inputs(row):
        clips = row_videos(row)
        rates = row_video_fps(row, len(clips), plugin.config.video_fps)
        vision = IMAGE_PART * len(row.get("image", [])) + VIDEO_PART * len(clips)
        question = plugin.question(row)
        user = vision + question if position == "before" else question + vision
        text = f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        metadata = [{"fps": rate, "total_num_frames": len(clip), "frames_indices": list(range(len(clip)))}
                    for clip, rate in zip(clips, rates, strict=True)]
        assert [clip[0].size for clip in plugin.adapter.load_videos(clips)] == [clip[0].size for clip in clips]
        return plugin.adapter.processor(text=[text], images=row.get("image") or None, videos=clips,
                                        video_metadata=metadata, do_sample_frames=False, do_resize=False,
                                        return_tensors="pt")

    assert_old_logp_is_a_plain_forward(plugin, rollout, rows, group, processor_inputs)
    part = rollout.select([5, 0, 3])
    with torch.no_grad():
        output = plugin.forward(plugin.policy(), part, need_reference=True)
    assert float((output.logp - part.old_logp).abs().max()) < 1e-5  # ratio 1 on a reordered subset


def _positions(plugin, prompts):
    inputs, _ = plugin.adapter.collate(prompts)
    positions = plugin.adapter.rope_positions(plugin.model, inputs)  # [3, n, P]
    largest = positions.masked_fill(inputs["attention_mask"][None] == 0, -1).amax(dim=(0, 2))
    return largest, positions[:, :, -1].amax(dim=0)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_decoding_samples_the_distribution_the_training_pass_scores(video_models, family):
    """Each decode step's scores give the sampled token the log-prob of the teacher-forced pass. For Qwen2.5-VL the
    8-frame video's temporal positions run past the prompt's last token (transformers 5.x restarts the text after a
    video below them): decoding from the largest position, as ``generate`` does, would fail this."""
    plugin = _plugin(_model(video_models, family), image_position="after")
    rows = video_rows(plugin.adapter.image_factor)
    groups = torch.tensor([0, 1, 2, 0, 1, 2])
    model = plugin.model if plugin.cache_features else None
    prompts = plugin.encode_rows([rows[g] for g in groups.tolist()], groups, model=model)
    largest, last = _positions(plugin, prompts)
    if family == "qwen2_5_vl":
        assert bool((largest > last).any())  # the case the continuation from the last token is for
    assert_decode_scores_are_teacher_forced(plugin, prompts, plugin.generation_config(True))


def test_hf_decoder_refuses_videos_past_the_last_position_and_matches_otherwise(video_models):
    """``decoder: hf`` continues from the largest position (rope_deltas): refused for the Qwen2.5-VL video prompt
    where that is past the last token; for Qwen2-VL's prompts (largest = last) it draws the plugin loop's tokens."""
    plugin = _plugin(video_models["qwen2_5_vl"], image_position="after")
    rows = video_rows(plugin.adapter.image_factor)
    prompts = plugin.encode_rows(rows[:1], model=plugin.model)
    with pytest.raises(ValueError, match="decoder 'hf'.*use decoder 'mmrl'"):
        plugin.adapter.generate(plugin.model, prompts, plugin.generation_config(True), decoder="hf")

    plugin = _plugin(video_models["qwen2_vl"], image_position="after")
    rows = video_rows(plugin.adapter.image_factor)
    groups = torch.tensor([0, 1, 2, 0])
    prompts = plugin.encode_rows([rows[g] for g in groups.tolist()], groups, model=plugin.model)
    largest, last = _positions(plugin, prompts)
    assert torch.equal(largest, last)
    config = plugin.generation_config(True)
    sequences = []
    for decoder in ("mmrl", "hf"):
        torch.manual_seed(11)
        with torch.no_grad():
            tokens, width = plugin.adapter.generate(plugin.model, prompts, config, share_prefill=False,
                                                    decoder=decoder)
        sequences.append(tokens[:, width:])
    torch.testing.assert_close(sequences[0], sequences[1], rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_feature_cache_changes_nothing_for_videos(video_models, family):
    """With the frozen tower's video features cached, the replay holds ``video_embeds`` (and Qwen3-VL's
    ``video_deepstack``) instead of pixel rows and the log-probs are those of the pixel path."""
    path = _model(video_models, family)
    cached, plain = _plugin(path), _plugin(path, cache_image_features=False)
    rows = video_rows(cached.adapter.image_factor)
    batch = prompt_batch(rows, 2, seed=1)
    rollout = old_policy_pass(cached, cached.policy(), cached.rollout(cached.policy(), batch))
    assert "video_embeds" in rollout.replay and "pixel_values_videos" not in rollout.replay
    assert ("video_deepstack" in rollout.replay) == (family == "qwen3_vl")
    prompts = plain.encode_rows(batch.rows, batch.group_ids)
    assert "pixel_values_videos" in prompts[0] and "video_embeds" not in prompts[0]
    with torch.no_grad():
        logp, _ = plain.token_logp(plain.policy(), prompts, rollout.replay["completion_ids"], rollout.num_actions,
                                   with_entropy=False)
    torch.testing.assert_close(logp * rollout.mask, rollout.old_logp * rollout.mask, rtol=0, atol=1e-5)


def test_row_videos_and_frame_rates_are_read_and_checked():
    a, b = ["f0.png", "f1.png"], ["g0.png"]
    assert row_videos({}) == [] and row_videos({"video": a}) == [a] and row_videos({"video": [a, b]}) == [a, b]
    with pytest.raises(ValueError, match="mixes frames and lists of frames"):
        row_videos({"video": [a, "f2.png"]})
    with pytest.raises(ValueError, match="list of frames"):
        row_videos({"video": "clip.mp4"})
    assert row_video_fps({}, 2, 2.0) == [2.0, 2.0] and row_video_fps({"video_fps": [1, 3]}, 2, 2.0) == [1.0, 3.0]
    for bad in (0, -1.0, [1.0], "2", True, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="'video_fps' must be a positive number or one per video"):
            row_video_fps({"video_fps": bad}, 2, 2.0)


def test_frames_of_one_video_must_share_a_size(video_models):
    plugin = _plugin(video_models["qwen2_5_vl"])
    with pytest.raises(ValueError, match="video 0 of the prompt has frames of different sizes"):
        plugin.adapter.load_videos([frames(1, 56, 56, 0) + frames(1, 56, 84, 1)])
    with pytest.raises(ValueError, match="video 0 of the prompt has no frames"):
        plugin.adapter.load_videos([[]])
    resized = plugin.adapter.load_videos([frames(3, 100, 300, 0)])[0]  # 30,000 pixels > 12·28²: scaled down
    width, height = resized[0].size
    assert width % 28 == height % 28 == 0 and width * height <= VIDEO_BOUNDS["video_max_pixels"]
    assert len({frame.size for frame in resized}) == 1


@pytest.mark.parametrize(("count", "total"), [(3, None), (40, 20 * 28 * 28), (9, 30 * 28 * 28), (4, 1.0)])
def test_frame_size_follows_qwen_vl_utils_with_its_total_pixel_budget(video_models, count, total):
    """Each video's frame size is qwen-vl-utils' ``fetch_video`` size for the same frames and bounds, its total-pixel
    budget included: the default (no cap for short videos), one that shrinks the frames of a long video, an odd
    frame count (qwen-vl-utils counts the repeated last frame), and a budget below the floor of 1.05 × min.

    qwen-vl-utils 0.0.14 resizes a list of frames twice (each frame as an image within the video bounds, then the
    video within its budget) and a video file once; its first resize of a frame list even rounds to multiples of 56
    (``fetch_video`` passes ``image_factor`` where ``fetch_image`` expects the patch size). The frames here are a
    size that first resize keeps (56 × 112: multiples of 56 within the bounds), so both of its paths give one
    answer, the one mmrl computes from the frames it is given (a video file's frames, extracted at their size)."""
    vision_process = pytest.importorskip("qwen_vl_utils.vision_process")
    plugin = _plugin(video_models["qwen2_5_vl"], video_total_pixels=total)
    clip = frames(count, 56, 112, 4)
    ours = plugin.adapter.load_videos([clip])[0]
    element = {"video": clip, "min_pixels": VIDEO_BOUNDS["video_min_pixels"],
               "max_pixels": VIDEO_BOUNDS["video_max_pixels"], **({} if total is None else {"total_pixels": total})}
    theirs = vision_process.fetch_video(element, image_patch_size=14)  # [frames, 3, H, W]
    assert ours[0].size == (theirs.shape[3], theirs.shape[2])
    if total is not None and total > 1:  # the budget binds
        assert ours[0].size[0] * ours[0].size[1] < VIDEO_BOUNDS["video_max_pixels"]


def test_jsonl_records_with_videos(tmp_path):
    for k, frame in enumerate(frames(3, 28, 28, 0)):
        frame.save(tmp_path / f"f{k}.png")
    lines = [
        {"video": ["f0.png", "f1.png", "f2.png"], "video_fps": 1, "problem": "Where?", "solution": "left",
         "task": "motion"},
        {"image": "f0.png", "video": [["f1.png"], ["f2.png", "f0.png"]], "problem": "Which?", "solution": "B",
         "task": "choice"},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows = vlm_data.load_jsonl(path)
    assert rows[0]["image"] == [] and rows[0]["video"] == [[str(tmp_path / f"f{k}.png") for k in range(3)]]
    assert rows[0]["video_fps"] == 1 and "image_size" not in rows[0]
    assert rows[1]["image"] == [str(tmp_path / "f0.png")] and rows[1]["image_size"] == [28, 28]
    assert [len(clip) for clip in rows[1]["video"]] == [1, 2]
    assert vlm_data.attach_sizes(rows[:1], lambda size: size)[0].get("resized_size") is None
    bad = {
        "missing key 'image'": {"problem": "q", "solution": 1, "task": "t"},
        "'video' must be a list of frame paths or a list of such lists": {"video": "clip.mp4", "problem": "q",
                                                                           "solution": 1, "task": "t"},
        "each video must be a non-empty list of frame paths": {"video": [["f0.png"], []], "problem": "q",
                                                               "solution": 1, "task": "t"},
        "'video_fps' must be a positive number or one per video": {"video": ["f0.png"], "video_fps": [1, 2],
                                                                   "problem": "q", "solution": 1, "task": "t"},
        "video frame .*nope.png does not exist": {"video": ["nope.png"], "problem": "q", "solution": 1, "task": "t"},
        "'video_fps' without 'video'": {"image": "f0.png", "video_fps": 2, "problem": "q", "solution": 1,
                                        "task": "t"},
    }
    for message, record in bad.items():
        with pytest.raises(vlm_data.DataError, match=f"line 1: {message}"):
            path.write_text(json.dumps(record) + "\n")
            vlm_data.load_jsonl(path)


def test_grpo_steps_on_video_rows(tmp_path, tiny_models):
    """Two GRPO steps of LoRA on video prompts (a JSONL of frame paths, the question after the video) through the
    trainer: ratio 1 on the first inner step, the LoRA weights move, the base model does not, samples name frames."""
    from tests.vlm.test_training import _snapshot  # also registers the test_completion_digits reward

    path = _write_clip_rows(tmp_path, 3)
    options = plugin_options(tiny_models["qwen2_5_vl"], **VIDEO_BOUNDS, image_position="after",
                             data={"train": str(path), "eval": str(path)})
    config = load_config({
        "plugin": {"name": "vlm", **options},
        "run": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "seed": 0, "progress": False, "cpu": True},
        "rollout": {"prompts_per_step": 3, "group_size": 2},
        "algorithm": {"micro_batch_size": 4, "kl_coef": 0.04},
        "optim": {"lr": 5.0e-2},
        "rewards": {"functions": [{"name": "test_completion_digits"}, {"name": "format"}]},
        "eval": {"at_start": False, "num_prompts": 2},
    })
    trainer = Trainer(config)
    model = trainer.plugin.model
    before = _snapshot(model)
    result = trainer.train()
    assert [record["step"] for record in result.history] == [1, 2]
    assert all(record["loss/first_step_ratio_deviation"] < 1e-5 for record in result.history)
    assert any(key.endswith("video_tokens") and value > 0 for key, value in result.history[0].items())
    after = _snapshot(model)
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert changed and all("lora_" in name for name in changed)
    samples = [json.loads(line) for line in next((tmp_path / "run" / "samples").rglob("eval.jsonl")).open()]
    assert samples[0]["video"][0][0].endswith(".png") and samples[0]["image"] == []


def test_frame_sampling_follows_qwen_vl_utils():
    """The kept frames are qwen-vl-utils' (``smart_nframes`` and the readers' rounded linspace), for its defaults
    and Video-R1's 16-frame cap."""
    qwen_vl_utils = pytest.importorskip("qwen_vl_utils.vision_process")
    for total in (8, 9, 30, 61, 240, 1000):
        for video_fps in (24.0, 29.97, 5.0):
            for fps, low, high in ((2.0, 4, 16), (1.0, 4, 768), (4.0, 2, 8)):
                ele = {"fps": fps, "min_frames": low, "max_frames": high}
                count = qwen_vl_utils.smart_nframes(ele, total_frames=total, video_fps=video_fps)
                expected = torch.linspace(0, total - 1, count).round().long().tolist()
                assert vlm_data.sample_frame_indices(total, video_fps, fps=fps, min_frames=low,
                                                     max_frames=high) == expected, (total, video_fps, fps)
    with pytest.raises(ValueError, match="cannot sample frames from a video of 1 frames"):
        vlm_data.sample_frame_indices(1, 24.0)


def test_frames_command_extracts_a_video_files_frames(tmp_path):
    """``python -m mmrl.plugins.vlm.data frames``: a 3-second 10 fps video of a grey level rising per frame becomes
    6 frames (2 per second) at the levels of the frames qwen-vl-utils' indices pick, with video_fps 2."""
    av = pytest.importorskip("av")
    path = tmp_path / "clip.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for k in range(30):
            level = np.full((48, 64, 3), 8 * k, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(level, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    (tmp_path / "videos.jsonl").write_text(json.dumps({"video": "clip.mp4", "problem": "Brighter or darker?",
                                                       "solution": "brighter", "task": "video"}) + "\n")
    assert vlm_data.main(["frames", str(tmp_path / "videos.jsonl"), str(tmp_path / "rows.jsonl"),
                          "--frames-dir", str(tmp_path / "frames"), "--video-root", str(tmp_path)]) == 0
    (row,) = vlm_data.load_jsonl(tmp_path / "rows.jsonl")
    (clip,) = row["video"]
    assert row["video_fps"] == pytest.approx(2.0) and len(clip) == 6
    from PIL import Image

    levels = [float(np.asarray(Image.open(frame)).mean()) for frame in clip]
    expected = [8 * k for k in vlm_data.sample_frame_indices(30, 10.0)]
    assert np.allclose(levels, expected, atol=4.0), (levels, expected)


def _write_clip_rows(directory, count, *, with_image_rows=0):
    """JSONL rows of 4-frame clips (frame files) and, optionally, image-only rows."""
    rows = []
    for k in range(count):
        names = []
        for j, frame in enumerate(frames(4, 56, 56 + 28 * (k % 2), k)):
            names.append(f"clip{k}_{j}.png")
            frame.save(directory / names[-1])
        rows.append({"video": names, "video_fps": 2, "problem": f"Which way does clip {k} move?",
                     "solution": "left", "task": "motion"})
    for k in range(with_image_rows):
        frames(1, 84, 56, 100 + k)[0].save(directory / f"image{k}.png")
        rows.append({"image": f"image{k}.png", "problem": f"What is in image {k}?", "solution": "a square",
                     "task": "motion"})
    (directory / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return directory / "train.jsonl"


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_rollouts_of_image_rows_and_of_video_rows_concatenate(tmp_path, tiny_models, family):
    """In a dataset mixing video and image rows every prompt carries the video entries (empty without a video), so
    a rollout that drew only image rows concatenates with one that drew videos, and a micro-batch mixing them
    recomputes the old log-probs (ratio 1)."""
    from mmrl.rollout import Rollout

    path = _write_clip_rows(tmp_path, 2, with_image_rows=2)
    plugin = _plugin(tiny_models[family], data={"train": str(path), "eval": str(path)})
    rows = plugin.dataset("train")
    assert plugin.video_rows and [bool(row.get("video")) for row in rows] == [True, True, False, False]
    images_only = plugin.rollout(plugin.policy(), prompt_batch(rows[2:], 2, seed=0))
    videos = plugin.rollout(plugin.policy(), prompt_batch(rows[:2], 2, seed=1))
    assert set(images_only.replay) == set(videos.replay)
    assert all(grid.shape == (0, 3) for grid in images_only.replay["video_grid_thw"])
    assert ("second_per_grid_ts" in videos.replay) == (family == "qwen2_5_vl")
    pooled = old_policy_pass(plugin, plugin.policy(), Rollout.concat([images_only, videos]))
    part = pooled.select([6, 1, 4, 3])
    with torch.no_grad():
        output = plugin.forward(plugin.policy(), part, need_reference=False)
    assert float((output.logp - part.old_logp).abs().max()) < 1e-5
    assert pooled.metrics["video_tokens"] == pytest.approx(videos.metrics["video_tokens"] / 2)


def test_temporal_contrast_samples_each_video_prompt_on_shuffled_frames(video_models, monkeypatch):
    """plugin.temporal_contrast = 2 (T-GRPO's contrast group): every sample of a video prompt's group carries its
    group's two completions of the prompt with the frames permuted (a permutation of the same frames, one per
    video); a prompt without a video carries none; the same seeds give the same permutations and texts; an
    evaluation rollout carries empty lists; the main rollout is unchanged."""
    from PIL import Image

    path = video_models["qwen2_5_vl"]
    plugin = _plugin(path, temporal_contrast=2)
    rows = video_rows(plugin.adapter.image_factor)
    image_row = {"prompt": "What is it?", "image": [Image.new("RGB", (56, 56), (200, 10, 10))], "solution": "red",
                 "task": "motion"}
    rows = [rows[0], image_row, rows[2]]
    encoded = []
    encode_rows = plugin.encode_rows

    def recorded(batch_rows, group_ids=None, **kwargs):
        encoded.append(list(batch_rows))
        return encode_rows(batch_rows, group_ids, **kwargs)

    monkeypatch.setattr(plugin, "encode_rows", recorded)
    batch = prompt_batch(rows, 2, seed=5)
    rollout = plugin.rollout(plugin.policy(), batch)
    lists = rollout.payload["shuffled_completions"]
    assert [len(texts) for texts in lists] == [2, 2, 0, 0, 2, 2]
    assert lists[0] == lists[1] and lists[4] == lists[5] and all(isinstance(t, str) for t in lists[0])
    main, contrast = encoded  # the rollout's prompts, then the contrast group's: the two video rows, twice each
    assert [len(batch_rows) for batch_rows in encoded] == [6, 4]
    for shuffled, original in ((contrast[0], rows[0]), (contrast[2], rows[2])):
        for permuted, clip in zip(row_videos(shuffled), row_videos(original), strict=True):
            assert sorted(map(id, permuted)) == sorted(map(id, clip))  # the same frames
        assert shuffled["prompt"] == original["prompt"]
    assert [id(f) for f in row_videos(contrast[0])[0]] != [id(f) for f in row_videos(rows[0])[0]]  # 8 frames: moved
    again = plugin.rollout(plugin.policy(), prompt_batch(rows, 2, seed=5))
    assert again.payload["shuffled_completions"] == lists
    assert [[id(f) for f in clip] for clip in row_videos(encoded[-1][0])] == \
        [[id(f) for f in clip] for clip in row_videos(contrast[0])]
    plain = _plugin(path)
    unchanged = plain.rollout(plain.policy(), prompt_batch(rows, 2, seed=5))
    assert unchanged.payload["completions"] == rollout.payload["completions"]
    evaluation = plugin.rollout(plugin.policy(), prompt_batch(rows, 2, seed=5, training=False))
    assert evaluation.payload["shuffled_completions"] == [[]] * 6


def test_t_grpo_runs_through_the_trainer(tmp_path, tiny_models):
    """Two GRPO steps with plugin.temporal_contrast and the temporal_contrast reward over exact_match: the rewards
    score both groups, the step trains at ratio 1."""
    path = _write_clip_rows(tmp_path, 3)
    options = plugin_options(tiny_models["qwen2_5_vl"], **VIDEO_BOUNDS, temporal_contrast=2,
                             data={"train": str(path), "eval": str(path)})
    config = load_config({
        "plugin": {"name": "vlm", **options},
        "run": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "seed": 0, "progress": False, "cpu": True},
        "rollout": {"prompts_per_step": 3, "group_size": 4},
        "algorithm": {"micro_batch_size": 6},
        "rewards": {"functions": [{"name": "temporal_contrast", "args": {"reward": "exact_match"}}]},
        "eval": {"at_start": False, "num_prompts": 2},
    })
    result = Trainer(config).train()
    assert [record["step"] for record in result.history] == [1, 2]
    assert all(record["loss/first_step_ratio_deviation"] < 1e-5 for record in result.history)
    assert all("reward/temporal_contrast_mean" in record for record in result.history)


def _centroid(frame, color):
    """Mean (x, y) of the pixels of exactly ``color``."""
    pixels = np.asarray(frame).astype(int)
    ys, xs = np.nonzero((pixels == np.array(color)).all(axis=-1))
    return float(xs.mean()), float(ys.mean())


def test_motion_questions_move_their_shape_in_the_answer_direction(tmp_path):
    """The synthetic motion clips: the asked shape's colour centroid moves by a fixed step each frame in the
    direction the solution letter names; still shapes do not move; a JSONL copy loads back as frame files."""
    rows = vlm_data.make_shapes(24, seed=3, tasks=["motion"])
    assert {row["direction"] for row in rows} == set(vlm_data.DIRECTIONS)
    for row in rows:
        assert len(row["video"]) == vlm_data.MOTION_FRAMES and row["video_fps"] == 2.0 and "image" not in row
        assert row["solution"] == "ABCD"[vlm_data.DIRECTIONS.index(row["direction"])]
        assert "A. left" in row["prompt"] and "D. down" in row["prompt"]
        color = vlm_data.COLORS[row["label"].split()[0]]
        path = [_centroid(frame, color) for frame in row["video"]]
        steps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(path, path[1:], strict=False)]
        axis, sign = {"left": (0, -1), "right": (0, 1), "up": (1, -1), "down": (1, 1)}[row["direction"]]
        # the same colour may also belong to a still shape: the centroid still moves the right way each frame
        assert all(step[axis] * sign > 0 and abs(step[1 - axis]) < 1e-6 for step in steps), (row["direction"], steps)
    paths = vlm_data.write_shapes_dataset(tmp_path, train_size=3, eval_size=1, seed=3, tasks=["motion", "grounding"])
    loaded = vlm_data.load_jsonl(paths["train"])
    assert [row["task"] for row in loaded] == ["motion", "grounding", "motion"]
    assert len(loaded[0]["video"][0]) == vlm_data.MOTION_FRAMES and loaded[0]["video_fps"] == 2.0
    assert loaded[1]["image"] and "video" not in loaded[1]


def test_toy_video_recipe_runs_offline(tmp_path):
    """configs/vlm/toy_video.yaml as written (tiny model built on first use, motion clips in memory, T-GRPO's
    contrast group and reward), shortened to two steps."""
    from mmrl.config import load_config as load

    config = load(Path(__file__).resolve().parents[2] / "configs" / "vlm" / "toy_video.yaml", [
        f"plugin.model={tmp_path / 'tiny'}", f"run.output_dir={tmp_path / 'run'}", "run.max_steps=2",
        "run.progress=false", "eval.num_prompts=2"])
    result = Trainer(config).train()
    assert all(record["loss/first_step_ratio_deviation"] < 1e-5 for record in result.history)
    assert all(record["rollout/video_tokens"] > 0 for record in result.history)
    assert "eval/temporal_contrast_mean" in result.evaluations[max(result.evaluations)]
