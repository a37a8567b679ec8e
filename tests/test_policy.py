"""mmrl.policy: the one LoRA config, attach_lora, the reference policy, and save/load in each library's format."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from mmrl.config import ConfigError, from_dict, load_config, to_dict
from mmrl.policy import (
    PEFT_ADAPTER_WEIGHTS,
    LoraConfig,
    attach_lora,
    frozen_copy,
    has_lora,
    load_policy,
    lora_config_class,
    reference_policy,
    save_policy,
)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _perturb(module: nn.Module, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=generator))


def test_one_lora_class_with_each_plugins_defaults_and_yaml_keys():
    from mmrl.plugins.dllm.plugin import DLLMLoraConfig
    from mmrl.plugins.flow.config import FlowLoraConfig
    from mmrl.plugins.vlm.plugin import VLMLoraConfig

    defaults = {cls: (cls().rank, cls().alpha, cls().init) for cls in (FlowLoraConfig, VLMLoraConfig, DLLMLoraConfig)}
    assert defaults == {FlowLoraConfig: (32, 64.0, "gaussian"), VLMLoraConfig: (64, 128.0, "default"),
                        DLLMLoraConfig: (128, 64.0, "default")}
    assert all(issubclass(cls, LoraConfig) for cls in defaults)
    # The keys of every plugin's recipes: flow's init, vlm's and dllm's dropout; a partial section keeps the defaults.
    assert from_dict(FlowLoraConfig, {"rank": 8, "init": "gaussian"}, "plugin.lora") == FlowLoraConfig(rank=8)
    assert from_dict(DLLMLoraConfig, {"dropout": 0.05}, "plugin.lora").alpha == 64.0
    with pytest.raises(ConfigError, match=r"'plugin.lora.target_modules': got \[\]; allowed: null .* non-empty"):
        from_dict(VLMLoraConfig, {"target_modules": []}, "plugin.lora")
    with pytest.raises(ConfigError, match="plugin.lora.dropout"):
        from_dict(VLMLoraConfig, {"dropout": 1.0}, "plugin.lora")
    cls = lora_config_class("MyLora", __name__, rank=2, alpha=4, doc="mine")
    assert cls().rank == 2 and cls.__doc__ == "mine"


@pytest.mark.parametrize("init", ["default", "gaussian"])
def test_attach_lora_freezes_the_base_starts_at_it_and_trains_float32_adapters(init):
    base = _model().to(torch.bfloat16)
    x = torch.randn(5, 4, dtype=torch.bfloat16)
    before = base(x)
    model = attach_lora(base, LoraConfig(rank=2, alpha=4.0, init=init), default_targets=["0", "2"])
    assert model is base and has_lora(model)
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert sorted(trainable) == ["0.lora_A.default.weight", "0.lora_B.default.weight", "2.lora_A.default.weight",
                                 "2.lora_B.default.weight"]
    assert all(p.dtype == torch.float32 for p in trainable.values())
    assert torch.equal(model(x), before)  # B = 0: the adapted model is the base model
    with pytest.raises(ConfigError, match=r"^config key 'plugin.lora.target_modules': got \['nope'\]; allowed: "
                                          r"module-name suffixes present in the toy model \(.*\)$"):
        attach_lora(_model(), LoraConfig(target_modules=["nope"]), default_targets=["0"], what="the toy model")


def test_a_long_target_list_that_peft_shortens_is_not_taken_for_an_moe_rewrite():
    """peft replaces 20 or more module targets by the fewest suffixes matching the same modules: the adapter lands on
    exactly the named modules and attach_lora accepts it (the MoE-rewrite check refused it, which the LTX-2 adapter's
    28 Flow-Factory targets hit)."""
    blocks = nn.ModuleList(nn.ModuleDict({name: nn.Linear(2, 2) for name in ("q", "k", "v", "o", "skip")})
                           for _ in range(5))
    model = nn.Module()
    model.blocks = blocks
    targets = [f"blocks.{i}.{name}" for i in range(5) for name in ("q", "k", "v", "o")]  # 20 targets
    attach_lora(model, LoraConfig(rank=2, target_modules=targets), default_targets=["q"])
    adapted = sorted(name.removesuffix(".lora_A.default.weight") for name, _ in model.named_parameters()
                     if name.endswith("lora_A.default.weight"))
    assert adapted == sorted(targets)
    assert sorted(model.peft_config["default"].target_modules) != sorted(targets)  # peft did shorten them


def test_reference_policy_is_the_adapter_off_model_or_the_frozen_copy():
    x = torch.randn(5, 4)
    base_out = _model()(x)
    model = attach_lora(_model(), LoraConfig(rank=2, alpha=4.0), default_targets=["0", "2"])
    _perturb(model)
    adapted = model(x)
    assert (adapted - base_out).abs().max() > 1e-2
    with reference_policy(model) as reference:
        assert reference is model
        torch.testing.assert_close(reference(x), base_out, rtol=0, atol=1e-6)
    assert torch.equal(model(x), adapted)  # switched back on
    assert all(p.requires_grad for name, p in model.named_parameters() if "lora_" in name)
    with pytest.raises(KeyError), reference_policy(model):
        raise KeyError("inside the block")
    assert torch.equal(model(x), adapted)  # also after an error

    full = _model()
    frozen = frozen_copy(full)
    with torch.no_grad():
        full[0].weight.add_(1.0)
    with reference_policy(full, frozen) as reference:
        assert reference is frozen and not any(p.requires_grad for p in reference.parameters())
        torch.testing.assert_close(reference(x), base_out, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="needs_reference was False"), reference_policy(full):
        pass


def test_peft_folder_loads_with_peft_model_and_back_and_refuses_another_rank(tmp_path):
    from peft import PeftModel

    x = torch.randn(5, 4)
    trained = attach_lora(_model(), LoraConfig(rank=2, alpha=4.0), default_targets=["0", "2"])
    _perturb(trained)
    save_policy(trained, tmp_path, "peft_lora")
    saved = load_file(str(tmp_path / PEFT_ADAPTER_WEIGHTS))
    assert saved and all(name.startswith("base_model.model.") for name in saved)  # PeftModel's names
    assert json.loads((tmp_path / "adapter_config.json").read_text())["r"] == 2
    reloaded = PeftModel.from_pretrained(_model(), str(tmp_path))
    torch.testing.assert_close(reloaded(x), trained(x), rtol=0, atol=1e-6)

    fresh = attach_lora(_model(), LoraConfig(rank=2, alpha=4.0), default_targets=["0", "2"])
    load_policy(fresh, tmp_path, "peft_lora", lora=LoraConfig(rank=2, alpha=4.0))
    assert torch.equal(fresh(x), trained(x))
    other = attach_lora(_model(), LoraConfig(rank=3, alpha=4.0), default_targets=["0", "2"])
    with pytest.raises(ValueError, match="holds a LoRA of rank 2 and alpha 4.0; this run has rank 3"):
        load_policy(other, tmp_path, "peft_lora", lora=LoraConfig(rank=3, alpha=4.0))
    with pytest.raises(FileNotFoundError, match="no LoRA adapter at"):
        load_policy(fresh, tmp_path / "absent", "peft_lora")


def test_adapters_written_before_the_policy_module_still_load(tmp_path):
    """Checkpoints of the current main: the dLLM plugin wrote its injected adapter without peft's
    ``base_model.model.`` prefix, the VLM plugin (a PeftModel then) with it. Both load into an injected adapter."""
    x = torch.randn(5, 4)
    trained = attach_lora(_model(), LoraConfig(rank=2, alpha=4.0), default_targets=["0", "2"])
    _perturb(trained)
    save_policy(trained, tmp_path / "new", "peft_lora")
    prefixed = load_file(str(tmp_path / "new" / PEFT_ADAPTER_WEIGHTS))
    (tmp_path / "old").mkdir()
    save_file({name.removeprefix("base_model.model."): t for name, t in prefixed.items()},
              str(tmp_path / "old" / PEFT_ADAPTER_WEIGHTS))
    for folder in ("new", "old"):
        fresh = attach_lora(_model(), LoraConfig(rank=2, alpha=4.0), default_targets=["0", "2"])
        load_policy(fresh, tmp_path / folder, "peft_lora")
        assert torch.equal(fresh(x), trained(x)), folder
    state = dict(prefixed)
    state.pop(sorted(state)[0])
    save_file(state, str(tmp_path / "old" / PEFT_ADAPTER_WEIGHTS))
    with pytest.raises(KeyError, match="missing"):
        load_policy(attach_lora(_model(), LoraConfig(rank=2), default_targets=["0", "2"]), tmp_path / "old",
                    "peft_lora")


def test_trainable_and_pretrained_formats_round_trip(tmp_path):
    from transformers import BertConfig, BertModel

    model = _model()
    model[0].requires_grad_(False)
    save_policy(model, tmp_path / "t", "trainable")
    assert sorted(load_file(str(tmp_path / "t" / "trainable.safetensors"))) == ["2.bias", "2.weight"]
    fresh = _model(seed=3)
    fresh[0].requires_grad_(False)
    load_policy(fresh, tmp_path / "t", "trainable")
    assert torch.equal(fresh[2].weight, model[2].weight) and not torch.equal(fresh[0].weight, model[0].weight)
    with pytest.raises(TypeError, match="no save_pretrained"):
        save_policy(model, tmp_path / "p", "pretrained")

    torch.manual_seed(0)
    config = BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=16)
    bert = BertModel(config)
    save_policy(bert, tmp_path / "bert", "pretrained")
    other = BertModel(config)
    load_policy(other, tmp_path / "bert", "pretrained")
    assert all(torch.equal(a, b) for a, b in zip(bert.state_dict().values(), other.state_dict().values(),
                                                  strict=True))
    with pytest.raises(ValueError, match="policy format 'onnx'"):
        save_policy(bert, tmp_path / "x", "onnx")


def test_a_checkpoint_config_without_keys_added_since_resumes(tmp_path):
    """A checkpoint of the current main recorded plugin.lora without `init` (dllm, vlm) or `dropout` (flow): the
    config check reads it with today's defaults, and still refuses a real difference."""
    from mmrl.trainer.checkpoint import CheckpointError, check_compatible

    config = load_config({"plugin": {"name": "dllm", "lora": {"rank": 4, "alpha": 8.0}},
                          "run": {"output_dir": str(tmp_path)}, "rewards": {"functions": [{"name": "gsm8k_answer"}]}})
    current = to_dict(config)
    saved = to_dict(config)
    del saved["plugin"]["lora"]["init"]
    check_compatible(saved, current, tmp_path)
    saved["plugin"]["lora"]["rank"] = 8
    with pytest.raises(CheckpointError, match=r"plugin.lora.rank: checkpoint 8, now 4"):
        check_compatible(saved, current, tmp_path)


