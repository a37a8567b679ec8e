"""Registry semantics: lookup, lazy entries, conflicts, option discovery, entry points."""

from importlib import metadata

import pytest

from mmrl.registry import Registry, RegistryError, callable_options


def test_register_and_lookup_are_case_sensitive():
    registry = Registry("thing")

    @registry.register("alpha")
    def alpha():
        """Alpha does a."""

    assert registry.get("alpha") is alpha
    assert "Alpha" not in registry
    with pytest.raises(RegistryError, match="registered: alpha"):
        registry.get("Alpha")
    assert registry.describe("alpha") == "Alpha does a."


def test_rebinding_a_name_to_another_object_is_refused():
    registry = Registry("thing")
    registry.register("a", len)
    registry.register("a", len)  # same object: fine
    with pytest.raises(RegistryError, match="already registered"):
        registry.register("a", sum)


def test_lazy_entries_import_on_first_use():
    registry = Registry("thing")
    registry.register_lazy("dumps", "json:dumps")
    assert "dumps" in registry
    import json

    assert registry.get("dumps") is json.dumps
    with pytest.raises(RegistryError, match="module:attribute"):
        registry.register_lazy("bad", "json.dumps")


def test_options_come_from_the_signature_and_docstring():
    def loss(logp, old_logp, advantages, mask, *, clip: float = 0.2, level: str = "token"):
        """A loss.

        Args:
            clip: How far the ratio may move.
            level: Where the ratio is taken.
        """

    options = {o.name: o for o in callable_options(loss)}
    assert set(options) == {"clip", "level"}
    assert options["clip"].default == 0.2 and options["clip"].help == "How far the ratio may move."


def test_entry_points_are_discovered(monkeypatch):
    class FakeEntryPoint:
        name, value = "external", "json:loads"

    monkeypatch.setattr(metadata, "entry_points", lambda group: [FakeEntryPoint()] if group == "test.group" else [])
    registry = Registry("thing", entry_point_group="test.group")
    import json

    assert registry.names() == ["external"]
    assert registry.get("external") is json.loads


def test_builtin_registries_hold_what_the_core_promises():
    from mmrl.algos import advantage_estimators, aggregation_modes, kl_estimators, policy_losses
    from mmrl.plugin import plugin_registry
    from mmrl.rewards import reward_functions

    assert {"grpo", "dr_grpo", "rloo", "batch_std"} <= set(advantage_estimators.names())
    assert {"grpo", "gspo", "reinforce"} <= set(policy_losses.names())
    assert set(kl_estimators.names()) == {"k1", "k2", "k3"}
    assert set(aggregation_modes.names()) == {
        "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"}
    assert "toy" in plugin_registry
    assert {"exact_match", "token_accuracy"} <= set(reward_functions.names())
