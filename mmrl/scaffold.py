"""``mmrl new-plugin NAME``: scaffold an installable plugin package that passes the conformance kit and trains.

The package holds a working plugin (a tiny categorical policy on a counting task, the smallest thing that exercises
the whole contract), its config section, a recipe, and a test that runs :func:`mmrl.testing.check_plugin`::

    mmrl-NAME/
        pyproject.toml          the distribution, with the mmrl.plugins entry point NAME
        README.md
        mmrl_NAME/__init__.py
        mmrl_NAME/plugin.py     the config section and the plugin: replace the model, task and sampling with yours
        configs/NAME.yaml       a recipe: `mmrl train configs/NAME.yaml`
        tests/test_plugin.py    check_plugin, and the recipe loads through the entry point

``pip install -e mmrl-NAME`` registers the plugin; ``pytest mmrl-NAME`` runs the kit.
"""

from __future__ import annotations

import keyword
import re
from pathlib import Path

NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,39}")


class ScaffoldError(ValueError):
    """A name or destination ``mmrl new-plugin`` refuses (one line: what was wrong and what is allowed)."""


def new_plugin(name: str, directory: str | Path | None = None) -> Path:
    """Write a new plugin package for ``name`` into ``directory`` and return that folder.

    Args:
        name: The plugin's registry name (``plugin.name`` in configs): a lowercase Python identifier, at most 40
            characters, that no installed plugin uses. The import package is ``mmrl_<name>``, the distribution
            ``mmrl-<name>`` (underscores become hyphens).
        directory: The folder to create (default: ``./mmrl-<name>``); it must not exist.

    Returns:
        The package folder.

    Raises:
        ScaffoldError: The name is not allowed or the folder exists.
    """
    from mmrl.plugin import plugin_registry

    if not NAME_PATTERN.fullmatch(name) or keyword.iskeyword(name) or name.endswith("_"):
        raise ScaffoldError(f"plugin name {name!r} is not allowed: use a lowercase Python identifier of at most 40 "
                            "characters (a-z, 0-9 and _, starting with a letter, not ending with _), e.g. my_modality")
    if name in plugin_registry.names():
        raise ScaffoldError(f"plugin name {name!r} is taken by an installed plugin (installed: "
                            f"{', '.join(plugin_registry.names())}); choose another name")
    distribution = "mmrl-" + name.replace("_", "-")
    root = Path(directory) if directory is not None else Path.cwd() / distribution
    if root.exists():
        raise ScaffoldError(f"{root} already exists: choose another --dir (new-plugin never writes into an existing "
                            "folder)")
    package = f"mmrl_{name}"
    values = {"{{name}}": name, "{{package}}": package, "{{distribution}}": distribution,
              "{{Camel}}": "".join(part.capitalize() for part in name.split("_") if part)}
    files = {
        "pyproject.toml": PYPROJECT,
        "README.md": README,
        f"{package}/__init__.py": INIT,
        f"{package}/plugin.py": PLUGIN,
        f"configs/{name}.yaml": RECIPE,
        "tests/test_plugin.py": TEST,
    }
    for relative, template in files.items():
        text = template
        for placeholder, value in values.items():
            text = text.replace(placeholder, value)
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


PYPROJECT = '''\
[build-system]
requires = ["setuptools>=69"]
build-backend = "setuptools.build_meta"

[project]
name = "{{distribution}}"
version = "0.1.0"
description = "The {{name}} modality plugin for mmrl"
readme = "README.md"
requires-python = ">=3.10"
dependencies = ["mmrl", "torch"]

[project.optional-dependencies]
test = ["pytest>=8"]

# How mmrl finds the plugin: `plugin: {name: {{name}}}` in a config, and `mmrl list`.
[project.entry-points."mmrl.plugins"]
{{name}} = "{{package}}.plugin:{{Camel}}Plugin"

[tool.setuptools]
packages = ["{{package}}"]

[tool.pytest.ini_options]
testpaths = ["tests"]
'''

README = '''\
# {{distribution}}

The `{{name}}` plugin for mmrl (scaffolded by `mmrl new-plugin {{name}}`). It trains a tiny categorical policy
to count up from a prompt token: replace the model, the task and the sampling in `{{package}}/plugin.py` with
your modality's, keeping the tests green.

```
pip install -e .                 # registers the plugin (entry point mmrl.plugins: {{name}})
pytest                           # mmrl.testing.check_plugin: every property of the plugin contract
mmrl train configs/{{name}}.yaml
```

docs/plugins.md in mmrl describes the contract and what `check_plugin` checks.
'''

