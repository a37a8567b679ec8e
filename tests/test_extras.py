"""Optional dependencies per modality (issue 23 part 6): the extras in pyproject.toml, the module table of
mmrl.extras that names them, the one-line error when one is missing, and a core that trains without any of them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mmrl import extras
from mmrl.cli import main
from mmrl.extras import EXTRAS, MissingExtraError, require_extra

ROOT = Path(__file__).resolve().parents[1]
# import name -> distribution name, for the modules the extras provide
DISTRIBUTION = {"diffusers": "diffusers", "transformers": "transformers", "peft": "peft", "PIL": "pillow",
                "qwen_vl_utils": "qwen-vl-utils", "torchvision": "torchvision", "open_clip": "open_clip_torch",
                "rouge_score": "rouge-score"}


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].lower() for requirement in requirements}


def test_each_extra_declares_the_distributions_of_the_modules_it_is_named_for():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = pyproject["project"]["optional-dependencies"]
    for extra, modules in EXTRAS.items():
        assert _names(declared[extra]) == {DISTRIBUTION[module].lower() for module in modules}, extra
    assert declared["all"] == ["mmrl[flow,vlm,dllm,image-rewards,serve,text-rewards]"] and set(EXTRAS) == {
        "flow", "vlm", "dllm", "image-rewards", "serve", "text-rewards"}
    # The core needs none of them.
    core = _names(pyproject["project"]["dependencies"])
    assert not core & {name.lower() for name in DISTRIBUTION.values()}, core


def test_a_missing_module_names_the_extra_in_one_line(monkeypatch):
    monkeypatch.setattr(extras, "is_installed", lambda module: module != "peft")
    require_extra("flow", "plugin 'flow'", ["diffusers"])  # only what is asked for is checked
    with pytest.raises(MissingExtraError) as raised:
        require_extra("flow", "plugin 'flow'")
    assert str(raised.value) == ("plugin 'flow' needs the module 'peft', which is not installed: "
                                 "pip install 'mmrl[flow]'")
    assert isinstance(raised.value, ImportError)
    with pytest.raises(KeyError, match="unknown extra 'video'"):
        require_extra("video", "x")


def test_the_command_line_prints_the_missing_extra_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(extras, "is_installed", lambda module: module != "diffusers")
    code = main(["train", str(ROOT / "configs" / "flow" / "shapes.yaml"), f"run.output_dir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == ("mmrl: plugin 'flow' needs the module 'diffusers', which is not installed: "
                                 "pip install 'mmrl[flow]'")


def test_the_core_trains_the_toy_without_any_extra(tmp_path):
    """With every extra's modules unimportable (None in sys.modules), the toy plugin trains, evaluates and lists."""
    blocked = sorted({module for modules in EXTRAS.values() for module in modules} | {"open_clip_torch"})
    code = (
        "import sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None\n"
        "from mmrl.cli import main\n"
        f"assert main(['train', 'configs/toy.yaml', 'run.output_dir={tmp_path}', 'run.max_steps=2', "
        "'run.progress=false', 'eval.num_prompts=8', 'run.save_every=0']) == 0\n"
        "assert main(['list']) == 0\n"
        f"assert not [m for m in {blocked!r} if sys.modules.get(m) is not None]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "done: 2 steps" in result.stdout
    # Registries behind a missing extra are listed with the one line instead of failing the listing.
    assert "(unavailable:" not in result.stdout or "pip install 'mmrl[" in result.stdout