def test_export_refuses_what_is_in_the_way_and_writes_atomically(tmp_path, monkeypatch):
    """The toy plugin's model has a save_pretrained: its export is that folder. OUT is written aside and
    renamed: an export that fails leaves neither OUT nor the staging folder; bad runs, checkpoints and OUTs are one
    line each."""
    from mmrl.plugins.toy.model import TinySequencePolicy
    from mmrl.plugins.toy.plugin import ToyPlugin
    from mmrl.policy import EXPORT_INFO, ExportError, export_run
    from mmrl.trainer import Trainer
    from tests.helpers import toy_config

    with pytest.raises(ExportError, match="no run folder at"):
        export_run(tmp_path / "absent", tmp_path / "out")
    run = tmp_path / "run"
    trainer = Trainer(toy_config(run, "run.max_steps=1"))
    initial = {name: p.detach().clone() for name, p in trainer.plugin.policy().named_parameters()}
    trainer.train()
    trained = {name: p.detach().clone() for name, p in trainer.plugin.policy().named_parameters()}
    assert any(not torch.equal(initial[name], trained[name]) for name in trained)  # the export must carry the step

    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "a").write_text("x")
    for blocked in ("file", "full"):
        with pytest.raises(ExportError, match=rf"^export folder .*{blocked} already exists and is not empty; "):
            export_run(run, tmp_path / blocked)
    with pytest.raises(ExportError, match=r"--checkpoint 'step-9' is not a complete checkpoint .*step-00000001"):
        export_run(run, tmp_path / "out", checkpoint="step-9")

    def broken(self, policy, directory):
        (directory / "partial.bin").parent.mkdir(parents=True, exist_ok=True)
        (directory / "partial.bin").write_bytes(b"1")
        raise OSError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(ToyPlugin, "export", broken)
        with pytest.raises(OSError, match="disk full"):
            export_run(run, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "full", "run"]

    (tmp_path / "out").mkdir()  # an empty folder is fine
    out = export_run(run, tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", EXPORT_INFO, "model.safetensors"]
    saved = dict(TinySequencePolicy.from_pretrained(out).named_parameters())
    assert saved.keys() == trained.keys() and all(torch.equal(saved[k], trained[k]) for k in saved)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "full", "out", "run"]


