"""Image-editing rewards (``clip_image_similarity``, ``clip_directional``) on the tiny saved open_clip model, against
open_clip's own model, preprocessing and tokenizer; NaN handling, missing captions, the payload the flow plugin's
editing adapters produce."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from mmrl.reward import RewardError, RewardInput
from mmrl.rewards import reward_functions
from mmrl.rewards.edits import ClipDirectional, ClipImageSimilarity

from .conftest import TINY_ARCH, random_images

SOURCES = ["a cat on a mat", "a red car", "a cat on a mat", "two dogs"]
TARGETS = ["a dog on a mat", "a blue car", "a cat on a sofa", "two dogs"]


def edit_batch(edits, inputs, sources=SOURCES, targets=TARGETS) -> RewardInput:
    rows = [{"prompt": target, "source_caption": source, "target_caption": target}
            for source, target in zip(sources, targets, strict=True)]
    return RewardInput(rows=rows, payload={"images": edits, "condition_images": inputs})


def _open_clip_features(weights, images=None, texts=None):
    """Unit-norm features from open_clip directly (its evaluation transform on the 8-bit images)."""
    import open_clip

    model, _, preprocess = open_clip.create_model_and_transforms(TINY_ARCH, pretrained=weights)
    model.eval()
    with torch.no_grad():
        if images is not None:
            uint8 = (images * 255).round().clamp(0, 255).to(torch.uint8)
            pil = [Image.fromarray(image.permute(1, 2, 0).numpy()) for image in uint8]
            return model.encode_image(torch.stack([preprocess(p) for p in pil]), normalize=True)
        return model.encode_text(open_clip.get_tokenizer(TINY_ARCH)(texts), normalize=True)


def test_both_are_registered_with_documented_options():
    for name in ("clip_image_similarity", "clip_directional"):
        assert name in reward_functions and reward_functions.describe(name)
        assert all(option.help for option in reward_functions.options(name))


def test_image_similarity_is_the_clip_image_cosine(tiny_models):
    reward = ClipImageSimilarity(model=tiny_models.clip_config, pretrained=tiny_models.clip_weights, batch_size=3)
    edits, inputs = random_images(4, seed=1), random_images(4, seed=2)
    scores = reward(edit_batch(edits, inputs))
    edit = _open_clip_features(tiny_models.clip_weights, images=edits)
    source = _open_clip_features(tiny_models.clip_weights, images=inputs)
    torch.testing.assert_close(scores, (edit * source).sum(-1).double(), atol=1e-5, rtol=1e-5)
    same = reward(edit_batch(inputs, inputs))  # an edit that changed nothing is as similar as can be
    torch.testing.assert_close(same, torch.ones(4, dtype=torch.float64), atol=1e-5, rtol=0)
    assert bool((scores < same - 1e-3).all())


def test_directional_similarity_follows_stylegan_nadas_direction(tiny_models):
    reward = ClipDirectional(model=tiny_models.clip_config, pretrained=tiny_models.clip_weights)
    edits, inputs = random_images(4, seed=1), random_images(4, seed=2)
    scores = reward(edit_batch(edits, inputs))
    image = (_open_clip_features(tiny_models.clip_weights, images=edits)
             - _open_clip_features(tiny_models.clip_weights, images=inputs))
    text = (_open_clip_features(tiny_models.clip_weights, texts=TARGETS)
            - _open_clip_features(tiny_models.clip_weights, texts=SOURCES))
    expected = (image * text).sum(-1) / (image.norm(dim=-1) * text.norm(dim=-1))
    torch.testing.assert_close(scores[:3], expected[:3].double(), atol=1e-5, rtol=1e-5)
    assert scores[3] == 0  # the captions did not move (two dogs → two dogs): no direction, 0
    swapped = reward(edit_batch(inputs, edits))  # the other way round: the opposite direction
    torch.testing.assert_close(swapped[:3], -scores[:3], atol=1e-5, rtol=1e-5)


def test_a_non_finite_image_on_either_side_scores_nan_for_its_sample_only(tiny_models):
    reward = ClipImageSimilarity(model=tiny_models.clip_config, pretrained=tiny_models.clip_weights)
    edits, inputs = random_images(4, seed=1), random_images(4, seed=2)
    edits[1, 0, 0, 0] = float("nan")
    inputs[2, 1, 3, 3] = float("inf")
    scores = reward(edit_batch(edits, inputs))
    assert torch.isnan(scores[1]) and torch.isnan(scores[2])
    assert torch.isfinite(scores[[0, 3]]).all()


def test_missing_inputs_and_captions_are_one_line_errors(tiny_models):
    reward = ClipDirectional(model=tiny_models.clip_config, pretrained=tiny_models.clip_weights)
    images = random_images(4)
    with pytest.raises(RewardError, match=r"payload\['condition_images'\] but the plugin produced \['images'\]"):
        reward(RewardInput(rows=[{"prompt": p} for p in SOURCES], payload={"images": images}))
    batch = RewardInput(rows=[{"prompt": p} for p in SOURCES], payload={"images": images, "condition_images": images})
    with pytest.raises(RewardError, match=r"^reward 'clip_directional': dataset rows \[0, 1, 2, 3\] have no "
                                          r"'source_caption' field[^\n]*args.source_field[^\n]*$"):
        reward(batch)


def test_an_edit_reward_scores_the_same_through_the_remote_reward(tiny_models):
    """``mmrl serve-rewards`` serving clip_image_similarity, the run's remote reward sending the edits and, with
    extra_images, the inputs: the scores are the local ones bitwise (both sides score the same 8-bit images); a NaN
    input is not sent and scores NaN."""
    from mmrl.rewards.remote import RemoteReward
    from mmrl.rewards.server import RewardServer, build_rewards

    args = {"model": tiny_models.clip_config, "pretrained": tiny_models.clip_weights}
    rewards = build_rewards({"rewards": {"functions": [{"name": "clip_image_similarity", "args": args}]}})
    server = RewardServer(rewards, port=0).start()
    try:
        edits, inputs = random_images(4, seed=1), random_images(4, seed=2)
        inputs[3, 0, 0, 0] = float("nan")
        batch = edit_batch(edits, inputs)
        remote = RemoteReward(url=server.url, extra_images=["condition_images"], retries=0, backoff=0.0,
                              token_env=None)
        local = ClipImageSimilarity(**args)(batch)
        got = remote(batch)
        assert torch.equal(got[:3], local[:3]) and torch.isnan(got[3]) and torch.isnan(local[3])
        with pytest.raises(RewardError, match=r"payload\['condition_images'\]"):  # without the inputs: one line
            RemoteReward(url=server.url, retries=0, backoff=0.0, token_env=None)(batch)
    finally:
        server.close()
    with pytest.raises(RewardError, match=r"^reward 'remote': extra_images names 'images' twice or also as images"):
        RemoteReward(extra_images=["images"], check_server=False, token_env=None)


def test_an_empty_batch_scores_nothing(tiny_models):
    args = {"model": tiny_models.clip_config, "pretrained": tiny_models.clip_weights}
    nothing = torch.zeros(0, 3, 8, 8)
    empty = RewardInput(rows=[], payload={"images": nothing, "condition_images": nothing})
    assert ClipImageSimilarity(**args)(empty).numel() == 0
    assert ClipDirectional(**args)(empty).numel() == 0


def _second_input_brightness(batch: RewardInput) -> torch.Tensor:
    """A test reward reading rows' further input images as the flow plugin hands them over (``more_condition_images``
    ``[N, K, 3, H, W]``): float in [0, 1] in-process, uint8 from the reward server. The mean of each sample's first
    further image, then ten times that of its last, so that the two images' order shows in the score."""
    images = batch.output("more_condition_images")
    stack = images if isinstance(images, torch.Tensor) else torch.stack(list(images))
    stack = stack.double() / 255 if stack.dtype == torch.uint8 else stack.double()
    return stack[:, 0].mean(dim=(1, 2, 3)) + 10 * stack[:, -1].mean(dim=(1, 2, 3))


