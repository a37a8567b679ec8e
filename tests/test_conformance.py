"""The conformance kit (mmrl.testing.check_plugin): the reference plugin passes it, and broken plugins fail it on the
property they break, with a one-line message that says why."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mmrl.plugin import PolicyOutput
from mmrl.plugins.toy.plugin import ToyPlugin
from mmrl.policy import save_policy
from mmrl.testing import PROPERTIES, ConformanceError, check_plugin

# A small toy task: the kit only rolls out 2 prompts x 2 samples.
TOY = {"train_size": 16, "eval_size": 4, "min_length": 3, "max_length": 4}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _fails(plugin_cls, prop: str, match: str, config=None, **kwargs) -> ConformanceError:
    with pytest.raises(ConformanceError, match=match) as raised:
        check_plugin(plugin_cls, TOY if config is None else config, **kwargs)
    assert raised.value.property == prop, str(raised.value)
    assert isinstance(raised.value, AssertionError) and "\n" not in str(raised.value)
    assert str(raised.value).startswith(f"{plugin_cls.__name__} fails {prop!r}: ")
    return raised.value


def test_the_reference_plugin_passes_every_property(tmp_path):
    checked = check_plugin(ToyPlugin, {"name": "toy", **TOY}, directory=tmp_path)
    assert checked == list(PROPERTIES)  # the toy supports action chunks: nothing is skipped
    assert checked.skipped == {}
    assert (tmp_path / "samples" / "conformance.jsonl").is_file()
    assert (tmp_path / "trainable" / "trainable.safetensors").is_file()
    # the toy's model has save_pretrained: a full fine-tune exports as its library's own folder
    assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "export").iterdir()}


def test_a_config_instance_and_other_sections_are_accepted():
    config = dataclasses.replace(ToyPlugin.config_class(), **TOY)
    checked = check_plugin(ToyPlugin, config, train_config={"algorithm": {"kl_coef": 0.1, "inner_epochs": 3}})
    assert "reference policy" in checked


class ShiftedForward(ToyPlugin):
    """Recomputes log-probs that differ from the sampler's by a constant (e.g. a forgotten temperature)."""

    def forward(self, policy, rollout, *, need_reference, actions=None):
        output = super().forward(policy, rollout, need_reference=need_reference, actions=actions)
        return dataclasses.replace(output, logp=output.logp - 0.1)


def test_a_forward_that_disagrees_with_the_sampler_fails_ratio_one():
    error = _fails(ShiftedForward, "ratio == 1 on the first forward", r"max \|ratio - 1\| = 0\.095")
    assert "the rollout's old_logp" in str(error)  # exp(-0.1) - 1 = -0.0952, against the sampler's old_logp


class ShiftedForwardWithoutOldLogp(ShiftedForward):
    """The same shift, but the rollout leaves old_logp to the core: its pass uses forward, so the ratio stays 1; the
    shift then shows against the reference (a frozen copy scored without the shift)."""

    def rollout(self, policy, batch):
        return dataclasses.replace(super().rollout(policy, batch), old_logp=None)


def test_without_old_logp_the_kit_uses_the_cores_pass_and_the_reference_catches_the_shift():
    _fails(ShiftedForwardWithoutOldLogp, "reference policy", "reference's log-probs differ from the policy's")


class WrongMask(ToyPlugin):
    """Returns a mask one action narrower than old_logp."""

    def rollout(self, policy, batch):
        rollout = super().rollout(policy, batch)
        return dataclasses.replace(rollout, mask=rollout.mask[:, :-1])


def test_a_wrong_shaped_mask_fails_the_training_rollout():
    _fails(WrongMask, "training rollout", r"raised RolloutError: rollout.old_logp must match mask")


class ForeignGroups(ToyPlugin):
    """Numbers its samples' groups itself instead of returning the batch's group ids."""

    def rollout(self, policy, batch):
        rollout = super().rollout(policy, batch)
        return dataclasses.replace(rollout, group_ids=torch.arange(len(batch), dtype=torch.long))


def test_group_ids_other_than_the_batchs_fail():
    _fails(ForeignGroups, "training rollout", r"group_ids \[0, 1, 2, 3\] differ from the batch's \[0, 0, 1, 1\]")


class BatchDependent(ToyPlugin):
    """Log-probs that depend on the micro-batch: centred over the batch (a batch statistic leaking into forward)."""

    def forward(self, policy, rollout, *, need_reference, actions=None):
        output = super().forward(policy, rollout, need_reference=need_reference, actions=actions)
        logp = output.logp - output.logp.mean(dim=0, keepdim=True).detach() + output.logp.detach().mean()
        return PolicyOutput(logp=logp, ref_logp=output.ref_logp, entropy=output.entropy)

    def rollout(self, policy, batch):
        return dataclasses.replace(super().rollout(policy, batch), old_logp=None)


def test_log_probs_that_depend_on_the_micro_batch_fail():
    _fails(BatchDependent, "micro-batch invariance", r"micro-batches \[\[.*\]\] give log-probs that differ",
           reference_is_initial=False)


