"""Plugin base-class behaviour that every plugin inherits: saving trainable weights safely under sharding."""

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from mmrl.plugin import Plugin, Runtime


class _Tiny(Plugin):
    name = "tiny-test"
    config_class = dict

    def policy(self):
        raise NotImplementedError

    def dataset(self, split):
        raise NotImplementedError

    def rollout(self, policy, batch):
        raise NotImplementedError

    def forward(self, policy, rollout, *, need_reference, actions=None):
        raise NotImplementedError


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)  # frozen base, trainable head (like a LoRA adapter)
    return model


def _shard(model):
    """What FSDP leaves on a process: the module's own parameters hold only a (here: empty) local shard."""
    sharded = _model()
    with torch.no_grad():
        for param in sharded.parameters():
            param.data = torch.empty(0)
    return sharded


def test_saves_trainable_weights_from_the_gathered_state(tmp_path):
    full = _model()
    gathered = {k: v.clone() for k, v in full.state_dict().items()}
    plugin = _Tiny({}, Runtime(full_state_dict=lambda module: gathered))
    plugin.save_trainable(_shard(full), tmp_path)
    saved = load_file(str(tmp_path / "trainable.safetensors"))
    assert set(saved) == {"1.weight", "1.bias"}  # only what trains
    torch.testing.assert_close(saved["1.weight"], full[1].weight)


def test_refuses_to_write_an_empty_adapter_from_local_shards(tmp_path):
    plugin = _Tiny({}, Runtime())  # the naive runtime reads the module's own (sharded, empty) tensors
    with pytest.raises(RuntimeError, match="missing or empty"):
        plugin.save_trainable(_shard(_model()), tmp_path)
    assert not (tmp_path / "trainable.safetensors").exists()


def test_only_the_main_process_writes_but_every_process_gathers(tmp_path):
    calls = []
    plugin = _Tiny({}, Runtime(process_index=1, num_processes=2,
                               full_state_dict=lambda module: calls.append(1) or {}))
    plugin.save_trainable(_model(), tmp_path)
    assert calls == [1] and not (tmp_path / "trainable.safetensors").exists()


def test_round_trip_and_missing_weights(tmp_path):
    model = _model()
    plugin = _Tiny({}, Runtime())
    plugin.save_trainable(model, tmp_path)
    other = _model()
    with torch.no_grad():
        other[1].weight.zero_()
    plugin.load_trainable(other, tmp_path)
    torch.testing.assert_close(other[1].weight, model[1].weight)
    with pytest.raises(FileNotFoundError, match="no trainable weights"):
        plugin.load_trainable(other, tmp_path / "absent")


def test_peft_adapter_round_trip_and_key_check(tmp_path):
    """save_peft_adapter writes peft's format (PeftModel.from_pretrained reads it back to the same weights) and
    load_adapter_state refuses a state whose adapter names differ, naming the source."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file

    from mmrl.plugin import PEFT_ADAPTER_WEIGHTS, load_adapter_state, save_peft_adapter

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))

    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"], init_lora_weights=False)
    trained = get_peft_model(model(), lora)
    trainable = {name: p.detach().clone() for name, p in trained.named_parameters() if p.requires_grad}
    save_peft_adapter(trained, trainable, tmp_path)
    assert (tmp_path / PEFT_ADAPTER_WEIGHTS).is_file() and (tmp_path / "adapter_config.json").is_file()
    reloaded = PeftModel.from_pretrained(model(), tmp_path)
    x = torch.randn(3, 4)
    assert torch.allclose(reloaded(x), trained(x))

    fresh = get_peft_model(model(), LoraConfig(r=2, lora_alpha=4, target_modules=["0", "2"]))
    state = load_file(str(tmp_path / PEFT_ADAPTER_WEIGHTS))
    load_adapter_state(fresh, state, tmp_path)
    assert torch.allclose(fresh(x), trained(x))
    state.pop(sorted(state)[0])
    with pytest.raises(KeyError, match="missing"):
        load_adapter_state(fresh, state, "the/source")


def test_check_config_sees_the_whole_validated_config_and_refuses_in_one_line(monkeypatch, tmp_path):
    """Plugin.check_config runs when a config loads, after every section validated (the plugin section is its
    config class, the algorithm section bound), and its ConfigError is the one-line error of any config key."""
    from mmrl.config import ConfigError
    from mmrl.plugin import plugin_registry
    from mmrl.plugins.toy.plugin import ToyPlugin, ToyPluginConfig
    from tests.helpers import toy_config

    seen = []

    class NoKLToy(ToyPlugin):
        name = "no_kl_toy"

        @classmethod
        def check_config(cls, train_config):
            seen.append((type(train_config.plugin.config), train_config.algorithm.kl_coef))
            if train_config.algorithm.kl_coef > 0:
                raise ConfigError("algorithm.kl_coef", train_config.algorithm.kl_coef,
                                  "0 with plugin no_kl_toy (it keeps no reference policy)")

    plugin_registry.names()  # the entry points are read before the test entry is added
    monkeypatch.setitem(plugin_registry._entries, "no_kl_toy", NoKLToy)
    toy_config(tmp_path, "plugin.name=no_kl_toy", "algorithm.kl_coef=0")
    with pytest.raises(ConfigError) as raised:
        toy_config(tmp_path, "plugin.name=no_kl_toy", "algorithm.kl_coef=0.1")
    assert raised.value.key == "algorithm.kl_coef" and "\n" not in str(raised.value)
    assert "allowed: 0 with plugin no_kl_toy" in str(raised.value)
    assert seen == [(ToyPluginConfig, 0.0), (ToyPluginConfig, 0.1)]
    toy_config(tmp_path, "algorithm.kl_coef=0.1")  # the default hook accepts everything
