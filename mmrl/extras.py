"""Optional dependencies by modality: ``pip install 'mmrl[flow]'`` and the one-line error when one is missing.

The core (the optimizer, the trainer, the toy plugin and the text rewards) needs torch, accelerate and a few small
packages. Each modality brings its own libraries as a pip extra declared in pyproject.toml; :data:`EXTRAS` lists the
modules each extra provides, and :func:`require_extra` is called by the code that needs them (a plugin module when it
loads, a model-based reward when it is built) so that a missing library ends with one line naming the extra to
install instead of a traceback from deep inside an import::

    mmrl: plugin 'flow' needs the module 'diffusers', which is not installed: pip install 'mmrl[flow]'
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

# extra -> the top-level modules it provides (import names, not distribution names), as pyproject.toml declares.
EXTRAS: dict[str, tuple[str, ...]] = {
    "flow": ("diffusers", "transformers", "peft", "PIL"),
    "vlm": ("transformers", "peft", "qwen_vl_utils", "torchvision", "PIL"),
    "dllm": ("transformers", "peft"),
    "image-rewards": ("open_clip", "transformers", "PIL"),
    "serve": ("PIL",),
    "text-rewards": ("rouge_score",),
}


class MissingExtraError(ImportError):
    """A module of an optional extra is not installed; the message names the extra to install."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def is_installed(module: str) -> bool:
    """Whether the top-level ``module`` can be imported (found on the path, without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # set to None in sys.modules: importing it is refused
        return False


def require_extra(extra: str, user: str, modules: Sequence[str] | None = None) -> None:
    """Raise :class:`MissingExtraError` unless the modules of ``extra`` are installed.

    Args:
        extra: A key of :data:`EXTRAS` (``"flow"``, ``"vlm"``, ``"dllm"``, ``"image-rewards"``, ``"serve"``,
            ``"text-rewards"``).
        user: What needs them, as the message names it (``"plugin 'flow'"``, ``"reward 'clip_score'"``).
        modules: The modules to check (default: every module of the extra).

    Raises:
        MissingExtraError: naming the first missing module and the ``pip install`` command, in one line.
        KeyError: ``extra`` is not a known extra (a programming error).
    """
    if extra not in EXTRAS:
        raise KeyError(f"unknown extra {extra!r}; known: {', '.join(EXTRAS)}")
    for module in EXTRAS[extra] if modules is None else modules:
        if not is_installed(module):
            raise MissingExtraError(f"{user} needs the module {module!r}, which is not installed: "
                                    f"pip install 'mmrl[{extra}]'")


__all__ = ["EXTRAS", "MissingExtraError", "is_installed", "require_extra"]
