"""The conformance kit: :func:`check_plugin` runs every property of the plugin contract against a plugin.

A plugin author calls it from a test, on a configuration that builds a tiny model (seconds on a CPU)::

    from mmrl.testing import check_plugin
    from my_package.plugin import MyPlugin

    def test_my_plugin_honours_the_contract(tmp_path):
        check_plugin(MyPlugin, {"model": str(tiny_model_folder)}, directory=tmp_path)

Every property that fails raises :class:`ConformanceError` (an ``AssertionError``, so pytest reports it as a test
failure) with one line naming the property and why, e.g. ``MyPlugin fails 'ratio == 1 on the first forward': max
|ratio - 1| = 0.105 on unmasked actions (tolerance 0.0001) ...``. docs/plugins.md lists what is checked; the checks
mirror what the trainer does with a plugin (:mod:`mmrl.trainer.collect`, :mod:`mmrl.trainer.learn`).

"1 process == 2 processes" is not checked here: it needs several processes, and the built-in plugins are covered by
tests/distributed/test_two_processes.py (run a two-process ``accelerate launch`` of your own plugin the same way).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import tempfile
import typing
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mmrl.config import ConfigError, PluginSpec, TrainConfig, from_dict, to_dict
from mmrl.plugin import Plugin, PolicyOutput, PromptBatch, Runtime
from mmrl.policy import POLICY_FORMATS, LoraConfig, load_policy
from mmrl.rollout import Rollout
from mmrl.seeding import derive_seed
from mmrl.trainer.learn import old_policy_pass, ratio_level

# Purpose tags of the kit's sample seeds (any constants: they only keep the kit's streams apart).
_TRAIN_SEED_TAG, _EVAL_SEED_TAG, _PERTURB_SEED_TAG, _STEP_SEED_TAG = 0xC0DE, 0xE7A1, 0x5A7E, 0x57E9

PROPERTIES = (
    "config validation",
    "construction",
    "datasets",
    "row buckets",
    "reward context",
    "training rollout",
    "rollout reproducibility",
    "ratio == 1 on the first forward",
    "reference policy",
    "micro-batch invariance",
    "action chunks",
    "action rewards",
    "evaluation rollout",
    "save_samples",
    "save/load round trip",
    "export",
)
"""Every property :func:`check_plugin` checks, in the order it checks them."""


class CheckedProperties(list):
    """What :func:`check_plugin` returns: the names of the properties it checked, in order (a list), and
    :attr:`skipped`, the properties it left out, each with the reason.

    Attributes:
        skipped: Property name -> why it was not checked (e.g. ``"action chunks"`` for a plugin without
            :attr:`Plugin.supports_action_chunks`, ``"export"`` for a plugin whose :meth:`Plugin.export` raises
            ``NotImplementedError``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.skipped: dict[str, str] = {}


class ConformanceError(AssertionError):
    """A plugin breaks a property of the contract; the one-line message names the property and why.

    Attributes:
        property: The property that failed (one of :data:`PROPERTIES`).
    """

    def __init__(self, plugin_name: str, prop: str, why: str):
        self.property = prop
        super().__init__(f"{plugin_name} fails {prop!r}: {' '.join(why.split())}")


def check_plugin(
    plugin_cls: type[Plugin],
    config: Mapping[str, Any] | Any,
    *,
    train_config: Mapping[str, Any] | None = None,
    runtime: Runtime | None = None,
    num_prompts: int = 2,
    group_size: int = 2,
    seed: int = 0,
    logp_tolerance: float = 1e-4,
    reference_is_initial: bool = True,
    directory: str | Path | None = None,
) -> list[str]:
    """Run every property of the plugin contract against ``plugin_cls`` and raise on the first that fails.

    The properties, in order (:data:`PROPERTIES`):

    - **config validation**: ``config_class`` is a dataclass that validates ``config`` and round-trips through its
      plain form (what a run folder stores and a resume reloads); :meth:`Plugin.check_config` accepts the whole
      config (``train_config``'s sections, defaults elsewhere).
    - **construction**: ``plugin_cls(config, runtime)`` builds; ``policy()`` is a module with trainable parameters.
    - **datasets**: ``dataset("train")`` and ``dataset("eval")`` are non-empty sequences of dicts.
    - **row buckets**: :meth:`Plugin.row_buckets` of ``"train"`` and ``"eval"`` is None or a list of strings, one
      per row of that split.
    - **reward context**: :meth:`Plugin.reward_context` is a JSON-serialisable dict.
    - **training rollout**: a :class:`Rollout` that passes :meth:`Rollout.validate` (shapes, per-sample payload and
      replay), whose ``group_ids`` equal the batch's, ``mask`` is float32 of 0s and 1s with at least one active
      action, ``old_logp`` (when given) is float32 without gradients, ``payload`` is not empty and the width is
      within :meth:`Plugin.max_actions`.
    - **rollout reproducibility**: the same batch (rows and sample seeds) gives the same rollout again.
    - **ratio == 1 on the first forward**: the training forward (train mode, gradients on) returns ``logp``
      ``[N, A]`` equal to the old log-probs the learner would use (the rollout's ``old_logp``, else
      :func:`mmrl.trainer.learn.old_policy_pass`; once per inner epoch for plugins that redraw their noise), and a
      backward pass reaches the trainable parameters.
    - **reference policy**: ``forward(need_reference=True)`` returns ``ref_logp`` or ``kl`` ``[N, A]`` without
      gradients; with ``reference_is_initial`` (before any update the reference is the policy) ``ref_logp`` equals
      ``logp`` and ``kl`` is 0. Where :meth:`Plugin.reference_module` returns a module (what
      ``algorithm.ref_sync_every`` moves toward the policy), its parameters pair by name and shape with the policy's
      trainable ones, and moving them moves the reference that ``forward`` scores with.
    - **micro-batch invariance**: the same log-probs whatever the micro-batch split and the order of the samples.
    - **action chunks** (only with :attr:`Plugin.supports_action_chunks`): a declared action budget, and the
      log-probs of column chunks (``forward(actions=...)`` on the padded rollout, as the learner calls it) equal the
      whole forward's.
    - **action rewards**: :meth:`Plugin.action_rewards` returns None or finite ``[N, A]`` rewards.
    - **evaluation rollout**: ``training=False`` gives a valid rollout with the batch's group ids, reproducibly.
    - **save_samples**: writes the files it returns.
    - **save/load round trip**: :meth:`Plugin.save_trainable` then :meth:`Plugin.load_trainable` restores perturbed
      trainable weights exactly, and the log-probs with them.
    - **export**: after a step (every trainable weight moved), :meth:`Plugin.export` writes a folder in one of
      :data:`mmrl.policy.POLICY_FORMATS`; a new plugin built from the same config loads it with
      :func:`mmrl.policy.load_policy` (``from_pretrained`` for a ``save_pretrained`` folder, the adapter file for a
      LoRA) and gives the stepped policy's log-probs. Skipped, with the reason in the result's ``skipped``, for a
      plugin whose ``export`` raises ``NotImplementedError``.

    Not checked: "1 process == 2 processes", which needs several processes; the built-in plugins are covered by
    tests/distributed/test_two_processes.py.

    Args:
        plugin_cls: The plugin class (it need not be registered).
        config: The plugin's ``plugin:`` section as a mapping (a ``name`` key is ignored), or an instance of
            ``plugin_cls.config_class``. Choose a tiny model: the kit rolls out and recomputes a few times.
        train_config: The other sections of the training config (``{"algorithm": {...}, ...}``) that
            :meth:`Plugin.check_config` sees and the runtime is derived from; missing sections take their defaults.
        runtime: The runtime to build the plugin with. Default: this CPU process, with a reference policy
            (``needs_reference``), the policy loss's ratio level and two inner epochs.
        num_prompts: Prompts per rollout (the first rows of each split; of its first row's bucket when the plugin has
            :meth:`Plugin.row_buckets`).
        group_size: Samples per prompt.
        seed: Base seed of the sample seeds.
        logp_tolerance: Largest allowed difference between log-probs that must agree (and of ``|ratio - 1|``).
        reference_is_initial: Whether the reference policy equals the policy before any update (true for a frozen
            copy of the initial weights and for a disabled LoRA adapter initialised to zero). Set False for a plugin
            whose initial policy differs from its reference (e.g. it starts from a trained adapter).
        directory: Where save_samples and save_trainable write (default: a temporary folder, removed afterwards).

    Returns:
        The names of the properties that were checked, a :class:`CheckedProperties` list whose ``skipped`` maps each
        property left out to the reason (``"action chunks"`` without :attr:`Plugin.supports_action_chunks`,
        ``"export"`` when :meth:`Plugin.export` raises ``NotImplementedError``).

    Raises:
        ConformanceError: The first property that fails, in one line.
    """
    if directory is None:
        with tempfile.TemporaryDirectory(prefix="mmrl-conformance-") as scratch:
            return _Checker(plugin_cls, logp_tolerance).run(
                config, train_config, runtime, num_prompts, group_size, seed, reference_is_initial, Path(scratch))
    return _Checker(plugin_cls, logp_tolerance).run(
        config, train_config, runtime, num_prompts, group_size, seed, reference_is_initial, Path(directory))


class _Checker:
    """One run of :func:`check_plugin` (the properties share the plugin and its rollout)."""

    def __init__(self, plugin_cls: type[Plugin], tolerance: float):
        self.plugin_cls = plugin_cls
        self.tolerance = tolerance
        self.checked = CheckedProperties()
        self.current = ""

    @contextmanager
    def check(self, prop: str) -> Iterator[None]:
        """Run one property: an exception the plugin raises inside it becomes that property's failure."""
        self.current = prop
        try:
            yield
        except ConformanceError:
            raise
        except Exception as error:  # any error of the plugin is this property's failure, named
            raise self.fail(f"raised {type(error).__name__}: {error}") from error
        self.checked.append(prop)

    def fail(self, why: str) -> ConformanceError:
        return ConformanceError(self.plugin_cls.__name__, self.current, why)

    def expect(self, condition: bool, why: str) -> None:
        if not condition:
            raise self.fail(why)

    # ------------------------------------------------------------------------------------------------ the run
    def run(self, config: Any, train_config: Mapping[str, Any] | None, runtime: Runtime | None, num_prompts: int,
            group_size: int, seed: int, reference_is_initial: bool, directory: Path) -> list[str]:
        cls = self.plugin_cls
        with self.check("config validation"):
            plugin_config, train = self.validated_config(config, train_config or {})
        with self.check("construction"):
            if runtime is None:
                runtime = Runtime(needs_reference=True, ratio_level=ratio_level(train),
                                  inner_epochs=max(2, train.algorithm.inner_epochs), seed=seed)
            plugin = cls(plugin_config, runtime)
            policy = plugin.policy()
            self.expect(isinstance(policy, torch.nn.Module), f"policy() returned a {type(policy).__name__}, not an "
                        "nn.Module")
            params = list(plugin.trainable_parameters(policy))
            self.expect(len(params) > 0, "trainable_parameters(policy) is empty: nothing would train")
        with self.check("datasets"):
            rows = {split: plugin.dataset(split) for split in ("train", "eval")}
            for split, split_rows in rows.items():
                self.expect(len(split_rows) > 0, f"dataset({split!r}) is empty (every run trains and evaluates)")
                self.expect(all(isinstance(row, Mapping) for row in split_rows),
                            f"dataset({split!r}) holds rows that are not dicts")
        with self.check("row buckets"):
            for split, split_rows in rows.items():
                self.row_buckets(plugin, split, len(split_rows))
            # The kit's batches, as the trainer's, hold rows of one bucket: the first row's.
            rows = {split: _first_bucket(split_rows, plugin.row_buckets(split)) for split, split_rows in rows.items()}
        with self.check("reward context"):
            context = plugin.reward_context()
            self.expect(isinstance(context, dict), f"reward_context() returned a {type(context).__name__}")
            json.dumps(context)

        def train_batch() -> PromptBatch:
            return _prompt_batch(rows["train"], num_prompts, group_size, seed, _TRAIN_SEED_TAG, runtime, True)

        with self.check("training rollout"):
            rollout = self.sample(plugin, policy, train_batch())
        with self.check("rollout reproducibility"):
            again = self.sample(plugin, policy, train_batch())
            self.same_rollout(rollout, again)
        with self.check("ratio == 1 on the first forward"):
            self.ratio_one(plugin, policy, rollout, params)
        if runtime.needs_reference:
            with self.check("reference policy"):
                self.reference(plugin, policy, rollout, reference_is_initial)
        with self.check("micro-batch invariance"):
            self.micro_batches(plugin, policy, rollout)
        if cls.supports_action_chunks:
            with self.check("action chunks"):
                self.action_chunks(plugin, policy, rollout)
        else:
            self.checked.skipped["action chunks"] = f"{cls.__name__}.supports_action_chunks is False"
        with self.check("action rewards"):
            rewards = torch.linspace(0.0, 1.0, len(rollout))  # [N]
            credit = plugin.action_rewards(rollout, rewards)
            if credit is not None:
                self.expect(isinstance(credit, Tensor) and tuple(credit.shape) == tuple(rollout.mask.shape),
                            f"action_rewards returned {_describe(credit)}, not None or [N, A] = "
                            f"{tuple(rollout.mask.shape)}")
                self.expect(bool(torch.isfinite(credit[rollout.mask > 0]).all()),
                            "action_rewards holds NaN or infinite values on unmasked actions")

        def eval_batch() -> PromptBatch:
            return _prompt_batch(rows["eval"], num_prompts, 1, seed, _EVAL_SEED_TAG, runtime, False)

        with self.check("evaluation rollout"):
            evaluation = self.sample(plugin, policy, eval_batch())
            self.same_rollout(evaluation, self.sample(plugin, policy, eval_batch()))
        with self.check("save_samples"):
            written = plugin.save_samples(evaluation, torch.linspace(0.0, 1.0, len(evaluation)),
                                          directory / "samples", tag="conformance")
            self.expect(len(written) > 0, "save_samples returned no file")
            missing = [str(path) for path in written if not Path(path).is_file()]
            self.expect(not missing, f"save_samples returned files it did not write: {missing[:3]}")
        with self.check("save/load round trip"):
            self.round_trip(plugin, policy, rollout, params, directory / "trainable")
        with self.check("export"):
            skipped = self.export(plugin, policy, rollout, params, plugin_config, directory / "export")
        if skipped is not None:  # check() recorded the property as passed: it was not checked
            self.checked.remove("export")
            self.checked.skipped["export"] = skipped
        return self.checked

    # ------------------------------------------------------------------------------------------------ properties
    def validated_config(self, config: Any, sections: Mapping[str, Any]) -> tuple[Any, TrainConfig]:
        cls = self.plugin_cls
        config_class = getattr(cls, "config_class", None)
        self.expect(isinstance(getattr(cls, "name", None), str), "the class attribute 'name' is not a string")
        self.expect(dataclasses.is_dataclass(config_class) and isinstance(config_class, type),
                    f"config_class is {config_class!r}, not a dataclass")
        try:
            if isinstance(config, config_class):
                plugin_config = config
            else:
                self.expect(isinstance(config, Mapping), f"config is a {type(config).__name__}, not a mapping or a "
                            f"{config_class.__name__}")
                plugin_config = from_dict(config_class, {k: v for k, v in config.items() if k != "name"}, "plugin")
            # A run folder stores the plain form and a resume validates it again: it must come back equal.
            plain = to_dict(plugin_config)
            json.dumps(plain)
            self.expect(from_dict(config_class, copy.deepcopy(plain), "plugin") == plugin_config,
                        "the config does not come back equal from its plain form (to_dict, then from_dict)")
            train = _train_config(cls.name, plugin_config, sections)
        except ConfigError as error:
            raise self.fail(f"the config was refused: {error}") from error
        try:
            cls.check_config(train)
        except ConfigError as error:
            raise self.fail(f"check_config refused the config: {error}") from error
        return plugin_config, train

    def sample(self, plugin: Plugin, policy: torch.nn.Module, batch: PromptBatch) -> Rollout:
        """Roll out as the trainer does (policy in eval mode, no gradients) and check the rollout's contract."""
        policy.eval()
        try:
            with torch.no_grad():
                rollout = plugin.rollout(policy, batch)
        finally:
            policy.train()
        self.expect(isinstance(rollout, Rollout), f"rollout() returned a {type(rollout).__name__}, not a Rollout")
        rollout.validate()
        self.expect(rollout.group_ids.dtype == torch.int64, f"group_ids are {rollout.group_ids.dtype}, not int64")
        self.expect(torch.equal(rollout.group_ids.cpu(), batch.group_ids.cpu()),
                    f"group_ids {rollout.group_ids.tolist()} differ from the batch's {batch.group_ids.tolist()}")
        mask = rollout.mask
        self.expect(mask.dtype == torch.float32, f"mask is {mask.dtype}, not float32")
        self.expect(bool(((mask == 0) | (mask == 1)).all()), "mask holds values other than 0 and 1")
        if batch.training:
            self.expect(bool(mask.sum() > 0), "mask is all zeros: no action would train")
            budget = plugin.max_actions()
            self.expect(budget is None or rollout.num_actions <= budget,
                        f"the rollout has {rollout.num_actions} actions, more than max_actions() = {budget}")
        if rollout.old_logp is not None:
            self.expect(rollout.old_logp.dtype == torch.float32, f"old_logp is {rollout.old_logp.dtype}, not float32")
            self.expect(not rollout.old_logp.requires_grad, "old_logp requires grad (sample under torch.no_grad)")
        self.expect(len(rollout.payload) > 0, "payload is empty: rewards would have nothing to score")
        if not rollout.rows:
            rollout.rows = batch.rows  # as the trainer fills them in
        return rollout

    def row_buckets(self, plugin: Plugin, split: str, size: int) -> None:
        buckets = plugin.row_buckets(split)
        if buckets is None:
            return
        self.expect(isinstance(buckets, list), f"row_buckets({split!r}) returned {_describe(buckets)}, not None or "
                    "a list of strings")
        self.expect(len(buckets) == size, f"row_buckets({split!r}) returned {len(buckets)} keys for the {size} rows "
                    f"of dataset({split!r}) (one per row)")
        wrong = [row for row, key in enumerate(buckets) if not isinstance(key, str)]
        if wrong:
            raise self.fail(f"row_buckets({split!r}) holds {len(wrong)} keys that are not strings (row {wrong[0]}: "
                            f"{buckets[wrong[0]]!r})")

    def same_rollout(self, first: Rollout, second: Rollout) -> None:
        self.expect(torch.equal(first.mask, second.mask), "the same batch and seeds gave a different mask")
        if first.old_logp is not None:
            self.close(first.old_logp, second.old_logp, first.mask, "the same batch and seeds gave different old_logp")
        difference = _first_difference(first.payload, second.payload, self.tolerance, "payload")
        self.expect(difference is None, f"the same batch and seeds gave a different {difference}")

    def ratio_one(self, plugin: Plugin, policy: torch.nn.Module, rollout: Rollout, params: list[Any]) -> None:
        """The old log-probs the learner would use against the training forward, per inner epoch as it does."""
        redraws = plugin.redraws_per_epoch and plugin.runtime.inner_epochs > 1
        for epoch in range(plugin.runtime.inner_epochs if redraws else 1):
            plugin.start_inner_epoch(epoch)
            if rollout.old_logp is not None and not redraws:
                old, source = rollout.old_logp, "the rollout's old_logp"
            else:
                old, source = old_policy_pass(plugin, policy, rollout).old_logp, "old_policy_pass"
            plugin.start_inner_epoch(epoch)
            policy.train()
            output = plugin.forward(policy, rollout, need_reference=False)
            logp = self.logp_of(output, rollout.mask)
            self.expect(logp.requires_grad, "forward's logp has no gradient: call the policy module it is given")
            deviation = _max_abs((logp.detach().float() - old.float()).exp() - 1, rollout.mask)
            self.expect(deviation <= self.tolerance,
                        f"max |ratio - 1| = {deviation:.3g} on unmasked actions (tolerance {self.tolerance:g}) between "
                        f"forward and {source}" + (f" at inner epoch {epoch}" if redraws else "")
                        + ": both must be the same computation")
            if epoch == 0:
                for param in params:
                    param.grad = None
                (logp.float() * rollout.mask).sum().backward()
                grads = [p.grad for p in params if p.grad is not None]
                reached = any(bool(g.abs().sum() > 0) for g in grads)
                for param in params:
                    param.grad = None
                self.expect(reached, "a backward pass through forward's logp leaves every trainable parameter "
                            "without a gradient")

    def reference(self, plugin: Plugin, policy: torch.nn.Module, rollout: Rollout, initial: bool) -> None:
        plugin.start_inner_epoch(0)
        output = plugin.forward(policy, rollout, need_reference=True)
        logp = self.logp_of(output, rollout.mask)
        self.expect(output.ref_logp is not None or output.kl is not None,
                    "forward(need_reference=True) returned neither ref_logp nor kl")
        shape = tuple(rollout.mask.shape)
        for name in ("ref_logp", "kl"):
            value = getattr(output, name)
            if value is None:
                continue
            self.expect(isinstance(value, Tensor) and tuple(value.shape) == shape,
                        f"{name} is {_describe(value)}, not [N, A] = {shape}")
            self.expect(bool(torch.isfinite(value[rollout.mask > 0]).all()), f"{name} holds NaN or infinite values")
        if output.ref_logp is not None:
            self.expect(not output.ref_logp.requires_grad, "ref_logp requires grad (compute it under no_grad)")
            if initial:
                self.close(output.ref_logp, logp.detach(), rollout.mask,
                           "before any update the reference's log-probs differ from the policy's")
        if output.kl is not None and initial:
            largest = _max_abs(output.kl.detach().float(), rollout.mask)
            self.expect(largest <= self.tolerance, f"before any update the KL to the reference is {largest:.3g}, not 0")
        if plugin.reference_module() is not None:
            self.synced_reference(plugin, policy, rollout, output)

    def synced_reference(self, plugin: Plugin, policy: torch.nn.Module, rollout: Rollout, before: Any) -> None:
        """Move the reference_module()'s paired parameters as ``algorithm.ref_sync_every`` would, and expect the
        reference's log-probs (or KL) to move; the parameters are restored after."""
        from mmrl.trainer.reference import ReferenceSync

        sync = ReferenceSync.build(plugin, policy, every=1, mix=1.0)  # a ConfigError names what does not pair
        self.expect(bool(sync.pairs), "reference_module() pairs with none of the policy's trainable parameters")
        saved = [target.detach().clone() for _, _, target in sync.pairs]
        generator = torch.Generator().manual_seed(0)
        try:
            with torch.no_grad():
                for _, _, target in sync.pairs:
                    noise = torch.randn(target.shape, generator=generator).to(target.device, target.dtype)
                    target.add_(0.1 * noise * (target.detach().float().std().nan_to_num(0.0) + 0.01).to(target.dtype))
                after = plugin.forward(policy, rollout, need_reference=True)
        finally:
            with torch.no_grad():
                for (_, _, target), value in zip(sync.pairs, saved, strict=True):
                    target.copy_(value)
        name = "ref_logp" if before.ref_logp is not None else "kl"
        moved = _max_abs((getattr(after, name).detach() - getattr(before, name).detach()).float(), rollout.mask)
        self.expect(moved > self.tolerance, f"moving reference_module()'s parameters left {name} unchanged (by "
                    f"{moved:.3g}): it is not the module forward scores the reference with")

    def micro_batches(self, plugin: Plugin, policy: torch.nn.Module, rollout: Rollout) -> None:
        """Forwards on shuffled micro-batches of sizes 1, 2, 1, 2, ... reassembled against one whole forward."""
        n = len(rollout)
        plugin.start_inner_epoch(0)
        policy.train()
        with torch.no_grad():
            whole = self.logp_of(plugin.forward(policy, rollout, need_reference=False), rollout.mask)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(n)).tolist()
            if order == list(range(n)):
                order.reverse()
            pieces, start, size = [], 0, 1
            while start < n:
                pieces.append(order[start:start + size])
                start, size = start + size, 3 - size
            split = torch.zeros_like(whole)
            for piece in pieces:
                part = rollout.select(torch.tensor(piece, dtype=torch.long))
                logp = self.logp_of(plugin.forward(policy, part, need_reference=False), part.mask)
                split[torch.tensor(piece, device=split.device)] = logp.float()
        self.close(split, whole, rollout.mask, f"micro-batches {pieces} give log-probs that differ from the whole "
                   "batch's")

    def action_chunks(self, plugin: Plugin, policy: torch.nn.Module, rollout: Rollout) -> None:
        """As the learner chunks: pad to the budget, slice the columns, pass their indices as ``actions``."""
        budget = plugin.max_actions()
        self.expect(budget is not None, "supports_action_chunks is set but max_actions() is None (the learner pads "
                    "every rollout to that budget)")
        plugin.start_inner_epoch(0)
        width = rollout.num_actions
        padded = rollout.pad_actions(budget)
        with torch.no_grad():
            whole = self.logp_of(plugin.forward(policy, rollout, need_reference=False), rollout.mask)
            for size in (1, 2):
                parts = []
                for columns in torch.arange(budget).split(size):
                    part = padded.select_actions(columns)
                    output = plugin.forward(policy, part, need_reference=False, actions=columns)
                    self.expect(tuple(output.logp.shape) == tuple(part.mask.shape),
                                f"forward(actions={columns.tolist()}) returned logp {_describe(output.logp)}, not "
                                f"[N, {len(columns)}]")
                    parts.append(output.logp.float())
                chunked = torch.cat(parts, dim=1)[:, :width]  # [N, A]
                self.close(chunked, whole, rollout.mask, f"action chunks of {size} column(s) give log-probs that "
                           "differ from one whole forward")

    def round_trip(self, plugin: Plugin, policy: torch.nn.Module, rollout: Rollout, params: list[Any],
                   directory: Path) -> None:
        plugin.start_inner_epoch(0)
        policy.eval()
        with torch.no_grad():
            before_logp = plugin.forward(policy, rollout, need_reference=False).logp.float()
        saved = [p.detach().clone() for p in params]
        plugin.save_trainable(policy, directory)
        self.expect(directory.is_dir() and any(directory.iterdir()), f"save_trainable wrote nothing in {directory}")
        _perturb(params, _PERTURB_SEED_TAG)
        plugin.load_trainable(policy, directory)
        changed = [i for i, (p, s) in enumerate(zip(params, saved, strict=True)) if not torch.equal(p.detach(), s)]
        self.expect(not changed, f"load_trainable left {len(changed)} of {len(params)} trainable tensors different "
                    "from what save_trainable saved")
        with torch.no_grad():
            after_logp = plugin.forward(policy, rollout, need_reference=False).logp.float()
        policy.train()
        self.close(after_logp, before_logp, rollout.mask, "log-probs after save_trainable, a change of the weights "
                   "and load_trainable differ from before")

    def export(self, plugin: Plugin, policy: torch.nn.Module, rollout: Rollout, params: list[Any], config: Any,
               directory: Path) -> str | None:
        """Move every trainable weight (a stand-in for an optimizer step), export, and load the folder into a new
        plugin built from the same config: its log-probs must be the stepped policy's, not the initial ones.

        Returns:
            None, or why the export was not checked (the plugin's ``export`` raised ``NotImplementedError``).
        """
        saved = [p.detach().clone() for p in params]
        _perturb(params, _STEP_SEED_TAG)
        try:
            plugin.start_inner_epoch(0)
            policy.eval()
            with torch.no_grad():
                stepped = plugin.forward(policy, rollout, need_reference=False).logp.float()
            try:
                fmt = plugin.export(policy, directory)
            except NotImplementedError as error:
                return f"{type(plugin).__name__}.export raised NotImplementedError: {error}"
            self.expect(fmt in POLICY_FORMATS, f"export returned {fmt!r}, not one of {', '.join(POLICY_FORMATS)}")
            self.expect(directory.is_dir() and any(directory.iterdir()), f"export wrote nothing in {directory}")
            fresh = self.plugin_cls(config, plugin.runtime)
            fresh_policy = fresh.policy()
            fresh.start_inner_epoch(0)
            fresh_policy.eval()
            with torch.no_grad():
                initial = fresh.forward(fresh_policy, rollout, need_reference=False).logp.float()
            moved = _max_abs(initial - stepped.to(initial.device), rollout.mask)
            self.expect(moved > self.tolerance, f"moving every trainable weight changed no log-prob by more than "
                        f"{self.tolerance:g}: the check cannot tell the stepped policy from the initial one")
            lora = getattr(config, "lora", None)
            load_policy(fresh.runtime.unwrap(fresh_policy), directory, fmt,
                        lora=lora if isinstance(lora, LoraConfig) else None)
            with torch.no_grad():
                reloaded = fresh.forward(fresh_policy, rollout, need_reference=False).logp.float()
            self.close(reloaded, stepped, rollout.mask, f"a new plugin that loads the {fmt!r} export gives log-probs "
                       "that differ from the exported policy's")
            return None
        finally:
            with torch.no_grad():
                for param, value in zip(params, saved, strict=True):
                    param.copy_(value)
            policy.train()

    # ------------------------------------------------------------------------------------------------ helpers
    def logp_of(self, output: Any, mask: Tensor) -> Tensor:
        self.expect(isinstance(output, PolicyOutput), f"forward returned a {type(output).__name__}, not a "
                    "PolicyOutput")
        logp = output.logp
        self.expect(isinstance(logp, Tensor) and tuple(logp.shape) == tuple(mask.shape),
                    f"forward returned logp {_describe(logp)} for a rollout whose mask is {tuple(mask.shape)}")
        self.expect(bool(torch.isfinite(logp.detach()[mask > 0]).all()), "forward's logp holds NaN or infinite "
                    "values on unmasked actions")
        aux = output.aux_loss
        self.expect(aux is None or (isinstance(aux, Tensor) and aux.numel() == 1
                                    and bool(torch.isfinite(aux.detach()).all())),
                    f"forward returned aux_loss {_describe(aux)}; expected None or one finite value (a 0-dim tensor)")
        return logp

    def close(self, actual: Tensor, expected: Tensor, mask: Tensor, what: str) -> None:
        largest = _max_abs(actual.detach().float() - expected.detach().float().to(actual.device), mask)
        self.expect(largest <= self.tolerance, f"{what} (max difference {largest:.3g} on unmasked actions, tolerance "
                    f"{self.tolerance:g})")


