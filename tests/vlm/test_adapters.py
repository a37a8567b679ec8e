"""Model adapters: registry and family detection, image loading, processor shapes, per-sample splitting and
collation, and finding the vision tower."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mmrl.plugins.vlm.adapters import adapter_for, model_type_of, vlm_adapters
from mmrl.plugins.vlm.adapters.base import find_submodule, split_images
from mmrl.plugins.vlm.data import make_shapes

MIN_PIXELS, MAX_PIXELS = 4 * 28 * 28, 16 * 28 * 28


@pytest.fixture(scope="module")
def adapters(tiny_models):
    return {family: adapter_for("auto", str(path))(str(path), min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
            for family, path in tiny_models.items()}


def test_auto_family_reads_model_type(tiny_models):
    for family, path in tiny_models.items():
        assert model_type_of(str(path)) == family
        assert adapter_for("auto", str(path)).name == family
        assert adapter_for(family, "unused").box_convention == family


def test_qwen3_vl_is_registered_when_transformers_has_it():
    import transformers

    assert ("qwen3_vl" in vlm_adapters) == hasattr(transformers, "Qwen3VLForConditionalGeneration")


def test_unknown_model_type_names_the_known_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llava"}')
    with pytest.raises(ValueError, match=r"no VLM adapter handles model_type 'llava'.*qwen2_vl \(qwen2_vl\)"):
        adapter_for("auto", str(tmp_path))


def test_builtin_image_loader_matches_qwen_vl_utils(adapters, tmp_path):
    pytest.importorskip("qwen_vl_utils")
    adapter = adapters["qwen2_5_vl"]
    rows = make_shapes(3, seed=0, min_side=30, max_side=400)
    rows[0]["image"].save(tmp_path / "a.png")
    images = [str(tmp_path / "a.png"), rows[1]["image"], rows[2]["image"].convert("RGBA")]
    ours = adapter.load_images(images, use_qwen_vl_utils=False)
    theirs = adapter.load_images(images, use_qwen_vl_utils=True)
    for mine, reference, row in zip(ours, theirs, rows, strict=True):
        assert mine.size == reference.size == adapter.resized_size(row["image_size"])
        assert mine.tobytes() == reference.tobytes()


def test_processor_shapes_and_per_sample_split(adapters):
    """One batched processor call on prompts with 1, 2 and 1 images of different sizes, split per prompt, equals
    processing each prompt alone; the grids give the resized sizes the rows record."""
    for adapter in adapters.values():
        rows = make_shapes(4, seed=1, min_side=40, max_side=200)
        groups = [[rows[0]["image"]], [rows[1]["image"], rows[2]["image"]], [rows[3]["image"]]]
        images = [adapter.load_images(group) for group in groups]
        texts = [adapter.chat_text(adapter.messages("Where is the red circle?", len(g))) for g in images]
        batched = adapter.encode(texts, images)
        for prompt, text, group in zip(batched, texts, images, strict=True):
            alone = adapter.encode([text], [group])[0]
            assert set(prompt) == {"input_ids", "mm_token_type_ids", "pixel_values", "image_grid_thw"}
            for key in prompt:
                assert torch.equal(prompt[key], alone[key]), key
            grid = prompt["image_grid_thw"]  # [images, 3]
            assert grid.shape == (len(group), 3)
            assert prompt["pixel_values"].shape == (int(grid.prod(-1).sum()), 3 * 2 * 14 * 14)
            image_tokens = int((prompt["input_ids"] == adapter.processor.image_token_id).sum())
            assert image_tokens == int(grid.prod(-1).sum()) // 4 == int(prompt["mm_token_type_ids"].sum())
            for image, thw in zip(group, grid.tolist(), strict=True):
                assert (thw[2] * 14, thw[1] * 14) == image.size


def test_split_images_follows_image_grid_thw():
    grid = torch.tensor([[1, 2, 2], [1, 4, 2], [1, 2, 6]])  # 4, 8 and 12 patch rows
    pixels = torch.arange(24).unsqueeze(1).float()
    parts = split_images(pixels, grid, [2, 0, 1])
    assert [p.flatten().tolist() for p, _ in parts] == [list(range(12)), [], list(range(12, 24))]
    assert [g.shape[0] for _, g in parts] == [2, 0, 1]
    with pytest.raises(ValueError, match="3 image grids for 2 images"):
        split_images(pixels, grid, [1, 1])
    with pytest.raises(ValueError, match="24 patch rows, pixel_values has 20"):
        split_images(pixels[:20], grid, [3])


def test_collate_left_pads_prompts_right_pads_completions(adapters):
    adapter = adapters["qwen2_vl"]
    rows = make_shapes(2, seed=2, min_side=40, max_side=200)
    images = [adapter.load_images([row["image"]]) for row in rows]
    prompts = adapter.encode([adapter.chat_text(adapter.messages("q" * (1 + 20 * i), 1)) for i in range(2)], images)
    completions = [torch.tensor([5, 6, 7]), torch.tensor([8])]
    inputs, width = adapter.collate(prompts, completions)
    lengths = [len(p["input_ids"]) for p in prompts]
    assert width == max(lengths) and inputs["input_ids"].shape == (2, width + 3)
    for i, prompt in enumerate(prompts):
        start = width - lengths[i]
        assert torch.equal(inputs["input_ids"][i, start:width], prompt["input_ids"])
        assert inputs["attention_mask"][i, :start].sum() == 0 and inputs["attention_mask"][i, start:width].all()
        assert torch.equal(inputs["mm_token_type_ids"][i, start:width], prompt["mm_token_type_ids"])
    assert inputs["input_ids"][0, width:].tolist() == [5, 6, 7]
    assert inputs["input_ids"][1, width].item() == 8 and inputs["attention_mask"][1, width:].tolist() == [1, 0, 0]
    assert inputs["mm_token_type_ids"][:, width:].sum() == 0
    assert torch.equal(inputs["pixel_values"], torch.cat([p["pixel_values"] for p in prompts]))
    assert torch.equal(inputs["image_grid_thw"], torch.cat([p["image_grid_thw"] for p in prompts]))


class _Visual(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(2, 2)


class _Old(nn.Module):  # transformers < 4.52: model.visual
    def __init__(self):
        super().__init__()
        self.visual = _Visual()


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = _Visual()


class _New(nn.Module):  # transformers >= 4.52: model.model.visual
    def __init__(self):
        super().__init__()
        self.model = _Inner()


@pytest.mark.parametrize("layout", [_Old, _New])
def test_vision_tower_is_found_at_either_attribute(adapters, layout):
    module = layout()
    tower = adapters["qwen2_vl"].vision_tower(module)
    assert tower is (module.visual if layout is _Old else module.model.visual)


def test_missing_vision_tower_is_a_clear_error():
    with pytest.raises(AttributeError, match="cannot find the vision tower on Linear: tried model.visual, visual"):
        find_submodule(nn.Linear(1, 1), ("model.visual", "visual"), what="vision tower")


def test_real_models_expose_their_vision_tower(adapters):
    for adapter in adapters.values():
        model = adapter.load_model(dtype=torch.float32, attn_implementation="eager")
        tower = adapter.vision_tower(model)
        assert tower is model.model.visual
        assert adapter.generation_eos_ids(model) == sorted({adapter.tokenizer.convert_tokens_to_ids(t)
                                                            for t in ("<|im_end|>", "<|endoftext|>")})


def test_models_load_without_hub_kernels_so_sampling_and_training_run_one_path(adapters):
    # transformers' default (use_kernels=True) picks hub kernels by the train/eval mode, some only in eval mode, and
    # re-kernelizes on every switch; the plugin samples in eval mode and trains in train mode
    for adapter in adapters.values():
        model = adapter.load_model(dtype=torch.float32, attn_implementation="eager")
        assert not model.use_kernels
        model.train()
        model.eval()
        # transformers 5.24 records the mode it kernelized for; 5.18 (the declared floor) has no such attribute
        assert getattr(model, "kernels_mode", None) is None


def test_every_family_that_refuses_pixel_bounds_says_why():
    """``unused_pixel_bounds`` and ``image_sizes`` have base-class defaults (none; the ids do not say), and a family
    that declares unused bounds overrides ``pixel_bounds_refusal``, whose text ends the plugin's one-line refusal
    (the base raises, naming the adapter, rather than refuse with no reason)."""
    from mmrl.plugins.vlm.adapters.base import VLMAdapter

    assert VLMAdapter.unused_pixel_bounds == ()
    assert VLMAdapter.image_sizes(object.__new__(VLMAdapter), torch.zeros(1, 3, dtype=torch.long)) is None
    declaring = []
    for name in vlm_adapters.names():
        adapter = vlm_adapters.get(name)
        assert set(adapter.unused_pixel_bounds) <= {"min_pixels", "max_pixels"}, name
        if adapter.unused_pixel_bounds:
            declaring.append(name)
            assert adapter.pixel_bounds_refusal is not VLMAdapter.pixel_bounds_refusal, name
    assert {"gemma3", "mistral3"} <= set(declaring)