INIT = '''\
"""The {{name}} modality plugin for mmrl."""

from {{package}}.plugin import {{Camel}}Config, {{Camel}}Plugin

__all__ = ["{{Camel}}Config", "{{Camel}}Plugin"]
'''

PLUGIN = '''\
"""The {{name}} plugin: a tiny categorical policy that learns to count up from a prompt token.

Scaffolded by ``mmrl new-plugin {{name}}`` as a starting point: it honours the whole plugin contract
(``mmrl.testing.check_plugin`` passes) and learns within a few dozen steps on a CPU. Replace the model, the task and
the sampling with your modality's. How it maps onto the rollout contract:

- an action is one answer token, A = ``length``; every action is trained (mask of ones);
- ``payload["completions"]`` holds the answer as text, scored by mmrl's ``token_accuracy`` reward against the row's
  ``"solution"``;
- ``replay`` holds the prompt and the sampled tokens, enough for :meth:`forward` to recompute every log-prob;
- ``old_logp`` is left None: the core computes it with :meth:`forward` when a run needs it;
- each sample draws its noise from its own seed (``PromptBatch.sample_generators``), so a sample does not depend on
  the batch it is in;
- the reference policy of the KL term comes from ``mmrl.policy``: a frozen copy of the initial weights
  (``frozen_copy``), kept only when the run needs it; ``reference_policy`` hands it out (or, once you attach a LoRA
  adapter with ``attach_lora``, the policy with its adapter switched off).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from mmrl.config import config_field
from mmrl.plugin import Plugin, PolicyOutput, PromptBatch, Runtime
from mmrl.policy import frozen_copy, reference_policy
from mmrl.rollout import Rollout
from torch import Tensor, nn


@dataclass
class {{Camel}}Config:
    """The ``plugin:`` section of the {{name}} plugin (``mmrl explain --plugin {{name}}`` shows it)."""

    vocab_size: int = config_field(8, minimum=2, help="Tokens 0..vocab_size-1 that prompts and answers use.")
    length: int = config_field(3, minimum=1, help="Tokens per answer: the action axis A.")
    hidden_size: int = config_field(32, minimum=1, help="Width of the policy's hidden layer.")
    train_size: int = config_field(256, minimum=1, help="Training prompts (drawn with data_seed).")
    data_seed: int = config_field(1234, help="Seed of the training prompts' draw.")
    init_seed: int = config_field(0, help="Seed of the policy's initial weights.")
    temperature: float = config_field(1.0, minimum=0.0, exclusive_minimum=True, help="Sampling temperature.")


class CategoricalPolicy(nn.Module):
    """pi(answer | prompt) = prod_i softmax(logits_i): one categorical distribution per answer position.

    Args:
        vocab_size: Tokens of prompts and answers.
        length: Answer positions.
        hidden_size: Width of the hidden layer.
    """

    def __init__(self, vocab_size: int, length: int, hidden_size: int):
        super().__init__()
        self.vocab_size, self.length = vocab_size, length
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.head = nn.Linear(hidden_size, length * vocab_size)

    def forward(self, prompt_ids: Tensor) -> Tensor:
        """``prompt_ids [N]`` -> logits ``[N, L, V]``."""
        hidden = torch.tanh(self.embed(prompt_ids))  # [N, H]
        return self.head(hidden).view(-1, self.length, self.vocab_size)


class {{Camel}}Plugin(Plugin):
    """The {{name}} plugin: answer ``start, start+1, ...`` (mod vocab_size) to the prompt token ``start``."""

    name = "{{name}}"
    config_class = {{Camel}}Config

    def __init__(self, config: {{Camel}}Config, runtime: Runtime):
        super().__init__(config, runtime)
        with torch.random.fork_rng(devices=[]):  # the initial weights depend on init_seed only
            torch.manual_seed(config.init_seed)
            self.model = CategoricalPolicy(config.vocab_size, config.length, config.hidden_size)
        self.model.to(runtime.device)
        # The KL reference: a frozen copy of the initial weights, kept only when the KL term needs it.
        self.reference = frozen_copy(self.model) if runtime.needs_reference else None
        draw = random.Random(config.data_seed)
        self.splits = {
            "train": [self._row(draw.randrange(config.vocab_size)) for _ in range(config.train_size)],
            "eval": [self._row(start) for start in range(config.vocab_size)],
        }

    # ------------------------------------------------------------------ contract
    def policy(self) -> nn.Module:
        return self.model

    def dataset(self, split: str) -> list[dict[str, Any]]:
        if split not in self.splits:
            raise KeyError(f"{{name}} plugin has splits {sorted(self.splits)}, not {split!r}")
        return self.splits[split]

    def max_actions(self) -> int:
        return self.config.length

    @torch.no_grad()
    def rollout(self, policy: nn.Module, batch: PromptBatch) -> Rollout:
        device = self.runtime.device
        prompt_ids = torch.tensor([row["start"] for row in batch.rows], dtype=torch.long, device=device)  # [N]
        log_probs = self._log_probs(self.runtime.unwrap(policy), prompt_ids)  # [N, L, V]
        if batch.training:
            # Gumbel-max sampling, each sample's noise from its own seed. noise [N, L, V].
            noise = torch.stack([
                torch.rand(log_probs.shape[1:], generator=generator) for generator in batch.sample_generators()
            ]).to(device)
            tokens = torch.argmax(log_probs - torch.log(-torch.log(noise.clamp(1e-10, 1.0 - 1e-7))), dim=-1)
        else:
            tokens = torch.argmax(log_probs, dim=-1)  # greedy evaluation
        return Rollout(
            group_ids=batch.group_ids,
            old_logp=None,  # the core computes them with forward() when the run needs them
            mask=torch.ones(tokens.shape, dtype=torch.float32, device=device),  # [N, L]
            payload={"completions": [" ".join(str(token) for token in row) for row in tokens.tolist()]},
            replay={"prompt_ids": prompt_ids, "tokens": tokens},
        )

    def forward(
        self, policy: nn.Module, rollout: Rollout, *, need_reference: bool, actions: Tensor | None = None
    ) -> PolicyOutput:
        prompt_ids, tokens = rollout.replay["prompt_ids"], rollout.replay["tokens"]
        logp, entropy = self._token_logp(policy, prompt_ids, tokens)  # [N, L] each
        ref_logp = None
        if need_reference:
            with torch.no_grad(), reference_policy(self.runtime.unwrap(policy), self.reference) as reference:
                ref_logp, _ = self._token_logp(reference, prompt_ids, tokens)
        return PolicyOutput(logp=logp, ref_logp=ref_logp, entropy=entropy)

    # ------------------------------------------------------------------ helpers
    def _row(self, start: int) -> dict[str, Any]:
        answer = [(start + i) % self.config.vocab_size for i in range(self.config.length)]
        return {"prompt": str(start), "start": start, "solution": " ".join(map(str, answer))}

    def _log_probs(self, model: nn.Module, prompt_ids: Tensor) -> Tensor:
        """Tempered log-probs of every token at every position, in float32: ``[N, L, V]``."""
        with self.runtime.autocast():
            logits = model(prompt_ids)  # [N, L, V]
        return F.log_softmax(logits.float() / self.config.temperature, dim=-1)

    def _token_logp(self, model: nn.Module, prompt_ids: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Log-prob and entropy of each answer token ``tokens [N, L]``: ``[N, L]`` each."""
        log_probs = self._log_probs(model, prompt_ids)  # [N, L, V]
        token_logp = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [N, L]
        entropy = -(log_probs.exp() * log_probs).sum(-1)  # [N, L]
        return token_logp, entropy
'''