reward_functions.register("test_second_input_brightness", _second_input_brightness)


def test_several_input_images_per_sample_travel_to_the_reward_server_as_png_sets():
    """Rows with several input images (the flow plugin's ``more_condition_images`` ``[N, K, 3, H, W]``) sent with
    extra_images: the server's reward gets the same 8-bit images in the same order, ``[N, K, 3, H, W]``, and scores
    what it scores in-process on those 8-bit images; a sample with a non-finite pixel in any of them is not sent."""
    from mmrl.rewards.remote import RemoteReward
    from mmrl.rewards.server import RewardServer, build_rewards

    rewards = build_rewards({"rewards": {"functions": [{"name": "test_second_input_brightness"}]}})
    server = RewardServer(rewards, port=0).start()
    try:
        generator = torch.Generator().manual_seed(3)
        more = torch.rand(3, 2, 3, 12, 12, generator=generator)  # [N, K, 3, H, W]
        more[2, 1, 0, 0, 0] = float("nan")
        batch = RewardInput(rows=[{"prompt": p} for p in ("a", "b", "c")],
                            payload={"images": random_images(3), "more_condition_images": more})
        remote = RemoteReward(url=server.url, extra_images=["more_condition_images"], retries=0, backoff=0.0,
                              token_env=None)
        got = remote(batch)
        eight_bit = (more[:2] * 255).round().clamp(0, 255).to(torch.uint8)  # the 8-bit images the server gets
        expected = _second_input_brightness(RewardInput(rows=batch.rows[:2],
                                                        payload={"more_condition_images": eight_bit}))
        torch.testing.assert_close(got[:2], expected, rtol=0, atol=1e-12)
        assert torch.isnan(got[2])
        swapped = RewardInput(rows=batch.rows, payload={"images": batch.payload["images"],
                                                        "more_condition_images": more.flip(1)})
        assert (remote(swapped)[:2] - got[:2]).abs().min() > 1e-3  # the order of a sample's images arrives intact
    finally:
        server.close()
