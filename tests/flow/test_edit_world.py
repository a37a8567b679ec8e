"""The edit world (docs/shapes.md#the-edit-world): edits of the shapes world's scenes, their rendering and split,
the committed dataset and editing checkpoint, the pretraining script, and the recipe's short version (Flow-GRPO
steps on the bundled FLUX.1 Kontext model through the flux_kontext adapter)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mmrl.plugins.flow.shapes import edits, world
from mmrl.plugins.flow.shapes.sampling import score

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "plugins" / "flow" / "shapes" / "assets"
EDIT_PIPELINE = ASSETS / "edit_pipeline"
EDIT_DATA = ASSETS / "edit_data"


def _pixels(arrays):
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255


# ------------------------------------------------------------------------------------------------ edits
def test_instructions_and_edited_scenes():
    scene = world.make_row("position", [("red", "circle", 1), ("blue", "square", 1)], "above")
    by_prompt = {edits.instruction(edit): edits.apply_edit(scene, edit) for edit in edits.scene_edits(scene)}
    # 3 colours for each object, the one shape neither object has for each, one swap
    assert len(by_prompt) == 3 + 3 + 1 + 1 + 1
    assert by_prompt["make the circle green"]["prompt"] == "a green circle above a blue square"
    assert by_prompt["make the square a triangle"]["prompt"] == "a red circle above a blue triangle"
    assert by_prompt["swap the circle and the square"]["prompt"] == "a red circle below a blue square"
    assert "make the circle a square" not in by_prompt  # two squares: "the square" would name neither
    single = world.make_row("single_object", [("red", "circle", 1)])
    assert {edits.instruction(e) for e in edits.scene_edits(single) if e["kind"] == "reshape"} == \
        {"make the circle a square", "make the circle a triangle"}
    with pytest.raises(ValueError, match="edits single_object, two_object, position scenes, not 'counting'"):
        edits.scene_edits(world.make_row("counting", [("red", "circle", 2)]))
    for row in edits.all_edits()["train"][:50]:
        assert set(row["prompt"].split()) <= set(edits.WORDS)


def test_rendered_edits_satisfy_their_rows_and_wrong_edits_do_not():
    """Every edit of every scene kind, on random layouts: the input scores 1 against the input scene, the edited
    rendering 1 against the edit row (so edited_layout draws what apply_edit describes), and a wrong target
    (unchanged, other object, other value) never gets every requirement right."""
    rng = np.random.default_rng(0)
    rows = edits.all_edits()
    picked = [row for side in rows.values() for row in side[::7]]
    assert {row["task"] for row in picked} == set(edits.EDITS)
    sources, targets, wrong, kinds = [], [], [], set()
    for row in picked:
        source, target = edits.render_pair(row["source_row"], row["edit"], rng)
        sources.append(source)
        targets.append(target)
        bad = edits.wrong_edit(row["source_row"], row["edit"], rng)
        kinds.add("unchanged" if bad is None else "other_object" if bad["object"] != row["edit"]["object"]
                  else "other_value")
        wrong.append(edits.render_pair(row["source_row"], bad, rng)[1])
    assert kinds == set(edits.WRONG_EDITS)
    assert torch.all(score([row["source_row"] for row in picked], _pixels(sources)) == 1)
    assert torch.all(score(picked, _pixels(targets)) == 1)
    assert torch.all(score(picked, _pixels(wrong), strict=True) == 0)
    assert torch.all(score(picked, _pixels(sources), strict=True) == 0)  # doing nothing is never the edit


def test_swaps_exchange_places_and_keep_sizes():
    rng = np.random.default_rng(3)
    scene = world.make_row("position", [("red", "circle", 1), ("blue", "triangle", 1)], "left of")
    edit = edits.scene_edits(scene)[-1]
    placed = world.layout(scene, rng)
    swapped = edits.edited_layout(placed, edit)
    assert (swapped[0].cx, swapped[0].cy, swapped[0].size) == (placed[1].cx, placed[1].cy, placed[0].size)
    assert world.relation_holds("right of", swapped[0], swapped[1])


def test_held_out_scenes_never_occur_in_training_edits():
    training = {row["prompt"] for row in world.training_rows()}
    rows = edits.all_edits()
    for row in rows["train"]:
        assert row["source"] in training and world.prompt_text(row) in training
    assert all(row["source"] not in training for row in rows["held_out"])
    files = edits.split()
    assert [len(files["train"]), len(files["test"])] == [3 * edits.TRAIN_PER_EDIT, 3 * edits.TEST_PER_EDIT]
    for name in files:
        kinds = [row["task"] for row in files[name]]
        assert {kind: kinds.count(kind) for kind in edits.EDITS} == \
            dict.fromkeys(edits.EDITS, len(kinds) // 3)


def test_dataset_files_are_the_committed_ones(tmp_path):
    written = edits.write_dataset(tmp_path)
    for name in ("train", "test"):
        committed = (EDIT_DATA / f"{name}_metadata.jsonl").read_text()
        assert (written / f"{name}_metadata.jsonl").read_text() == committed, \
            f"{name}: regenerate with python -m mmrl.plugins.flow.shapes.edits {EDIT_DATA}"
        for line in committed.splitlines():
            row = json.loads(line)
            ours, theirs = written / row["image"], EDIT_DATA / row["image"]
            from PIL import Image

            with Image.open(ours) as a, Image.open(theirs) as b:
                assert np.array_equal(np.asarray(a), np.asarray(b)), row["image"]


# ------------------------------------------------------------------------------------------------ the reward
def _edit_scores(rows, images, **options):
    from mmrl.reward import RewardInput
    from mmrl.rewards.shape_edits import ShapeEditReward

    return ShapeEditReward(**options)(RewardInput(rows=list(rows), payload={"images": _pixels(images)}))


def test_shape_edit_scores_the_edit_times_what_was_kept():
    """Hand-computed cases on exact renderings: the right edit scores 1, the input left unchanged 0 for every kind
    of edit, and a recolour done right whose other object came out in the wrong colour 1 × 1/2 (the kept
    requirements are both objects' counts, met, the other's colour and the relation, which needs both objects
    matched: not met)."""
    rng = np.random.default_rng(0)
    scene = world.make_row("position", [("red", "circle", 1), ("blue", "square", 1)], "above")
    placed = world.layout(scene, rng)
    rows, images = [], []
    for edit in edits.scene_edits(scene):
        row = {"prompt": edits.instruction(edit), **edits.edit_row(scene, edit)}
        rows += [row, row]
        images += [world.render(edits.edited_layout(placed, edit)), world.render(placed)]
    scores = _edit_scores(rows, images)
    assert scores[0::2].tolist() == [1.0] * (len(rows) // 2)  # the edit, done
    assert scores[1::2].tolist() == [0.0] * (len(rows) // 2)  # the input, unchanged
    recolour = next(row for row in rows if row["prompt"] == "make the circle green")
    wrong_other = edits.edited_layout(edits.edited_layout(placed, recolour["edit"]),
                                      {"kind": "recolor", "object": 1, "value": "yellow"})
    assert _edit_scores([recolour], [world.render(wrong_other)]).item() == pytest.approx(1 / 2)
    assert _edit_scores([recolour], [world.render(wrong_other)], strict=True).item() == 0.0
    swap = next(row for row in rows if row["edit"]["kind"] == "swap")
    assert _edit_scores([swap], [world.render(edits.edited_layout(placed, swap["edit"]))], strict=True).item() == 1.0
    single = world.make_row("single_object", [("red", "circle", 1)])
    edit = edits.scene_edits(single)[0]  # make the circle green: nothing else to keep, kept = 1
    row = edits.edit_row(single, edit)
    assert _edit_scores([row], [world.render(edits.edited_layout(world.layout(single, rng), edit))]).item() == 1.0


def test_shape_edit_refuses_rows_without_an_edit():
    from mmrl.reward import RewardError

    scene = world.make_row("two_object", [("red", "circle", 1), ("blue", "square", 1)])
    blank = np.full((32, 32, 3), 255, dtype=np.uint8)
    with pytest.raises(RewardError, match=r"reward 'shape_edit': dataset row 0 \('a red circle and a blue square'\) "
                                          r"has no 'edit' with a kind in"):
        _edit_scores([scene], [blank])
    row = edits.edit_row(scene, edits.scene_edits(scene)[0])
    with pytest.raises(RewardError, match="needs an 'object' index into its 2 objects"):
        _edit_scores([{**row, "edit": {**row["edit"], "object": 2}}], [blank])
    assert _edit_scores([row], [blank]).item() == 0.0  # an empty image is scored, not raised on
    position = world.make_row("position", [("red", "circle", 1), ("blue", "square", 1)], "above")
    swap = edits.edit_row(position, edits.scene_edits(position)[-1])
    with pytest.raises(RewardError, match="a swap needs the edited scene's 'relation'"):
        _edit_scores([{**swap, "relation": None}], [blank])
    from mmrl.reward import RewardInput
    from mmrl.rewards.shape_edits import ShapeEditReward

    empty = ShapeEditReward()(RewardInput(rows=[], payload={"images": torch.zeros(0, 3, 32, 32)}))
    assert empty.shape == (0,)  # an empty batch scores nothing
    nan = torch.full((1, 3, 32, 32), float("nan"))  # non-finite pixels score NaN, as every image reward
    assert torch.isnan(ShapeEditReward()(RewardInput(rows=[row], payload={"images": nan}))).all()


# ------------------------------------------------------------------------------------------------ the model
def test_tokenizers_know_every_instruction_word():
    from mmrl.plugins.flow.shapes.model import word_t5_tokenizer, word_tokenizer

    clip, t5 = word_tokenizer(12, edits.WORDS), word_t5_tokenizer(12, edits.WORDS)
    for word in edits.WORDS:
        assert clip.tokenize(word) == [word + "</w>"]
        assert t5.tokenize(word) == ["\u2581" + word]


def test_encoded_latents_reads_both_kinds_of_vae_output():
    """The image-conditioned adapters read a VAE's deterministic latents as diffusers' retrieve_latents(argmax): the
    posterior's mode (AutoencoderKL) or the encoder's latents (AutoencoderTiny); anything else is refused."""
    from types import SimpleNamespace

    from mmrl.plugins.flow.adapters.base import encoded_latents

    mode = torch.randn(1, 4, 2, 2)
    posterior = SimpleNamespace(latent_dist=SimpleNamespace(mode=lambda: mode))
    assert encoded_latents(posterior, torch.nn.Identity()) is mode
    tiny = SimpleNamespace(latents=mode)
    assert encoded_latents(tiny, torch.nn.Identity()) is mode
    with pytest.raises(TypeError, match="Identity.encode returned tuple, which has neither 'latent_dist' nor"):
        encoded_latents((mode,), torch.nn.Identity())


def test_sampler_is_the_kontext_pipeline_ode():
    """The edit world's sampler (pretraining evaluations) draws what FluxKontextPipeline.__call__ draws from the same
    input image, instruction and noise (no guidance; the pipeline given max_area = 32² keeps the world's size)."""
    from PIL import Image

    from mmrl.plugins.flow.shapes.edit_model import build_edit_pipeline, sample_edits

    pipeline = build_edit_pipeline(seed=1)
    rows = edits.split()["test"][::16]
    rng = np.random.default_rng(0)
    sources = [edits.render_pair(row["source_row"], row["edit"], rng)[0] for row in rows]
    mine = sample_edits(pipeline, [row["prompt"] for row in rows], _pixels(sources), num_steps=3, seed=7)
    for k, (row, source) in enumerate(zip(rows, sources, strict=True)):
        with torch.no_grad():
            theirs = pipeline(prompt=row["prompt"], image=Image.fromarray(source), height=32, width=32,
                              max_area=32 * 32, _auto_resize=False, num_inference_steps=3, guidance_scale=1.0,
                              max_sequence_length=12, generator=torch.Generator().manual_seed(7 + k),
                              output_type="pt").images
        torch.testing.assert_close(mine[k:k + 1], theirs, rtol=0, atol=1e-5)


def test_committed_checkpoint_loads_in_the_flow_plugin_as_kontext():
    from mmrl.config import from_dict
    from mmrl.plugin import Runtime
    from mmrl.plugins.flow.plugin import FlowPlugin, FlowPluginConfig

    files = sorted(p.relative_to(EDIT_PIPELINE).as_posix() for p in EDIT_PIPELINE.rglob("*") if p.is_file())
    assert "model_index.json" in files and "transformer/diffusion_pytorch_model.safetensors" in files
    assert sum((EDIT_PIPELINE / f).stat().st_size for f in files) < 8 * 2**20
    config = from_dict(FlowPluginConfig, {"model": str(EDIT_PIPELINE), "dataset": str(EDIT_DATA), "resolution": 32,
                                          "max_sequence_length": 12}, "plugin")
    plugin = FlowPlugin(config, Runtime())
    assert plugin.adapter.name == "flux_kontext" and plugin.adapter.vae_scale_factor == 4
    train, held_out = plugin.dataset("train"), plugin.dataset("eval")
    assert len(train) == 144 and len(held_out) == 48 and Path(held_out[0]["image"]).is_file()
    # the autoencoder is the shapes world's, bit for bit
    from diffusers import AutoencoderTiny

    shapes_vae = AutoencoderTiny.from_pretrained(ASSETS / "pipeline" / "vae")
    for (name, mine), theirs in zip(plugin.adapter.vae.state_dict().items(), shapes_vae.state_dict().values(),
                                    strict=True):
        assert torch.equal(mine, theirs), name


def test_committed_checkpoint_edits_part_of_the_time():
    """The pretrained model leaves RL room: on the held-out rows (2 samples each) it gets an edit entirely right
    about a quarter of the time (0.240 here) and earns a shape_edit score of 0.272 (doing nothing scores 0; the
    input images score 0.614 by the partial credit of ``shapes``, which a copy of them would earn)."""
    from diffusers import FluxKontextPipeline

    from mmrl.plugins.flow.shapes.edit_model import read_images, sample_edits
    from mmrl.reward import RewardInput
    from mmrl.rewards.shape_edits import ShapeEditReward

    rows = [json.loads(line) for line in (EDIT_DATA / "test_metadata.jsonl").read_text().splitlines()]
    pipeline = FluxKontextPipeline.from_pretrained(EDIT_PIPELINE)
    repeated = [row for row in rows for _ in range(2)]
    images = read_images(rows, EDIT_DATA).repeat_interleave(2, dim=0)
    edited = sample_edits(pipeline, [row["prompt"] for row in repeated], images, num_steps=20, seed=10_000)
    strict = ShapeEditReward(strict=True)(RewardInput(rows=repeated, payload={"images": edited})).mean().item()
    partial = ShapeEditReward()(RewardInput(rows=repeated, payload={"images": edited})).mean().item()
    assert 0.1 < strict < 0.5, strict
    assert strict <= partial < 0.5, (strict, partial)
    assert score(repeated, images).mean().item() == pytest.approx(0.614, abs=1e-3)


def test_pretraining_script_writes_a_loadable_pipeline_and_continues_from_it(tmp_path):
    from diffusers import FluxKontextPipeline

    from mmrl.plugins.flow.shapes import edit_pretrain

    quick = ["--steps", "2", "--batch-size", "4", "--eval-every", "0", "--eval-steps", "1", "--eval-samples", "1",
             "--threads", "1", "--no-progress", "--log-every", "0"]
    first, second = tmp_path / "stage1", tmp_path / "stage2"
    assert edit_pretrain.main(["--out", str(first), *quick]) == 0
    assert edit_pretrain.main(["--out", str(second), "--init", str(first), "--wrong-edits", "0.5", *quick]) == 0
    record = json.loads((second / "pretrain.json").read_text())
    assert record["command"].startswith("python -m mmrl.plugins.flow.shapes.edit_pretrain --out")
    assert record["args"]["wrong_edits"] == 0.5 and record["model"]["double_layers"] == 2
    assert record["previous_stage"]["args"]["wrong_edits"] == 0.0
    assert [entry["step"] for entry in record["log"]] == [2] and "held_out/swap" in record["log"][0]
    pipeline = FluxKontextPipeline.from_pretrained(second)
    assert pipeline.transformer.config.in_channels == 32 and not pipeline.transformer.config.guidance_embeds
    with pytest.raises(SystemExit, match="no pretrain.json"):
        edit_pretrain.main(["--out", str(tmp_path / "x"), "--init", str(tmp_path), *quick])
    with pytest.raises(SystemExit, match="wrong-edits"):
        edit_pretrain.main(["--out", str(tmp_path / "x"), "--wrong-edits", "1.5", *quick])
    with pytest.raises(SystemExit, match="no test_metadata.jsonl"):
        edit_pretrain.main(["--out", str(tmp_path / "x"), "--data", str(tmp_path), *quick])


# ------------------------------------------------------------------------------------------------ the recipe, short
@pytest.mark.slow  # 20-40 s on 2 cores (20 training steps of the edit pipeline, then the scoring)
def test_short_edit_job_trains_on_policy_and_reports(tmp_path):
    """The recipe, short: 20 steps (constant learning rate) on eight training edits, evaluated on the same edits × 8
    samples before and after. The first mini-batch of every step is on policy (ratio 1), the LoRA moves, the
    shape_edit score rises by more than 0.1 (seed 0: 0.273 -> 0.574; seeds 1 and 2 gave 0.255 -> 0.635 and
    0.180 -> 0.685), and the report writes the score per kind of edit, the input|edit grids, the reward curve
    and the unchanged inputs' score."""
    import shutil

    from mmrl.config import load_config
    from mmrl.plugins.flow.shapes import report
    from mmrl.trainer import Trainer

    data = tmp_path / "data"
    (data / "images").mkdir(parents=True)
    rows = [json.loads(line) for line in (EDIT_DATA / "train_metadata.jsonl").read_text().splitlines()][::18]
    for row in rows:
        shutil.copyfile(EDIT_DATA / row["image"], data / row["image"])
    (data / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = tmp_path / "run"
    config = load_config(ROOT / "configs" / "flow" / "shapes_edit.yaml", [
        f"plugin.dataset={data / 'rows.jsonl'}", f"plugin.eval_dataset={data / 'rows.jsonl'}",
        f"run.output_dir={run}", "run.max_steps=20", "run.seed=0", "run.save_every=0", "run.progress=false",
        "optim.scheduler=constant", "eval.every=0", "eval.samples_per_prompt=8",
    ])
    trainer = Trainer(config)
    assert trainer.plugin.adapter.name == "flux_kontext"
    before = {name: value.detach().clone() for name, value in trainer.policy.named_parameters() if value.requires_grad}
    result = trainer.train()
    start, end = result.evaluations[0]["eval/reward_mean"], result.evaluations[20]["eval/reward_mean"]
    assert end > start + 0.1, f"score on the training edits {start:.3f} -> {end:.3f} in 20 steps"
    moved = [name for name, value in trainer.policy.named_parameters() if value.requires_grad
             and not torch.equal(value.detach(), before[name])]
    assert moved, "no trainable weight changed"
    assert all(record["loss/first_step_ratio_deviation"] < 1e-4 for record in result.history)
    summary = report.report(run)
    assert summary["world"] == "edit"
    assert summary["held_out_before"]["all"] == pytest.approx(start)
    assert summary["held_out_after"]["all"] == pytest.approx(end)
    assert set(summary["held_out_before"]) == {"recolor", "reshape", "swap", "all"}
    assert set(summary["unchanged_inputs"]) == {"recolor", "reshape", "swap", "all"}
    for name in ("reward_curve.png", "grid_before.png", "grid_after.png", "summary.json"):
        assert (run / name).stat().st_size > 0
