"""Package discovery for the one-namespace layout.

plugins/ installs as ``mmrl.plugins`` and rewards/ as ``mmrl.rewards``. ``setuptools.packages.find`` cannot
rename what it finds, so the package list is computed here; everything else lives in pyproject.toml.
"""

from setuptools import find_packages, setup

NAMESPACE_DIRS = {"plugins": "mmrl.plugins", "rewards": "mmrl.rewards"}


def _packages() -> list[str]:
    packages = find_packages(include=["mmrl", "mmrl.*"])
    for folder, dotted in NAMESPACE_DIRS.items():
        for found in find_packages(include=[folder, f"{folder}.*"]):
            packages.append(dotted + found[len(folder) :])
    return sorted(packages)


# Bundled checkpoints and data: plugins/<name>/assets/ (the dLLM toy model) and the shapes world's pipeline folder.
PACKAGE_DATA = {
    "mmrl.plugins": ["*/assets/*"],
    "mmrl.plugins.dllm": ["assets/canvas/*"],  # the toy canvas model (a tiny DiffusionGemma)
    "mmrl.rewards": ["*/assets/*"],
    "mmrl.plugins.flow.shapes": ["assets/*/*", "assets/*/*/*"],
}

setup(packages=_packages(), package_data=PACKAGE_DATA)