RECIPE = '''\
# GRPO on the {{name}} plugin: `mmrl train configs/{{name}}.yaml` (a CPU is enough).
plugin:
  name: {{name}}
  vocab_size: 8
  length: 3
run:
  output_dir: runs/{{name}}
  seed: 0
  max_steps: 60
rollout:
  prompts_per_step: 8
  group_size: 4
algorithm:
  advantage: grpo
  policy_loss: grpo
optim:
  lr: 3.0e-2
rewards:
  functions:
    - name: token_accuracy
eval:
  every: 20
'''

TEST = '''\
"""The {{name}} plugin honours mmrl's plugin contract and is found through its entry point."""

from pathlib import Path

from mmrl.config import load_config
from mmrl.testing import check_plugin

from {{package}}.plugin import {{Camel}}Plugin

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "{{name}}.yaml"


def test_the_plugin_passes_the_conformance_kit(tmp_path):
    checked = check_plugin({{Camel}}Plugin, {"train_size": 16}, directory=tmp_path)
    assert "ratio == 1 on the first forward" in checked


def test_the_recipe_loads_through_the_entry_point():
    config = load_config(RECIPE)  # `pip install` registered the plugin under its name
    assert config.plugin.name == "{{name}}"
    assert isinstance(config.plugin.config, {{Camel}}Plugin.config_class)
'''