class ChunksIgnored(ToyPlugin):
    """Claims action chunks but always returns the first columns, whatever ``actions`` asks for."""

    def forward(self, policy, rollout, *, need_reference, actions=None):
        output = super().forward(policy, rollout, need_reference=need_reference)
        if actions is not None:
            output = PolicyOutput(logp=output.logp[:, : len(actions)])
        return output


def test_action_chunks_that_ignore_the_requested_columns_fail():
    _fails(ChunksIgnored, "action chunks", "action chunks of 1 column")


class ForgetfulLoad(ToyPlugin):
    """load_trainable reads the file but never copies the weights back."""

    def load_trainable(self, policy, directory):
        return None


def test_a_load_that_restores_nothing_fails_the_round_trip():
    _fails(ForgetfulLoad, "save/load round trip", r"load_trainable left \d+ of \d+ trainable tensors different")


class DetachedReference(ToyPlugin):
    """Offers a reference model for algorithm.ref_sync_every that forward never scores with."""

    def reference_module(self):
        if not hasattr(self, "_detached"):
            import copy

            self._detached = copy.deepcopy(self.reference)
        return self._detached


def test_a_reference_module_that_forward_does_not_use_fails_the_reference_policy():
    _fails(DetachedReference, "reference policy", "not the module forward scores the reference with")


class MisnamedReference(ToyPlugin):
    def reference_module(self):
        return torch.nn.Linear(2, 2)


def test_a_reference_module_that_does_not_pair_with_the_policy_fails_the_reference_policy():
    _fails(MisnamedReference, "reference policy", "has no parameter")


class EmptyEval(ToyPlugin):
    def dataset(self, split):
        return [] if split == "eval" else super().dataset(split)


def test_an_empty_split_fails_the_datasets():
    _fails(EmptyEval, "datasets", r"dataset\('eval'\) is empty")


class NoKL(ToyPlugin):
    @classmethod
    def check_config(cls, train_config):
        from mmrl.config import ConfigError

        if train_config.algorithm.kl_coef > 0:
            raise ConfigError("algorithm.kl_coef", train_config.algorithm.kl_coef, "0 with this plugin")


def test_config_validation_names_the_key_and_check_config_sees_the_other_sections():
    _fails(ToyPlugin, "config validation", r"the config was refused: config key 'plugin.max_length': got 2",
           config={**TOY, "max_length": 2})
    _fails(ToyPlugin, "config validation", r"'plugin.tsk': got 'sort'.*did you mean 'task'",
           config={**TOY, "tsk": "sort"})
    _fails(NoKL, "config validation", r"check_config refused the config: config key 'algorithm.kl_coef': got 0.1",
           train_config={"algorithm": {"kl_coef": 0.1}})
    assert "config validation" in check_plugin(NoKL, TOY, train_config={"algorithm": {"kl_coef": 0.0}})


def test_unknown_sections_of_the_train_config_are_refused_by_name():
    _fails(ToyPlugin, "config validation", r"config key 'algo': got \{\}; allowed: one of the sections rewards, run",
           train_config={"algo": {}})
    _fails(ToyPlugin, "config validation", r"config key 'plugin'.*the plugin section is check_plugin's config",
           train_config={"plugin": {"name": "toy"}})


class StaleExport(ToyPlugin):
    """Exports the initial weights (the frozen reference copy) instead of the trained policy."""

    def export(self, policy, directory):
        save_policy(self.reference, directory, "pretrained")
        return "pretrained"


def test_an_export_of_the_initial_weights_fails():
    _fails(StaleExport, "export", r"a new plugin that loads the 'pretrained' export gives log-probs that differ from "
           r"the exported policy's \(max difference")


class UnknownExportFormat(ToyPlugin):
    def export(self, policy, directory):
        super().export(policy, directory)
        return "onnx"


def test_an_export_format_outside_the_policy_formats_fails():
    _fails(UnknownExportFormat, "export", r"export returned 'onnx', not one of diffusers_lora, peft_lora, pretrained")


class NoExport(ToyPlugin):
    def export(self, policy, directory):
        raise NotImplementedError("the policy lives on an inference server")


def test_a_plugin_without_export_is_skipped_with_the_reason(tmp_path):
    checked = check_plugin(NoExport, TOY, directory=tmp_path)
    assert checked == [p for p in PROPERTIES if p != "export"]
    assert checked.skipped == {"export": "NoExport.export raised NotImplementedError: the policy lives on an "
                                         "inference server"}


class VectorAuxLoss(ToyPlugin):
    """Returns a per-sample regulariser instead of one value."""

    def forward(self, policy, rollout, *, need_reference, actions=None):
        output = super().forward(policy, rollout, need_reference=need_reference, actions=actions)
        return dataclasses.replace(output, aux_loss=output.logp.sum(dim=1))


def test_an_aux_loss_of_several_values_fails():
    _fails(VectorAuxLoss, "ratio == 1 on the first forward",
           r"aux_loss shape \(4,\); expected None or one finite value")