def test_export_writes_the_ema_weights_when_the_run_evaluated_with_them(tmp_path):
    """With ema.enabled each checkpoint also holds policy_ema/; `export` writes it by default when the run's
    evaluations used it (what Flow-GRPO saves), the trained weights with weights='raw', and refuses 'ema' without it."""
    from mmrl.plugins.toy.model import TinySequencePolicy
    from mmrl.policy import EXPORT_INFO, ExportError, export_run
    from mmrl.trainer import Trainer
    from tests.helpers import toy_config

    run = tmp_path / "run"
    trainer = Trainer(toy_config(run, "run.max_steps=2", "ema.enabled=true", "ema.update_every=1"))
    trainer.train()
    names = [name for name, p in trainer.policy.named_parameters() if p.requires_grad]
    averaged = dict(zip(names, trainer.ema.shadow, strict=True))
    trained = {name: p.detach().clone() for name, p in trainer.policy.named_parameters()}
    assert any(not torch.equal(averaged[name], trained[name]) for name in names)  # the two differ after 2 steps

    for weights, expected in (("auto", averaged), ("ema", averaged), ("raw", trained)):
        out = export_run(run, tmp_path / weights, weights=weights)
        saved = dict(TinySequencePolicy.from_pretrained(out).named_parameters())
        assert all(torch.equal(saved[name], expected[name].to(saved[name].dtype)) for name in names), weights
        assert json.loads((out / EXPORT_INFO).read_text())["weights"] == ("raw" if weights == "raw" else "ema")

    plain = tmp_path / "plain"
    Trainer(toy_config(plain, "run.max_steps=1")).train()
    assert json.loads((export_run(plain, tmp_path / "plain-out") / EXPORT_INFO).read_text())["weights"] == "raw"
    # An EMA the evaluations did not use, and a checkpoint written before EMA weights were saved: auto gives the
    # trained weights (and says so), as export always did for them.
    unused = tmp_path / "unused"
    Trainer(toy_config(unused, "run.max_steps=1", "ema.enabled=true", "ema.use_for_eval=false")).train()
    assert json.loads((export_run(unused, tmp_path / "unused-out") / EXPORT_INFO).read_text())["weights"] == "raw"
    old = run / "checkpoints" / "step-00000002"
    shutil.rmtree(old / "policy_ema")
    assert json.loads((export_run(run, tmp_path / "old-auto") / EXPORT_INFO).read_text())["weights"] == "raw"
    with pytest.raises(ExportError, match=r"cannot export the EMA weights of step-00000002: this checkpoint has no "
                                          r"policy_ema/ \(written by an mmrl before EMA exports\); use --weights raw"):
        export_run(run, tmp_path / "old-ema", weights="ema")
    with pytest.raises(ExportError, match=r"cannot export the EMA weights of step-00000001: the run did not keep an "
                                          r"EMA \(ema.enabled is false\); use --weights raw"):
        export_run(plain, tmp_path / "plain-ema", weights="ema")


def test_export_command_passes_weights_and_reports_them(tmp_path, capsys):
    """`mmrl export RUN OUT --weights ...`: the choice reaches export_run and the printed line names the weights; a
    refused choice is one line on stderr and exit code 1."""
    from mmrl.cli import main
    from mmrl.policy import EXPORT_INFO
    from mmrl.trainer import Trainer
    from tests.helpers import toy_config

    run = tmp_path / "run"
    Trainer(toy_config(run, "run.max_steps=1", "ema.enabled=true", "ema.update_every=1")).train()
    assert main(["export", str(run), str(tmp_path / "raw"), "--weights", "raw"]) == 0
    assert "(toy plugin, pretrained, trained weights)" in capsys.readouterr().out
    assert json.loads((tmp_path / "raw" / EXPORT_INFO).read_text())["weights"] == "raw"
    assert main(["export", str(run), str(tmp_path / "auto")]) == 0
    assert "EMA weights" in capsys.readouterr().out
    plain = tmp_path / "plain"
    Trainer(toy_config(plain, "run.max_steps=1")).train()
    assert main(["export", str(plain), str(tmp_path / "none"), "--weights", "ema"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("mmrl: ExportError: cannot export the EMA weights") and "\n" not in err