def _train_config(name: str, plugin_config: Any, sections: Mapping[str, Any]) -> TrainConfig:
    """The whole config ``check_config`` sees: the given sections validated, defaults elsewhere.

    Built section by section rather than through :func:`mmrl.config.load_config`, which looks the plugin up in the
    registry by name: the kit checks plugin classes that are not registered (yet).
    """
    hints = typing.get_type_hints(TrainConfig)
    unknown = sorted(set(sections) - set(hints) | ({"plugin"} & set(sections)))
    if unknown:
        raise ConfigError(unknown[0], sections[unknown[0]],
                          f"one of the sections {', '.join(k for k in hints if k != 'plugin')} (the plugin section is "
                          "check_plugin's config argument)")
    values: dict[str, Any] = {"plugin": PluginSpec(name, plugin_config)}
    for field in dataclasses.fields(TrainConfig):
        if field.name == "plugin":
            continue
        if field.name in sections:
            values[field.name] = from_dict(hints[field.name], sections[field.name], field.name)
        else:
            values[field.name] = field.default_factory()
    return TrainConfig(**values)


def _prompt_batch(rows: Any, num_prompts: int, group_size: int, seed: int, tag: int, runtime: Runtime,
                  training: bool) -> PromptBatch:
    """The first ``num_prompts`` rows (cycled when there are fewer), each repeated ``group_size`` times, one seed per
    sample (as the trainer derives them)."""
    chosen = [rows[i % len(rows)] for i in range(num_prompts)]
    n = num_prompts * group_size
    return PromptBatch(
        rows=[dict(row) for row in chosen for _ in range(group_size)],
        group_ids=torch.arange(num_prompts, dtype=torch.long).repeat_interleave(group_size),
        group_size=group_size,
        seeds=torch.tensor([derive_seed(seed, tag, k) for k in range(n)], dtype=torch.long),
        generator=torch.Generator(device=runtime.device).manual_seed(derive_seed(seed, tag)),
        training=training,
    )


