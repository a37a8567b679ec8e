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
    assert set(kl_estimators.names()) == {"k1", "k2", "k3", "k2_seq"}
    assert set(aggregation_modes.names()) == {
        "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"}
    assert "toy" in plugin_registry
    assert {"exact_match", "token_accuracy"} <= set(reward_functions.names())


def test_the_core_fills_its_registries_without_importing_the_plugins():
    """Issue 23: the built-in plugins and the dLLM plugin's wd1 and spg arrive through entry points declared in
    mmrl's pyproject.toml, as a third party's would; listing them, and validating a config that names them, imports
    no plugin package (only the objectives module, on the first lookup of one of its entries)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from mmrl.algos import advantage_estimators, policy_losses\n"
        "from mmrl.plugin import plugin_registry\n"
        "import mmrl.trainer, mmrl.cli\n"
        "assert {'toy', 'flow', 'dllm', 'vlm'} <= set(plugin_registry.names()), plugin_registry.names()\n"
        "assert {'wd1', 'spg'} <= set(policy_losses.names()) and 'wd1' in advantage_estimators.names()\n"
        "assert not [m for m in sys.modules if m.startswith('mmrl.plugins')], sorted(sys.modules)\n"
        "assert policy_losses.get('spg').__module__ == 'mmrl.plugins.dllm.objectives'\n"
        "assert 'mmrl.plugins.dllm.plugin' not in sys.modules and 'diffusers' not in sys.modules\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_a_stale_install_is_named_when_an_own_entry_point_group_is_missing(monkeypatch):
    """An editable install made before pyproject.toml declared the entry points has none of them: the unknown-name
    error says to reinstall instead of only listing what is there."""
    from mmrl import registry as registry_module

    class Distribution:
        entry_points = [metadata.EntryPoint(name="mmrl", value="mmrl.cli:main", group="console_scripts")]
        _path = "mmrl.egg-info"  # a stale build folder in the working directory shadowing the installed metadata

    monkeypatch.setattr(metadata, "entry_points", lambda group: [])
    monkeypatch.setattr(metadata, "distribution", lambda name: Distribution())
    stale = Registry("plugin", entry_point_group="mmrl.plugins")
    with pytest.raises(RegistryError, match=r"unknown plugin 'toy'; registered: \(none\) \(mmrl's installed metadata "
                       r"\(mmrl.egg-info\) has no 'mmrl.plugins' entry points: reinstall it, pip install -e \., "
                       r"after pyproject.toml changed, or delete a stale mmrl.egg-info in the working directory\)$"):
        stale.get("toy")
    other = Registry("thing", entry_point_group="third.party")  # not a group of mmrl's own: no hint
    with pytest.raises(RegistryError, match=r"registered: \(none\)$"):
        other.get("x")
    assert registry_module.REGISTRY_GROUP in registry_module.OWN_ENTRY_POINT_GROUPS


def test_derive_seed_is_public_in_the_core():
    """Plugins derive their seeds from mmrl.seeding (not from trainer internals); the trainer's name is the same
    function, so seeds, and runs, are unchanged. SplitMix64 of 0 is 0xE220A8397B1DCDAF (Steele et al. 2014's
    reference output for a zero state); derive_seed(0) mixes 0 ^ 0 once and drops the lowest bit."""
    from mmrl.seeding import derive_seed, splitmix64
    from mmrl.trainer import sampler

    assert sampler.derive_seed is derive_seed
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert derive_seed(0) == 0xE220A8397B1DCDAF >> 1
    assert derive_seed(7, 9) == splitmix64(splitmix64(7) ^ 9) >> 1
