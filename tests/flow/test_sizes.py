"""Non-square images and video frames (``plugin.height`` / ``plugin.width``) on every adapter's tiny pipeline: the
options resolve against ``plugin.resolution``, a side that the pipeline cannot take is refused naming its option,
swapping height and width transposes every latent grid (so a transposition cannot hide behind equal token counts),
and non-square rollouts keep ratio == 1 on-policy. That the plugin's samples equal the diffusers pipeline's at the
same height and width is checked by each family's own pipeline test (test_plugin, test_qwen_image, test_flux2,
test_flux2_klein, test_wan, test_z_image, test_chroma, test_sana, test_longcat_image)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmrl.config import ConfigError
from tests.flow.conftest import prompt_batch
from tests.flow.test_plugin import _perturb_lora, _ratio_deviation

ROOT = Path(__file__).resolve().parents[2]
KINDS = ["sd3", "flux", "qwen_image", "flux2", "flux2_klein", "wan", "z_image", "chroma", "sana", "longcat_image"]
FRAMES = 5  # tiny Wan: 3 latent frames
# FLUX.2 pads every prompt after a 33-token system turn (tests/flow/test_flux2.py); FLUX.2 [klein]'s Qwen3 template
# takes about 20 of its 32 (tests/flow/test_flux2_klein.py); LongCat-Image takes its pipeline's fixed 512 only.
EXTRA = {"wan": {"num_frames": FRAMES}, "flux2": {"max_sequence_length": 40},
         "flux2_klein": {"max_sequence_length": 32}, "longcat_image": {"max_sequence_length": 512}}
# The short and the long side of the non-square checks: 16 x 32 px, except Sana, whose SanaPipeline.check_inputs
# wants multiples of 32 whatever the VAE (the tiny DC-AE's own factor is 2).
SIDES = {"sana": (32, 64)}


@pytest.fixture(scope="session")
def pipelines(pipelines, tmp_path_factory):
    """The conftest's tiny SD3 and FLUX plus tiny Qwen-Image, FLUX.2, FLUX.2 [klein], Wan, Z-Image, Chroma, Sana and
    LongCat-Image, built once per session."""
    from mmrl.plugins.flow.testing import save_tiny_pipeline

    root = tmp_path_factory.mktemp("flow_sizes")
    return {**pipelines, **{kind: save_tiny_pipeline(kind, root / f"tiny-{kind}")
                            for kind in ("qwen_image", "flux2", "flux2_klein", "wan", "z_image", "chroma",
                                         "sana", "longcat_image")}}


def _noise_shape(kind: str, height: int, width: int) -> tuple[int, ...]:
    """One sample's initial noise as each pipeline's prepare_latents draws it, from the tiny models' configs: a VAE
    factor of 2 (Sana's two-stage DC-AE too), 4 latent channels (16 after FLUX.2's 2x2 patchify; LongCat-Image's 16,
    which its pipeline hard-codes) and Wan's
    (5 - 1)/2 + 1 = 3 latent frames."""
    h, w = height // 2, width // 2
    return {"sd3": (4, h, w), "flux": (4, h, w), "qwen_image": (1, 4, h, w), "flux2": (16, h // 2, w // 2),
            "flux2_klein": (16, h // 2, w // 2),
            "wan": (4, 3, h, w), "z_image": (4, h, w), "chroma": (4, h, w), "sana": (4, h, w),
            "longcat_image": (16, h, w)}[kind]


def test_height_and_width_default_to_resolution_one_by_one():
    from mmrl.plugins.flow.plugin import FlowPluginConfig

    assert FlowPluginConfig(model="m").resolved_size() == (512, 512)
    assert FlowPluginConfig(model="m", resolution=480, width=832).resolved_size() == (480, 832)
    assert FlowPluginConfig(model="m", height=832).resolved_size() == (832, 512)
    assert FlowPluginConfig(model="m", resolution=64, height=480, width=832).size_options() == (
        ("height", 480), ("width", 832))
    assert FlowPluginConfig(model="m", resolution=64, width=32).size_options() == (("resolution", 64), ("width", 32))


def test_recipes_resolve_their_sizes():
    """wan_t2v and wan22_t2v train at Wan's 480p (832 wide, 480 high); every other flow recipe at its height and
    width where it sets them, else its square side."""
    import yaml

    from mmrl.config import load_config

    for recipe in sorted((ROOT / "configs" / "flow").glob("*.yaml")):
        config = load_config(recipe).plugin.config
        if recipe.name in ("wan_t2v.yaml", "wan22_t2v.yaml"):
            assert config.resolved_size() == (480, 832)
            continue
        plugin = yaml.safe_load(recipe.read_text())["plugin"]
        side = plugin.get("resolution", 512)
        assert config.resolved_size() == (plugin.get("height", side), plugin.get("width", side)), recipe.name


@pytest.mark.parametrize("kind", KINDS)
def test_swapped_height_and_width_transpose_the_latents_and_images(make_plugin, kind):
    batch = prompt_batch(["a cat"], 2)
    shapes = {}
    short, long = SIDES.get(kind, (16, 32))
    for height, width in ((short, long), (long, short)):
        plugin = make_plugin(kind, height=height, width=width, **EXTRA.get(kind, {}))
        adapter = plugin.adapter
        assert (adapter.height, adapter.width) == (height, width)
        assert adapter.noise_shape() == _noise_shape(kind, height, width)
        rollout = plugin.rollout(plugin.policy(), batch).validate()
        output = rollout.payload[adapter.output]
        assert output.shape[-2:] == (height, width)
        shapes[height, width] = (adapter.noise_shape(), tuple(rollout.replay["latents"].shape))
        latents = rollout.replay["latents"][:, 0]  # [n, *latent] in the transformer's layout
        if kind in ("flux", "chroma"):  # position ids (0, row, column) on the h/2 x w/2 token grid, row-major
            ids, _ = adapter._position_ids(latents.shape[1], 8, latents)
            assert ids[:, 1].max() == height // 4 - 1 and ids[:, 2].max() == width // 4 - 1
            assert ids[1].tolist() == [0, 0, 1]  # the second token is the next column of the first row
        if kind == "longcat_image":  # (1, 512 + row, 512 + column): the image ids start after the 512 text positions
            ids, _ = adapter._position_ids(latents.shape[1], 512, latents)
            assert ids[:, 1].max() == 511 + height // 4 and ids[:, 2].max() == 511 + width // 4
            assert ids[1].tolist() == [1, 512, 513]
        if kind in ("flux2", "flux2_klein"):  # (t, row, column, l)
            ids, _ = adapter._position_ids(latents.shape[1], 40, latents)
            assert ids[0, :, 1].max() == height // 4 - 1 and ids[0, :, 2].max() == width // 4 - 1
            assert ids[0, 1].tolist() == [0, 0, 1, 0]
    (wide_noise, wide_latents), (tall_noise, tall_latents) = shapes[short, long], shapes[long, short]
    assert wide_noise != tall_noise  # the grid is transposed, whatever the packing does with it
    if kind in ("sd3", "wan", "z_image", "sana"):  # unpacked latents keep the grid
        assert wide_latents != tall_latents


@pytest.mark.parametrize("kind", KINDS)
def test_non_square_rollouts_have_ratio_one_on_policy(make_plugin, kind):
    short, long = SIDES.get(kind, (16, 32))
    plugin = make_plugin(kind, height=short, width=long, **EXTRA.get(kind, {}))
    _perturb_lora(plugin, scale=0.1)
    policy = plugin.policy()
    rollout = plugin.rollout(policy, prompt_batch(["a cat", "a dog"], 2)).validate()
    with torch.no_grad():
        for split in ([0, 1, 2, 3], [3, 0]):
            part = rollout.select(torch.tensor(split))
            assert _ratio_deviation(plugin.forward(policy, part, need_reference=False), part) < 1e-5
        _perturb_lora(plugin, seed=1)  # the check can fail: other weights move the ratio
        assert _ratio_deviation(plugin.forward(policy, rollout, need_reference=False), rollout) > 1e-3


@pytest.mark.parametrize(("options", "key", "given"), [
    ({"height": 16, "width": 18}, "plugin.width", 18),
    ({"height": 18, "width": 16}, "plugin.height", 18),
    ({"resolution": 18, "width": 16}, "plugin.resolution", 18),  # the height comes from resolution
    ({"resolution": 18}, "plugin.resolution", 18),
])
def test_a_side_off_the_multiple_is_refused_naming_its_option(make_plugin, pipelines, options, key, given):
    # The tiny FLUX: VAE factor 2 x 2x2 packing = 4 (FluxPipeline.check_inputs: vae_scale_factor * 2).
    with pytest.raises(ConfigError) as info:
        make_plugin("flux", **options)
    assert str(info.value) == (f"config key '{key}': got {given}; allowed: a multiple of 4 for {pipelines['flux']} "
                               "(the flux pipeline's VAE downsampling x patch size)")
    assert make_plugin("flux", resolution=18, height=16, width=20).adapter.size == (16, 20)  # resolution unused


def test_wan_takes_the_multiples_of_16_its_pipeline_takes(make_plugin):
    """The tiny Wan's own VAE factor x patch is 2 x 2 = 4, but WanPipeline.check_inputs refuses any side that is not
    a multiple of 16, so the adapter does too."""
    with pytest.raises(ConfigError, match=r"^config key 'plugin.width': got 24; allowed: a multiple of 16 for "):
        make_plugin("wan", num_frames=FRAMES, height=16, width=24)
    plugin = make_plugin("wan", num_frames=FRAMES, height=16, width=32)
    with pytest.raises(ValueError, match="divisible by 16"):
        plugin.adapter.pipeline("a cat", height=16, width=24, num_frames=FRAMES, num_inference_steps=1)


def test_sana_takes_the_multiples_of_32_its_pipeline_takes(make_plugin):
    """The tiny Sana's own VAE factor x patch is 2 x 1 = 2, but SanaPipeline.check_inputs refuses any side that is not
    a multiple of 32, so the adapter does too."""
    with pytest.raises(ConfigError, match=r"^config key 'plugin.width': got 48; allowed: a multiple of 32 for "):
        make_plugin("sana", height=32, width=48)
    plugin = make_plugin("sana", height=32, width=64)
    with pytest.raises(ValueError, match="divisible by 32"):  # without binning, which would snap 32 x 48 to a bin
        plugin.adapter.pipeline("a cat", height=32, width=48, num_inference_steps=1, use_resolution_binning=False)


def test_a_side_below_one_is_refused_when_the_config_loads():
    from mmrl.config import from_dict
    from mmrl.plugins.flow.plugin import FlowPluginConfig

    with pytest.raises(ConfigError, match="^config key 'plugin.height': got 0"):
        from_dict(FlowPluginConfig, {"model": "m", "prompts": ["a"], "height": 0}, "plugin")


def test_set_size_refuses_a_side_off_the_multiple(make_plugin):
    adapter = make_plugin("flux").adapter
    with pytest.raises(ValueError, match="^flux adapter: height 16 and width 18 must be positive multiples of 4$"):
        adapter.set_size(16, 18)
    assert adapter.size == (16, 16)  # unchanged


def test_caption_grids_keep_wide_images_wide():
    """Two 16x32 images, each red on its left half and blue on its right: cells are enlarged by ceil(192 / 32) = 6
    to 96 x 192 px and laid out side by side (PAD 4 around them, a 3 x 14 + 8 = 50 px caption strip below)."""
    from mmrl.plugins.flow.images import caption_grid

    images = torch.zeros(2, 3, 16, 32)
    images[:, 0, :, :16] = 1.0  # red left half
    images[:, 2, :, 16:] = 1.0  # blue right half
    grid = caption_grid(images, ["a", "b"])
    assert grid.size == (4 + 2 * (192 + 4), 4 + 96 + 50 + 4)  # (width, height)
    for x0 in (4, 4 + 192 + 4):  # the two cells
        assert grid.getpixel((x0, 4)) == (255, 0, 0) and grid.getpixel((x0 + 95, 4 + 95)) == (255, 0, 0)
        assert grid.getpixel((x0 + 96, 4)) == (0, 0, 255) and grid.getpixel((x0 + 191, 4 + 95)) == (0, 0, 255)
    assert grid.getpixel((4, 4 + 96)) == (255, 255, 255)  # the caption strip starts below the 96 rows