def _first_bucket(rows: Any, buckets: list[str] | None) -> Any:
    """The rows of the first row's bucket, in order (all of them without buckets)."""
    if buckets is None:
        return rows
    return [row for row, key in zip(rows, buckets, strict=True) if key == buckets[0]]


def _perturb(params: list[Any], tag: int) -> None:
    """Add ``0.05 * N(0, 1)`` noise (seeded by ``tag``) to every parameter, in place."""
    generator = torch.Generator().manual_seed(derive_seed(tag))
    with torch.no_grad():
        for param in params:
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.add_((0.05 * noise).to(param.dtype).to(param.device))


def _max_abs(values: Tensor, mask: Tensor) -> float:
    active = mask.to(values.device) > 0
    if not bool(active.any()):
        return 0.0
    largest = float(values[active].abs().max())
    return math.inf if math.isnan(largest) else largest


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _first_difference(first: Any, second: Any, tolerance: float, where: str) -> str | None:
    """The key path of the first difference between two nested payloads (tensors within ``tolerance``)."""
    if isinstance(first, Tensor) and isinstance(second, Tensor):
        if first.shape != second.shape:
            return f"{where} (shape {tuple(first.shape)} then {tuple(second.shape)})"
        if first.is_floating_point():
            gap = float((first.float() - second.float()).abs().max()) if first.numel() else 0.0
            return None if gap <= tolerance else f"{where} (max difference {gap:.3g})"
        return None if torch.equal(first, second) else where
    if isinstance(first, Mapping) and isinstance(second, Mapping):
        if set(first) != set(second):
            return f"{where} (keys {sorted(first)} then {sorted(second)})"
        for key in first:
            found = _first_difference(first[key], second[key], tolerance, f"{where}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(first, (list, tuple)) and isinstance(second, (list, tuple)):
        if len(first) != len(second):
            return f"{where} (length {len(first)} then {len(second)})"
        for i, (a, b) in enumerate(zip(first, second, strict=True)):
            found = _first_difference(a, b, tolerance, f"{where}[{i}]")
            if found:
                return found
        return None
    return None if first == second else where


__all__ = ["PROPERTIES", "CheckedProperties", "ConformanceError", "check_plugin"]
