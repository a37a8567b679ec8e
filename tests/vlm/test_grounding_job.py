"""The grounding world's job (docs/vlm.md, "The grounding world"): the bundled checkpoint, the pretraining script,
the recipe end to end for a few steps with its report, and the box convention of a Qwen2-VL build through the run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mmrl.plugins.vlm.grounding import model as world_model
from mmrl.plugins.vlm.grounding import world

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINT = ROOT / "plugins" / "vlm" / "grounding" / "assets" / "qwen2_5_vl"
RECIPE = ROOT / "configs" / "vlm" / "grounding.yaml"


def _small_dataset(folder: Path) -> dict[str, Path]:
    return world.write_dataset(folder, train=12, test=6, seed=0)


def _config(model: Path, data: dict[str, Path], run: Path, *overrides: str):
    from mmrl.config import load_config

    return load_config(RECIPE, [f"plugin.model={model}", f"plugin.data.train={data['train']}",
                                f"plugin.data.eval={data['test']}", f"run.output_dir={run}", "run.progress=false",
                                *overrides])


def test_bundled_checkpoint_is_small_and_records_how_it_was_made():
    files = [path for path in CHECKPOINT.rglob("*") if path.is_file()]
    assert sum(path.stat().st_size for path in files) < 10 * 2**20
    record = json.loads((CHECKPOINT / "pretrain.json").read_text())
    # Several stages (docs/vlm.md): a fresh model, then continuations; each records its command, seed and time.
    stages = [record]
    while "previous_stage" in stages[-1]:
        stages.append(stages[-1]["previous_stage"])
    assert len(stages) >= 2
    for stage in stages:
        assert stage["args"]["family"] == "qwen2_5_vl" and "seed" in stage["args"] and stage["seconds"] > 0
    assert all(stage["args"]["init"] is not None for stage in stages[:-1]) and stages[-1]["args"]["init"] is None
    # The bundled model has the world's rotary layout (model.DIMS), and its last stage trained every kind.
    config = json.loads((CHECKPOINT / "config.json").read_text())["text_config"]["rope_parameters"]
    assert config["mrope_section"] == world_model.DIMS["mrope"]
    assert config["rope_theta"] == world_model.DIMS["rope_theta"]
    assert set(record["args"]["kinds"].split(",")) == set(world.KINDS)  # repeats weight a kind
    # Every stage put the question where the recipe puts it: RL continues from the prompts the model learnt on.
    from mmrl.config import load_config

    recipe = load_config(RECIPE, []).plugin.config
    assert {stage["args"]["image_position"] for stage in stages} == {recipe.image_position} == {"after"}
    assert record["model"]["rope_theta"] == config["rope_theta"]  # the record names the model --init held
    last = record["log"][-1]
    # It answers in the format; its held-out grounding is weak (docs/vlm.md gives the numbers).
    assert last["validation/format"] > 0.9 and {"validation/locate", "validation/find", "validation/count"} <= set(last)


def test_pretraining_script_teaches_the_family_convention_and_writes_a_loadable_checkpoint(tmp_path):
    """Two steps of the script for a Qwen2-VL build: the teacher-forced answers are the 0-1000 box tokens, the
    checkpoint loads with the qwen2_vl adapter and pretrain.json records the run."""
    from mmrl.plugins.vlm.adapters import vlm_adapters
    from mmrl.plugins.vlm.grounding import pretrain

    out = tmp_path / "qwen2_vl"
    assert pretrain.main(["--out", str(out), "--family", "qwen2_vl", "--steps", "2", "--batch-size", "3",
                          "--eval-every", "2", "--eval-questions", "3", "--threads", "1", "--log-every", "1"]) == 0
    record = json.loads((out / "pretrain.json").read_text())
    assert [entry["step"] for entry in record["log"]] == [2] and record["args"]["family"] == "qwen2_vl"
    assert set(record["log"][0]) >= {"validation/locate", "validation/find", "validation/count", "validation/format"}
    learner = pretrain.Learner(out, "qwen2_vl")
    assert learner.convention == "qwen2_vl" and vlm_adapters.get("qwen2_vl").box_convention == "qwen2_vl"
    row = learner.rows(world.make_records(1, "train", seed=0))[0]
    assert "<|box_start|>" in world.answer_text(row, learner.convention, row["resized_size"])
    loss = learner.loss([row], [world.record_image(row)])
    assert torch.isfinite(loss) and float(loss.detach()) > 0
    assert not list(tmp_path.glob(".qwen2_vl-*"))  # the staging folders are gone


def test_pretraining_options_select_kinds_scene_sizes_and_model_dims(tmp_path, capsys):
    """--kinds, --max-objects and --dims: the validation has only the chosen kind, the checkpoint's config has the
    chosen rotary base and sections, and a bad kind or --dims with --init stop in one line."""

    from mmrl.plugins.vlm.grounding import pretrain

    out = tmp_path / "locate"
    assert pretrain.main(["--out", str(out), "--kinds", "locate", "--max-objects", "1", "--steps", "1",
                          "--batch-size", "2", "--eval-every", "1", "--eval-questions", "2", "--threads", "1",
                          "--dims", '{"rope_theta": 50.0, "mrope": [8, 4, 4]}', "--image-position", "after",
                          "--subject-loss", "0.5", "--log-every", "1"]) == 0
    record = json.loads((out / "pretrain.json").read_text())
    assert record["args"]["image_position"] == "after"
    assert record["log"][0]["subject_loss"] > 0 and "subject loss" in capsys.readouterr().out
    # --image-position after: the prompts the model learns from hold the question, then the image.
    for position in ("before", "after"):
        learner = pretrain.Learner(out, "qwen2_5_vl", image_position=position)
        row = learner.rows(world.make_records(1, "train", seed=0))[0]
        ids = learner.prompts([row], [world.record_image(row)])[0]["input_ids"].flatten().tolist()
        text = learner.adapter.tokenizer.decode(ids, skip_special_tokens=False)
        vision, question = text.index("<|vision_start|>"), text.index(row["problem"])
        assert (vision < question) == (position == "before")
    assert {key for key in record["log"][0] if key.startswith("validation/")} == {
        "validation/locate", "validation/all", "validation/format"}
    assert record["model"]["rope_theta"] == 50.0
    config = json.loads((out / "config.json").read_text())["text_config"]["rope_parameters"]
    assert config["rope_theta"] == 50.0 and config["mrope_section"] == [8, 4, 4]
    # A continued stage records the sizes of the model it continued (--init's), not model.DIMS.
    assert pretrain.main(["--out", str(tmp_path / "continued"), "--init", str(out), "--kinds", "locate", "--steps",
                          "1", "--batch-size", "2", "--eval-every", "1", "--eval-questions", "1", "--threads", "1",
                          "--image-position", "after"]) == 0
    continued = json.loads((tmp_path / "continued" / "pretrain.json").read_text())
    assert continued["model"] == record["model"] and continued["previous_stage"]["args"] == record["args"]
    # Without a record beside --init the sizes are unknown: none are written (model.DIMS could be wrong).
    (tmp_path / "continued" / "pretrain.json").unlink()
    assert pretrain.main(["--out", str(tmp_path / "unrecorded"), "--init", str(tmp_path / "continued"), "--kinds",
                          "locate", "--steps", "1", "--batch-size", "2", "--eval-every", "1", "--eval-questions", "1",
                          "--threads", "1", "--image-position", "after"]) == 0
    unrecorded = json.loads((tmp_path / "unrecorded" / "pretrain.json").read_text())
    assert unrecorded["model"] is None and "previous_stage" not in unrecorded
    rows = pretrain.training_batch(np.random.default_rng(0), 12, 0, ("locate",), max_objects=1)
    assert all(row["kind"] == "locate" and len(row["objects"]) == 1 for row in rows)
    with pytest.raises(ValueError, match=r"max_objects must be in \[1, 4\], got 0"):
        pretrain.training_batch(np.random.default_rng(0), 1, 0, ("locate",), max_objects=0)
    # --every-object: a locate scene asks about each object alone of its kind, the same image in consecutive rows.
    rows = pretrain.training_batch(np.random.default_rng(0), 40, 0, ("locate", "count"), every_object=True)
    assert len(rows) == 40 and {row["kind"] for row in rows} == {"locate", "count"}
    scenes: dict[int, list[dict]] = {}
    for row in rows:
        if row["kind"] == "locate":
            scenes.setdefault(row["background_seed"], []).append(row)
    assert any(len(asked) > 1 for asked in scenes.values())
    for asked in scenes.values():
        things = world.things_of(asked[0])
        unique = [t for t in things if [u.kind for u in things].count(t.kind) == 1]
        assert len(asked) <= len(unique)  # the batch's last scene may be cut short
        for row in asked:
            assert world.things_of(row) == things  # the same image
            target = [t for t in things if list(t.box) == row["solution"]]
            assert len(target) == 1 and target[0] in unique
            assert row["problem"] == f"Locate the {target[0].color} {target[0].shape}."
            assert row["subject"] == {"color": target[0].color, "shape": target[0].shape}
        assert len({tuple(row["solution"]) for row in asked}) == len(asked)
    for argv, message in ((["--kinds", "locate,where"], "--kinds: unknown kind"),
                          (["--init", str(out), "--dims", "{}"], "--dims applies to a fresh model"),
                          (["--max-objects", "0"], "--max-objects: got 0; allowed: 1 to 4"),
                          (["--subject-loss", "1"], "--subject-loss: the subject loss needs image_position 'after'"),
                          (["--subject-loss", "1", "--image-position", "after", "--subject-layer", "9"],
                           "--subject-loss: subject layer must be in [0, 3], got 9")):
        with pytest.raises(SystemExit):
            pretrain.main(["--out", str(tmp_path / "x"), *argv])
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("which", ["answer", "subject"])
def test_pretraining_stops_in_one_line_when_a_loss_is_not_finite(tmp_path, monkeypatch, which):
    """A NaN answer or subject loss stops the run at that step, naming the loss, before any checkpoint is written."""
    from mmrl.plugins.vlm.grounding import pretrain

    real = pretrain.Learner.losses

    def poisoned(self, rows, images):
        loss, subject = real(self, rows, images)
        if which == "answer":
            return loss * float("nan"), subject
        return loss, subject * float("nan")

    monkeypatch.setattr(pretrain.Learner, "losses", poisoned)
    name = "pretraining loss" if which == "answer" else "subject loss"
    with pytest.raises(FloatingPointError, match=rf"^{name} became nan at step 1$"):
        pretrain.main(["--out", str(tmp_path / "nan"), "--kinds", "locate", "--steps", "2", "--batch-size", "2",
                       "--eval-every", "2", "--eval-questions", "1", "--threads", "1", "--image-position", "after",
                       "--subject-loss", "1"])
    assert not (tmp_path / "nan").exists()


def test_subject_coverage_is_the_share_of_each_token_patch_inside_the_asked_objects():
    """By hand: a 28x28 box at (10, 20) on a 2x2 grid of merged tokens covers 144, 80, 360 and 200 of each token's
    784 pixels; the question's kind selects which objects count (locate: colour and shape, find: shape, count:
    colour), and overlapping boxes saturate at 1."""
    from mmrl.plugins.vlm.grounding.pretrain import subject_coverage

    red_circle = {"color": "red", "shape": "circle", "box": [10, 20, 38, 48]}
    blue_circle = {"color": "blue", "shape": "circle", "box": [28, 28, 56, 56]}
    red_square = {"color": "red", "shape": "square", "box": [0, 0, 56, 56]}
    row = {"kind": "locate", "subject": {"color": "red", "shape": "circle"}, "objects": [red_circle, blue_circle]}
    grid = (1, 4, 4)  # 4x4 patches of 14 pixels: 2x2 merged tokens of 28
    np.testing.assert_allclose(subject_coverage(row, grid), np.array([144, 80, 360, 200]) / 784)
    find = {**row, "kind": "find"}  # every circle: the blue one adds the whole bottom-right token
    np.testing.assert_allclose(subject_coverage(find, grid), [144 / 784, 80 / 784, 360 / 784, 1.0])
    count = {"kind": "count", "subject": {"color": "red", "shape": "circle"},
             "objects": [red_circle, blue_circle, red_square]}  # the red ones: the square covers everything
    np.testing.assert_allclose(subject_coverage(count, grid), np.ones(4))
    assert subject_coverage({**row, "objects": [blue_circle]}, grid).sum() == 0


def test_model_rotary_base_matches_content_at_any_distance_and_the_ramp_gives_position():
    """The world's language model has Qwen2.5-VL's rotary base (1e6): half of its 16 frequencies turn by at most
    1e-3 radians per position, so a match between a word of the question and an image token hardly depends on the
    20-120 positions between them (at the base of 20 the earlier checkpoints had, every frequency turned by at least
    0.06 radians per position, and the question did not bind to the image; docs/vlm.md). Where an image token lies
    is carried by the coordinate ramp instead: across one 28-pixel token of the largest image, red rises by more than
    5 levels left to right and blue top to bottom, the same in every image."""
    from mmrl.plugins.vlm.grounding import model

    half = model.DIMS["hidden"] // model.DIMS["heads"] // 2
    inverse = model.DIMS["rope_theta"] ** (-torch.arange(half, dtype=torch.float64) / half)  # [half] rad/position
    assert int((inverse <= 1.0001e-3).sum()) >= half // 2
    shift = world.ramp(224, 224)  # [H, W, 3]
    red_by_column = shift[0, 14::28, 0]  # [8] at each token's centre
    blue_by_row = shift[14::28, 0, 2]  # [8]
    assert np.all(np.diff(red_by_column) > 5) and np.all(np.diff(blue_by_row) > 5)
    assert np.allclose(shift[..., 1], 0) and np.allclose(shift[5, :, 2], shift[5, 0, 2])


def test_qwen2_vl_build_runs_the_world_in_its_own_convention(tmp_path):
    """The recipe with a Qwen2-VL build: one training step runs, and the run's rewards read the world's exact
    answers in the 0-1000 convention (IoU ~1) while Qwen2.5-VL-style pixel answers score low: a run that read boxes
    in the wrong convention would fail here."""
    from mmrl.plugins.vlm.data import attach_sizes, load_jsonl
    from mmrl.plugins.vlm.grounding import model
    from mmrl.reward import RewardInput
    from mmrl.trainer import Trainer

    built, processor = model.build_model("qwen2_vl", seed=0)
    folder = model.save(built, processor, tmp_path / "qwen2_vl")
    data = _small_dataset(tmp_path / "data")
    config = _config(folder, data, tmp_path / "run", "plugin.family=qwen2_vl", "run.max_steps=1",
                     "rollout.prompts_per_step=2", "rollout.group_size=2", "plugin.max_new_tokens=8",
                     "eval.at_start=false", "eval.num_prompts=2")
    trainer = Trainer(config)
    result = trainer.train()
    assert len(result.history) == 1
    rows = attach_sizes(load_jsonl(data["test"]), trainer.plugin.adapter.resized_size)
    boxes = [row for row in rows if row["kind"] != "count"]
    right = [world.answer_text(row, "qwen2_vl", row["resized_size"]) for row in boxes]
    wrong = [world.answer_text(row, "qwen2_5_vl", row["resized_size"]) for row in boxes]
    index = trainer.scorer.names.index("grounding_world")
    scores = trainer.scorer.score(RewardInput(rows=boxes, payload={"completions": right})).scores[:, index]
    mixed = trainer.scorer.score(RewardInput(rows=boxes, payload={"completions": wrong})).scores[:, index]
    assert float(scores.min()) > 0.8 and float(mixed.mean()) < 0.5, (scores, mixed)


@pytest.mark.slow  # about a minute on 2 shared cores: 3 GRPO steps of 16 samples, two evaluations of 6 questions
def test_short_job_from_the_bundled_checkpoint_trains_and_reports(tmp_path, capsys):
    """The recipe, short: three steps from the bundled checkpoint on 12 training questions. The first mini-batch of
    every step is on policy (ratio 1), the weights move, the evaluations run before and after, and the report
    writes the per-kind scores, the grid and the reward curve; `mmrl eval` of the trained checkpoint on other
    held-out questions is reported beside them."""
    from mmrl.plugins.vlm.grounding import report
    from mmrl.trainer import Trainer

    data = _small_dataset(tmp_path / "data")
    run = tmp_path / "run"
    config = _config(CHECKPOINT, data, run, "run.max_steps=3", "rollout.prompts_per_step=2",
                     "rollout.group_size=8", "eval.every=0", "eval.num_prompts=6")
    trainer = Trainer(config)
    before = {name: value.detach().clone() for name, value in trainer.policy.named_parameters() if value.requires_grad}
    result = trainer.train()
    assert sorted(result.evaluations) == [0, 3]
    assert all(record["loss/first_step_ratio_deviation"] < 1e-4 for record in result.history)
    assert any(record["reward/mean"] > 0 for record in result.history)  # the pretrained model scores
    moved = [name for name, value in trainer.policy.named_parameters() if value.requires_grad
             and not torch.equal(value.detach(), before[name])]
    assert moved, "no trainable weight changed"
    summary = report.report(run)
    assert summary["convention"] == "qwen2_5_vl" and summary["steps"] == 3
    assert summary["questions"] == {"locate": 2, "find": 2, "count": 2}
    assert set(summary["held_out_before"]) == {"locate", "find", "count", "all", "format"}
    assert summary["held_out_before"]["format"] > 0.5
    for when in ("before", "after"):
        by_objects = summary[f"locate_by_objects_{when}"]
        assert sum(questions for questions, _ in by_objects.values()) == 2
        locate = summary[f"held_out_{when}"]["locate"]
        assert sum(q * mean for q, mean in by_objects.values()) / 2 == pytest.approx(locate)
    for name in ("grid.png", "reward_curve.png", "summary.json"):
        assert (run / name).stat().st_size > 0

    # `mmrl eval` of the trained checkpoint on other held-out questions (plugin.data.eval is evaluation only, so the
    # checkpoint resumes): the report then also scores that evaluation per kind, on the other questions' rows.
    other = world.write_dataset(tmp_path / "other", train=3, test=9, seed=5)
    Trainer(_config(CHECKPOINT, {**data, "test": other["test"]}, run, "run.max_steps=3", "rollout.prompts_per_step=2",
                    "rollout.group_size=8", "eval.every=0", "eval.num_prompts=9", "run.resume=latest")
            ).evaluate_checkpoint()
    assert report.main([str(run)]) == 0
    printed = capsys.readouterr().out
    assert "held-out grounding world (qwen2_5_vl boxes)" in printed
    assert "evaluation at step 3 (" in printed and "step-00000003" in printed
    entry = json.loads((run / "evaluations.json").read_text())["evaluations"]["3"]
    assert entry["questions"] == {"locate": 3, "find": 3, "count": 3}


def test_report_refuses_a_folder_that_is_not_a_run_in_one_line(tmp_path, capsys):
    """A folder with neither a training log nor `mmrl eval`'s answers: the report names what is missing instead
    of a traceback."""
    from mmrl.plugins.vlm.grounding import report

    (tmp_path / "evaluations.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit):
        report.main([str(tmp_path)])
    assert "neither a training run folder (no config.yaml or metrics.jsonl)" in capsys.readouterr().err
    (tmp_path / "evaluations").mkdir()  # `mmrl eval` output without answers
    with pytest.raises(SystemExit):
        report.main([str(tmp_path)])
    assert "no evaluation answers under evaluations/step_*/eval.jsonl" in capsys.readouterr().err


def test_report_scores_mmrl_eval_output_per_kind(tmp_path, capsys):
    """`mmrl eval` of the bundled checkpoint on 6 questions: the report scores its saved answers per kind, the
    same as scoring them directly with the world's reward, and names the policy evaluated."""
    from mmrl.plugins.vlm.grounding import report
    from mmrl.trainer import Trainer

    data = _small_dataset(tmp_path / "data")
    run = tmp_path / "eval"
    Trainer(_config(CHECKPOINT, data, run, "eval.num_prompts=6")).evaluate_checkpoint()
    assert not (run / "metrics.jsonl").exists()
    assert report.main([str(run)]) == 0
    printed = capsys.readouterr().out
    assert "evaluation at step 0 (initial policy; qwen2_5_vl boxes)" in printed
    summary = json.loads((run / "evaluations.json").read_text())
    entry = summary["evaluations"]["0"]
    assert entry["questions"] == {"locate": 2, "find": 2, "count": 2}
    answers = (run / "evaluations" / "step_000000" / "eval.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in answers]
    assert entry["convention"] == "qwen2_5_vl"
    rows = report.evaluation_rows(run / "evaluations" / "step_000000")[:6]
    assert entry["held_out"] == report.kind_means(rows, [r["output"] for r in records], "qwen2_5_vl")
    assert 0.0 <= entry["held_out"]["all"] <= 1.0 and entry["held_out"]["format"] > 0.5
    # The locate questions split by their image's object count: as many questions, and the same mean IoU.
    by_objects = entry["locate_by_objects"]
    assert sum(questions for questions, _ in by_objects.values()) == entry["questions"]["locate"]
    weighted = sum(questions * mean for questions, mean in by_objects.values()) / entry["questions"]["locate"]
    assert weighted == pytest.approx(entry["held_out"]["locate"])
    locate = [i for i, row in enumerate(rows) if row["kind"] == "locate"]
    for count, (questions, mean) in by_objects.items():
        members = [i for i in locate if len(rows[i]["objects"]) == int(count)]
        assert questions == len(members)
        scores = report.sample_scores([rows[i] for i in members], [records[i]["output"] for i in members],
                                      "qwen2_5_vl")
        assert mean == pytest.approx(sum(scores) / len(scores))
    assert "locate by objects in the image: " in printed
