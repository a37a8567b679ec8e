"""One import namespace in both install modes: plugins/ as mmrl.plugins and rewards/ as mmrl.rewards.

Each install is made from a copy of the tracked files into a scratch location (a --target folder, or a scratch
virtual environment for the editable install), and imported by a child interpreter that cannot see the
development install of this checkout.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = (
    "import mmrl, mmrl.plugins, mmrl.rewards, mmrl.plugins.toy, mmrl.rewards.text_match\n"
    "from mmrl.plugin import plugin_registry\n"
    "from mmrl.rewards import reward_functions\n"
    "assert 'toy' in plugin_registry and 'token_accuracy' in reward_functions\n"
    "from pathlib import Path\n"
    "plugins = Path(mmrl.plugins.__file__).parent\n"
    "for asset in ('dllm/assets/model.safetensors', 'flow/shapes/assets/data/test_metadata.jsonl',\n"
    "              'flow/shapes/assets/pipeline/transformer/diffusion_pytorch_model.safetensors'):\n"
    "    assert (plugins / asset).is_file(), f'bundled asset missing from the install: {asset}'\n"
    "print(mmrl.__file__); print(mmrl.plugins.__file__); print(mmrl.rewards.__file__)\n"
)


def _copy_sources(destination: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:
        source = ROOT / name
        if source.is_file() and not name.startswith(("tests/", "docs/", "benchmarks/")):
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


def _probe(python: str, prepend: list[str], append: list[str], cwd: Path) -> list[str]:
    """Import the namespace with ``python``. ``append`` supplies torch & co. after the interpreter's own
    site-packages (appended at run time, so its .pth files and editable finders are never read)."""
    code = f"import sys\nsys.path[:0] = {prepend!r}\nsys.path.extend({append!r})\n" + PROBE
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([python, "-c", code], cwd=cwd, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["regular", "editable"])
def test_install_maps_plugins_and_rewards_into_mmrl(tmp_path, mode):
    source = _copy_sources(tmp_path / "src")
    dependencies = sysconfig.get_paths()["purelib"]  # this environment's packages, read without its .pth files
    if mode == "regular":
        # --target never touches this environment's own mmrl install.
        target = tmp_path / "site"
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
                        "--target", str(target), str(source)], check=True, capture_output=True)
        files = _probe(sys.executable, [str(target)], [], cwd=tmp_path)
        root, plugins, rewards = target / "mmrl", target / "mmrl" / "plugins", target / "mmrl" / "rewards"
    else:
        # A scratch venv so the editable install cannot replace this one; pip fetches the build backend
        # (setuptools, wheel) from the package index as a user's `pip install -e .` would.
        venv = tmp_path / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
        python = str(venv / "bin" / "python")
        subprocess.run([python, "-m", "pip", "install", "--no-deps", "--quiet", "-e", str(source)], check=True,
                       capture_output=True)
        files = _probe(python, [], [dependencies], cwd=tmp_path)
        root, plugins, rewards = source / "mmrl", source / "plugins", source / "rewards"
    assert list(map(Path, files)) == [root / "__init__.py", plugins / "__init__.py", rewards / "__init__.py"]
