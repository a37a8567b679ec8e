"""Image rewards: tiny saved models loaded through the rewards' own code, formulas, image conversion, errors."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.config import ConfigError, load_config
from mmrl.reward import RewardError, RewardInput, RewardScorer, build_reward
from mmrl.rewards import reward_functions
from mmrl.rewards.image_models import (
    Aesthetic,
    AestheticMLP,
    ClipScore,
    HPSv2,
    JpegCompressibility,
    JpegIncompressibility,
    PickScore,
    RewardWeightsError,
)
from mmrl.rewards.images import clip_pixels, to_image_batch
from tests.helpers import BASE

from .conftest import TINY_ARCH, TINY_SIZE, random_images

PROMPTS = ["a cat on a mat", "a red car", "a cat on a mat", "two dogs"]


def batch_of(images, prompts=None) -> RewardInput:
    n = len(images)
    prompts = prompts or [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    return RewardInput(rows=[{"prompt": p} for p in prompts], payload={"images": images},
                       group_ids=torch.arange(n) // 2)


def varies(scores: torch.Tensor) -> bool:
    return bool((scores.max() - scores.min()).abs() > 1e-6)


# ------------------------------------------------------------------------------------------------ registration


def test_every_image_reward_is_registered_and_listed(capsys):
    from mmrl.cli import main

    names = ["clip_score", "pickscore", "hpsv2", "aesthetic", "jpeg_compressibility", "jpeg_incompressibility",
             "pref_winrate", "remote"]
    for name in names:
        assert name in reward_functions
        assert reward_functions.describe(name)
        for option in reward_functions.options(name):
            assert option.help, (name, option.name)  # every option is documented for `mmrl list --options`
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in names:
        assert f"  {name}\n" in out


def test_image_reward_in_a_run_config_validates():
    data = {**BASE, "rewards": {"functions": [{"name": "jpeg_compressibility", "args": {"quality": 90}},
                                              {"name": "clip_score", "weight": 0.5, "args": {"divisor": 100}}]}}
    config = load_config(data, ["run.output_dir=unused"])
    specs = config.rewards.functions
    assert [s.name for s in specs] == ["jpeg_compressibility", "clip_score"]
    assert specs[0].args == {"quality": 90} and specs[1].args == {"divisor": 100.0}
    with pytest.raises(ConfigError, match=r"rewards\.functions\[0\]\.args\.quality.*an integer"):
        load_config({**BASE, "rewards": {"functions": [{"name": "jpeg_compressibility", "args": {"quality": "hi"}}]}})
    with pytest.raises(ConfigError, match=r"args\.checkpont.*options of reward 'hpsv2'.*checkpoint="):
        load_config({**BASE, "rewards": {"functions": [{"name": "hpsv2", "args": {"checkpont": "x.pt"}}]}})


# ------------------------------------------------------------------------------------------------ open_clip rewards


def test_clip_score_matches_open_clip_and_its_formula(tiny_models):
    import open_clip

    reward = ClipScore(model=tiny_models.clip_config, pretrained=tiny_models.clip_weights, device="cpu")
    images = random_images(4)
    scores = reward(batch_of(images))
    assert scores.shape == (4,) and torch.isfinite(scores).all()
    # Independent computation with open_clip's own model, preprocessing and tokenizer (images already 32 × 32).
    model, _, preprocess = open_clip.create_model_and_transforms(TINY_ARCH, pretrained=tiny_models.clip_weights)
    model.eval()
    tokenizer = open_clip.get_tokenizer(TINY_ARCH)
    uint8 = (images * 255).round().clamp(0, 255).to(torch.uint8)
    pil = [Image.fromarray(im.permute(1, 2, 0).numpy()) for im in uint8]
    with torch.no_grad():
        image = model.encode_image(torch.stack([preprocess(p) for p in pil]), normalize=True)
        text = model.encode_text(tokenizer(PROMPTS), normalize=True)
        expected = model.logit_scale.exp() * (image * text).sum(-1) / 30.0
    torch.testing.assert_close(scores, expected.double(), atol=1e-5, rtol=1e-5)


def test_clip_score_changes_with_image_and_prompt_and_loads_safetensors(tiny_models):
    reward = ClipScore(model=tiny_models.clip_config, pretrained=tiny_models.clip_safetensors, divisor=1.0)
    same_image = random_images(1).expand(4, -1, -1, -1)
    by_prompt = reward(batch_of(same_image, ["a cat", "a dog", "a red car", "a cat"]))
    # Scores are float32 model outputs: rows 0 and 3 are different rows of one matmul, and the last call encodes 1
    # text where the first encoded 3 (other matmul shapes), so they agree to float32 rounding, not bit for bit.
    assert varies(by_prompt[:3])
    torch.testing.assert_close(by_prompt[3], by_prompt[0], rtol=1e-5, atol=1e-6)
    by_image = reward(batch_of(random_images(4, seed=5), ["a cat"] * 4))
    assert varies(by_image)
    torch_weights = ClipScore(model=tiny_models.clip_config, pretrained=tiny_models.clip_weights, divisor=1.0)
    torch.testing.assert_close(torch_weights(batch_of(same_image, ["a cat"] * 4)), by_prompt[[0, 0, 0, 0]],
                               rtol=1e-5, atol=1e-6)


def test_clip_score_resizes_other_sizes(tiny_models):
    reward = ClipScore(model=tiny_models.clip_config, pretrained=tiny_models.clip_weights)
    mixed = [random_images(1, size=48, height=40)[0], random_images(1, size=20, seed=3)[0]]
    scores = reward(batch_of(mixed))
    assert scores.shape == (2,) and torch.isfinite(scores).all()


def test_hpsv2_is_the_cosine_of_its_checkpoint(tiny_models):
    hps = HPSv2(checkpoint=tiny_models.hps_checkpoint, model=tiny_models.clip_config, device="cpu")
    images = random_images(4, seed=1)
    scores = hps(batch_of(images))
    assert torch.isfinite(scores).all() and (scores.abs() <= 1).all() and varies(scores)
    # The same weights through clip_score with divisor = logit scale give the plain cosine.
    as_clip = ClipScore(model=tiny_models.clip_config, pretrained=tiny_models.hps_checkpoint)
    as_clip.divisor = as_clip.clip.logit_scale
    torch.testing.assert_close(scores, as_clip(batch_of(images)))
    prompts = hps(batch_of(random_images(1, seed=1).expand(3, -1, -1, -1), ["a cat", "a dog", "a red car"]))
    assert varies(prompts)
    # A non-square image is seen whole, padded black (HPSv2's ResizeMaxSize), not centre-cropped as clip_score does.
    wide = random_images(2, seed=2, height=TINY_SIZE // 2, size=TINY_SIZE * 2)
    as_clip.clip.resize_mode = "longest"
    padded = as_clip(batch_of(wide))
    torch.testing.assert_close(hps(batch_of(wide)), padded)
    as_clip.clip.resize_mode = "shortest"
    assert (as_clip(batch_of(wide)) - padded).abs().max() > 1e-4


def test_aesthetic_is_the_mlp_of_the_normalised_embedding(tiny_models):
    reward = Aesthetic(mlp_weights=tiny_models.aesthetic_mlp, model=tiny_models.clip_config,
                       pretrained=tiny_models.clip_weights)
    images = random_images(3, seed=2)
    scores = reward(batch_of(images))
    assert torch.isfinite(scores).all() and varies(scores)
    mlp = AestheticMLP(16)
    mlp.load_state_dict(torch.load(tiny_models.aesthetic_mlp, weights_only=True))
    mlp.eval()
    clip = ClipScore(model=tiny_models.clip_config, pretrained=tiny_models.clip_weights).clip
    with torch.no_grad():
        uint8 = to_image_batch(images).images
        embedding = clip.image_features(uint8)
        assert torch.allclose(embedding.norm(dim=-1), torch.ones(3))
        expected = mlp(embedding).squeeze(-1)
    torch.testing.assert_close(scores, expected.double())
    assert torch.equal(reward(batch_of(images, ["x", "y", "z"])), scores)  # the prompt is not used


def test_aesthetic_mlp_keys_match_the_laion_layout():
    assert sorted(AestheticMLP().state_dict()) == sorted(
        f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("weight", "bias"))


# ------------------------------------------------------------------------------------------------ PickScore


def test_pickscore_matches_the_transformers_model(tiny_models):
    from transformers import AutoProcessor, CLIPModel

    reward = PickScore(model=tiny_models.pickscore_dir, processor=tiny_models.pickscore_dir, device="cpu")
    images = random_images(4, seed=3)
    scores = reward(batch_of(images))
    assert scores.shape == (4,) and torch.isfinite(scores).all() and varies(scores)
    # Independently: the processor on PIL images (the reference pipeline), logits_per_image diagonal / 26.
    processor = AutoProcessor.from_pretrained(tiny_models.pickscore_dir)
    model = CLIPModel.from_pretrained(tiny_models.pickscore_dir).eval()
    uint8 = (images * 255).round().clamp(0, 255).to(torch.uint8)
    pil = [Image.fromarray(im.permute(1, 2, 0).numpy()) for im in uint8]
    inputs = processor(images=pil, text=PROMPTS, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        expected = model(**inputs).logits_per_image.diagonal() / 26.0
    torch.testing.assert_close(scores, expected.double(), atol=1e-5, rtol=1e-5)
    same_image = reward(batch_of(images[:1].expand(3, -1, -1, -1), ["a cat", "a dog", "a red car"]))
    assert varies(same_image)


# ------------------------------------------------------------------------------------------------ JPEG


def _jpeg_kb(image: np.ndarray) -> float:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=95)
    return len(buffer.getvalue()) / 1000


def test_jpeg_rewards_on_hand_made_images():
    flat = np.full((64, 64, 3), 120, dtype=np.uint8)
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    batch = batch_of([flat, noise])
    compress = JpegCompressibility()(batch)
    incompress = JpegIncompressibility()(batch)
    assert compress[0] > compress[1]  # a flat image compresses better than noise
    assert incompress[1] > incompress[0]
    torch.testing.assert_close(compress, -incompress)
    expected = torch.tensor([-_jpeg_kb(flat) / 500, -_jpeg_kb(noise) / 500], dtype=torch.float64)
    torch.testing.assert_close(compress, expected)
    assert torch.equal(JpegCompressibility(divisor=1.0)(batch), compress * 500)


def test_jpeg_rewards_reject_bad_options():
    with pytest.raises(RewardError, match="quality must be in 1..100"):
        JpegCompressibility(quality=0)
    with pytest.raises(RewardError, match="divisor must be > 0"):
        JpegIncompressibility(divisor=0.0)


# ------------------------------------------------------------------------------------------------ conversion


def test_uint8_float_numpy_and_pil_inputs_agree():
    reward = JpegIncompressibility()
    uint8 = (random_images(3, size=24, seed=4) * 255).round().to(torch.uint8)
    reference = reward(batch_of(uint8))
    as_float = reward(batch_of(uint8.float() / 255))
    as_half = reward(batch_of((uint8.float() / 255).to(torch.bfloat16).float()))
    as_numpy_batch = reward(batch_of(uint8.permute(0, 2, 3, 1).numpy()))
    as_numpy_list = reward(batch_of([im.permute(1, 2, 0).numpy() for im in uint8]))
    as_pil = reward(batch_of([Image.fromarray(im.permute(1, 2, 0).numpy()) for im in uint8]))
    as_int64 = reward(batch_of(uint8.long()))
    for other in (as_float, as_numpy_batch, as_numpy_list, as_pil, as_int64):
        assert torch.equal(other, reference)
    assert torch.isfinite(as_half).all()
    # float → 8 bits is round(x · 255): a uint8 image survives the round trip exactly
    assert torch.equal(to_image_batch(uint8.float() / 255).images[0], uint8[0])


def test_grayscale_and_rgba_are_converted():
    gray = (random_images(2, seed=6)[:, :1] * 255).round().to(torch.uint8)  # [N, 1, H, W]
    rgb = gray.expand(-1, 3, -1, -1)
    alpha = torch.randint(0, 256, (2, 1, TINY_SIZE, TINY_SIZE), dtype=torch.uint8)
    rgba = torch.cat([rgb, alpha], dim=1)
    converted = [to_image_batch(x).images for x in (gray, rgba)]
    for images in converted:
        assert all(torch.equal(a, b) for a, b in zip(images, rgb, strict=True))
    pil_l = Image.fromarray(gray[0, 0].numpy())
    pil_rgba = Image.fromarray(rgba[0].permute(1, 2, 0).numpy())
    pil_p = pil_l.convert("P")
    assert (pil_l.mode, pil_rgba.mode, pil_p.mode) == ("L", "RGBA", "P")
    for image in (pil_l, pil_rgba, pil_p):
        assert torch.equal(to_image_batch([image]).images[0], rgb[0])
    two_d = to_image_batch([gray[0, 0].numpy(), gray[1, 0]])  # [H, W] arrays and tensors are grayscale
    assert torch.equal(two_d.images[0], rgb[0]) and torch.equal(two_d.images[1], rgb[1])


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (torch.rand(3, 8, 8), r"tensor of shape \[3, 8, 8\]; expected \[N, C, H, W\]"),
        (torch.rand(2, 2, 8, 8), r"has 2 channels \(shape \[2, 2, 8, 8\]\); expected 1 \(grayscale\), 3 \(RGB\) or 4"),
        ([torch.rand(2, 8, 8)], r"\[0\] has 2 channels .* in layout \[C, H, W\]"),
        (np.zeros((2, 8, 8, 5), dtype=np.uint8), r"has 5 channels"),
        (np.zeros((8, 8, 3), dtype=np.uint8), r"array of shape \[8, 8, 3\]; numpy batches are \[N, H, W, C\]"),
        (torch.zeros(2, 3, 0, 8), r"is empty"),
        (torch.zeros(2, 3, 8, 8, dtype=torch.bool), r"dtype torch.bool; expected uint8"),
        (torch.full((1, 3, 4, 4), 200.0), r"\[0\] has float values in \[200, 200\]; float images must lie in \[0, 1\]"),
        ([torch.full((3, 4, 4), 2.0)], r"\[0\] has float values in \[2, 2\]"),
        (torch.full((1, 3, 4, 4), -1.0), r"map \[-1, 1\] images with x / 2 \+ 0.5"),
        (torch.full((1, 3, 4, 4), 300, dtype=torch.int32), r"int32 values in \[300, 300\]; integer images must"),
        ("not images", r"is a str; expected a tensor"),
        (["a string"], r"\[0\] is a str; expected a PIL image"),
        ([torch.zeros(2, 3, 4, 4)], r"\[0\] has shape \[2, 3, 4, 4\]; expected \[C, H, W\]"),
    ],
)
def test_unusable_images_are_rejected_clearly(value, message):
    with pytest.raises(RewardError, match=message) as info:
        JpegCompressibility()(batch_of(value) if not isinstance(value, str) else RewardInput(
            rows=[{"prompt": "x"}], payload={"images": value}))
    text = str(info.value)
    assert "\n" not in text and "reward 'jpeg_compressibility': payload['images']" in text


def test_wrong_count_and_missing_payload_are_rejected():
    reward = JpegCompressibility()
    with pytest.raises(RewardError, match=r"holds 2 images for 3 samples"):
        reward(RewardInput(rows=[{}] * 3, payload={"images": random_images(2)}))
    with pytest.raises(RewardError, match=r"reads payload\['images'\] but the plugin produced \['completions'\]"):
        reward(RewardInput(rows=[{}], payload={"completions": ["x"]}))


def test_slightly_out_of_range_floats_are_clipped():
    images = torch.full((1, 3, 4, 4), 1.2)
    assert torch.equal(to_image_batch(images).images[0], torch.full((3, 4, 4), 255, dtype=torch.uint8))


def test_nan_pixels_score_nan_for_that_sample_only(tiny_models):
    images = random_images(4, seed=7)
    images[1, 0, 3, 3] = float("nan")
    images[2, 1, 0, 0] = float("inf")
    batch = batch_of(images)
    rewards = [JpegCompressibility(), ClipScore(model=tiny_models.clip_config, pretrained=tiny_models.clip_weights),
               PickScore(model=tiny_models.pickscore_dir, processor=tiny_models.pickscore_dir)]
    for reward in rewards:
        scores = reward(batch)
        assert torch.isnan(scores[[1, 2]]).all() and torch.isfinite(scores[[0, 3]]).all()
        clean = reward(batch_of(images[[0, 3]], [PROMPTS[0], PROMPTS[3]]))
        # The others are unaffected; to float32 rounding, since 4 prompts are encoded there and 2 here.
        torch.testing.assert_close(scores[[0, 3]], clean, rtol=1e-5, atol=1e-6)


def test_nan_image_through_the_scorer_errors_or_skips(tiny_models):
    images = random_images(3, seed=8)
    images[2] = float("nan")
    batch = batch_of(images)
    args = {"model": tiny_models.clip_config, "pretrained": tiny_models.clip_weights}
    functions = [build_reward("jpeg_compressibility", {}), build_reward("clip_score", args)]
    strict = RewardScorer(["jpeg_compressibility", "clip_score"], functions, [1.0, 1.0], on_nonfinite="error")
    with pytest.raises(RewardError, match=r"reward 'jpeg_compressibility' returned NaN or infinite scores for "
                                          r"samples \[2\]"):
        strict.score(batch)
    lenient = RewardScorer(["jpeg_compressibility", "clip_score"], functions, [1.0, 1.0], on_nonfinite="skip")
    scored = lenient.score(batch)
    assert scored.valid.tolist() == [True, True, False]
    assert torch.isfinite(scored.scores).all() and (scored.scores[2] == 0).all()


# ------------------------------------------------------------------------------------------------ preprocessing


def test_clip_pixels_resize_shortest_side_then_center_crop():
    wide = torch.zeros(3, 20, 40, dtype=torch.uint8)
    wide[:, :, 10:30] = 255  # a white centre band exactly as wide as the crop after resizing to 32 × 64
    out = clip_pixels([wide], 32, mean=(0, 0, 0), std=(1, 1, 1))
    assert out.shape == (1, 3, 32, 32)
    assert out[0, :, :, 4:28].min() > 0.99  # the crop is the white centre band
    squash = clip_pixels([wide], 32, mean=(0, 0, 0), std=(1, 1, 1), resize_mode="squash")
    assert squash[0, :, :, 0].max() < 0.05  # the dark edges survive a squash
    normalised = clip_pixels([torch.full((3, 8, 8), 255, dtype=torch.uint8)], 8, mean=(0.5,) * 3, std=(0.25,) * 3)
    torch.testing.assert_close(normalised, torch.full((1, 3, 8, 8), 2.0))
    with pytest.raises(RewardError, match="resize mode 'crop' is not supported; allowed: 'shortest', 'longest'"):
        clip_pixels([wide], 32, (0, 0, 0), (1, 1, 1), resize_mode="crop")


def test_clip_pixels_resize_longest_side_then_pad_black_as_hpsv2():
    """HPSv2's ResizeMaxSize: the longer side to S, the shorter scaled alike, black padding split smaller-half first
    (top/left), so a non-square image is seen whole, not centre-cropped."""
    wide = torch.full((3, 20, 40), 255, dtype=torch.uint8)  # 20 x 40 -> 16 x 32, padded 8 above and 8 below
    out = clip_pixels([wide], 32, mean=(0, 0, 0), std=(1, 1, 1), resize_mode="longest")
    assert out.shape == (1, 3, 32, 32)
    assert out[0, :, 8:24].min() > 0.99 and out[0, :, :8].max() == 0 and out[0, :, 24:].max() == 0
    tall = torch.full((3, 45, 15), 255, dtype=torch.uint8)  # -> 32 x round(10.67) = 11, pad 21: 10 left, 11 right
    out = clip_pixels([tall], 32, mean=(0, 0, 0), std=(1, 1, 1), resize_mode="longest")
    assert out[0, :, :, 10:21].min() > 0.99 and out[0, :, :, :10].max() == 0 and out[0, :, :, 21:].max() == 0
    square = torch.randint(0, 256, (3, 48, 48), dtype=torch.uint8)  # square images: the same as the centre crop
    torch.testing.assert_close(clip_pixels([square], 32, (0, 0, 0), (1, 1, 1), resize_mode="longest"),
                               clip_pixels([square], 32, (0, 0, 0), (1, 1, 1)))


# ------------------------------------------------------------------------------------------------ missing weights


def _one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text
    return text


@pytest.mark.parametrize(
    ("name", "args", "option"),
    [
        ("clip_score", {"pretrained": "{missing}/clip.pt"}, "pretrained"),
        ("hpsv2", {"checkpoint": "{missing}/HPS_v2.1_compressed.pt"}, "checkpoint"),
        ("aesthetic", {"mlp_weights": "{missing}/sac+logos+ava1-l14-linearMSE.pth"}, "mlp_weights"),
        ("pickscore", {"model": "{missing}/pickscore_model", "processor": "{missing}/pickscore_model"}, "processor"),
    ],
)
def test_missing_local_weights_name_the_reward_the_path_and_the_option(tmp_path, tiny_models, name, args, option):
    missing = tmp_path / "nowhere"
    args = {key: value.format(missing=missing) for key, value in args.items()}
    if name in ("clip_score", "hpsv2", "aesthetic"):
        args["model"] = tiny_models.clip_config
    with pytest.raises(RewardWeightsError) as info:
        build_reward(name, args)
    text = _one_line(info.value)
    assert f"reward {name!r}" in text and str(missing) in text
    assert f"args.{option}" in text


def test_hub_ids_do_not_download_when_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", "/nonexistent-mmrl-test-cache")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", "/nonexistent-mmrl-test-cache/hub")
    cases = [
        ("hpsv2", {}, "hf-hub:xswu/HPSv2/HPS_v2.1_compressed.pt", "args.checkpoint"),
        ("aesthetic", {}, "hf-hub:trl-lib/ddpo-aesthetic-predictor/aesthetic-model.pth", "args.mlp_weights"),
        ("pickscore", {}, "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", "args.processor"),
        ("clip_score", {}, "timm/vit_large_patch14_clip_224.openai", "args.pretrained"),
    ]
    for name, args, where, option in cases:
        with pytest.raises(RewardWeightsError) as info:
            build_reward(name, args)
        text = _one_line(info.value)
        assert f"reward {name!r}" in text and where in text and "HF_HUB_OFFLINE" in text and option in text, text


def test_weights_that_do_not_fit_or_are_not_weights_are_rejected(tmp_path, tiny_models):
    wrong = tmp_path / "wrong.pt"
    torch.save({"layers.0.weight": torch.zeros(3, 3)}, wrong)
    with pytest.raises(RewardWeightsError, match=r"does not fit open_clip architecture .*missing keys") as info:
        HPSv2(checkpoint=str(wrong), model=tiny_models.clip_config)
    _one_line(info.value)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(RewardWeightsError, match=r"cannot read checkpoint file .* weights-only torch checkpoint"):
        HPSv2(checkpoint=str(garbage), model=tiny_models.clip_config)
    with pytest.raises(RewardWeightsError, match=r"does not fit the aesthetic MLP for 16-d embeddings"):
        Aesthetic(mlp_weights=tiny_models.clip_weights, model=tiny_models.clip_config,
                  pretrained=tiny_models.clip_weights)
    with pytest.raises(RewardError, match=r"unknown open_clip architecture 'ViT-Q-99'"):
        ClipScore(model="ViT-Q-99", pretrained=tiny_models.clip_weights)
    with pytest.raises(RewardWeightsError, match=r"'nonsense' is neither a file nor a pretrained tag"):
        ClipScore(model="ViT-B-32", pretrained="nonsense")
    with pytest.raises(RewardError, match=r"model 'hf-hub:org/repo' carries its own weights; set pretrained: null"):
        ClipScore(model="hf-hub:org/repo")
    with pytest.raises(RewardWeightsError, match=r"no weights given for 'ViT-B-32'; set this reward's args.pretrained"):
        ClipScore(model="ViT-B-32", pretrained=None)


def test_missing_weights_stop_the_cli_with_one_line(tmp_path, capsys):
    import yaml

    from mmrl.cli import main

    missing = tmp_path / "HPS_v2.1_compressed.pt"
    config = {**BASE, "run": {**BASE["run"], "output_dir": str(tmp_path / "run")},
              "rewards": {"functions": [{"name": "hpsv2", "args": {"checkpoint": str(missing)}}]}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("mmrl: RewardWeightsError: reward 'hpsv2'") and str(missing) in err
    assert "args.checkpoint" in err


def test_device_option_is_validated():
    with pytest.raises(RewardError, match=r"device 'gpu0' is not a torch device"):
        ClipScore(pretrained="unused.pt", device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(RewardError, match="CUDA is not available"):
            ClipScore(pretrained="unused.pt", device="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rewards_on_cuda_match_cpu(tiny_models):
    images = random_images(4, seed=9)
    batch_cpu = batch_of(images)
    batch_gpu = batch_of(images.cuda())
    for cls, args in [(ClipScore, {"model": tiny_models.clip_config, "pretrained": tiny_models.clip_weights}),
                      (PickScore, {"model": tiny_models.pickscore_dir, "processor": tiny_models.pickscore_dir})]:
        on_gpu = cls(**args)  # device null picks cuda
        assert str(next(iter(on_gpu.clip.model.parameters() if hasattr(on_gpu, "clip") else
                             on_gpu.model.parameters())).device).startswith("cuda")
        torch.testing.assert_close(on_gpu(batch_gpu), cls(**args, device="cpu")(batch_cpu), atol=1e-4, rtol=1e-4)


def test_empty_batch_scores_nothing(tiny_models):
    reward = ClipScore(model=tiny_models.clip_config, pretrained=tiny_models.clip_weights)
    assert reward(RewardInput(rows=[], payload={"images": torch.zeros(0, 3, 8, 8)})).numel() == 0
    assert math.isnan(float(JpegCompressibility()(batch_of(torch.full((1, 3, 4, 4), float("nan"))))[0]))
