"""The plugin's own decode loop (``plugin.decoder: mmrl``, mmrl.plugins.vlm.decode) against transformers' ``generate``
(``decoder: hf``) on the tiny Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4.1V/4.5V (and MoE), InternVL, Gemma 4 and
Gemma 3 builds with LoRA (Gemma 4: soft-capped logits and sliding-window layers whose window the prompts exceed; Gemma
3: bidirectional image blocks through ``token_type_ids`` in the prefill, every image the tower's fixed square;
Mistral 3: images padded to the batch's largest with their ``image_sizes``, position-dependent query scaling):
the same tokens greedy and sampled (the same seed; both draw ``multinomial(softmax(scores), 1)`` per step), rows that
end early padded after their EOS, ``max_new_tokens``, mixed image sizes, shared prefill on and off; the scores it
samples from against hand-computed values and against the teacher-forced log-probs (an independent check of the
M-RoPE positions of the decode steps).

Token equality with ``generate`` holds because both run the same forwards on the same batch (prefill included when
the prefill is not shared) and draw from the RNG identically; with the shared prefill the first step's logits come
from a differently shaped call, equal up to float rounding, which changes a sampled or argmax token only if a
uniform draw or a top-2 gap falls within ~1e-6 — far from it on these models and seeds.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from mmrl.config import ConfigError
from mmrl.config.schema import from_dict
from mmrl.plugins.vlm.decode import SamplingSettings, next_token_scores
from mmrl.plugins.vlm.plugin import VLMPluginConfig
from tests.vlm.conftest import make_plugin, plugin_options

ALL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe", "qwen3_5_moe", "glm4v", "glm4v_moe",
                "glm46v", "glm46v_moe", "internvl", "gemma4", "gemma3", "mistral3", "smolvlm", "idefics3")
BUILD_ADAPTERS = {"glm46v_moe": "glm46v"}
"""The adapter that loads a tiny build of another name (GLM-4.6V's MoE build is family glm46v, MoE read from its
checkpoint); every other build is loaded by the adapter of its own name."""
GROUPS = torch.tensor([0, 1, 2, 0, 1, 2, 1, 0])  # interleaved groups, as the spread layout deals them


@pytest.fixture(scope="module")
def decode_plugins(tiny_models, tmp_path_factory):
    """A LoRA plugin per family (Qwen3-VL when transformers has it) with non-zero LoRA B, so the adapter matters."""
    from mmrl.plugins.vlm.adapters import vlm_adapters
    from mmrl.plugins.vlm.testing import build_tiny_model

    plugins = {}
    for family in ALL_FAMILIES:
        if BUILD_ADAPTERS.get(family, family) not in vlm_adapters:
            continue
        path = tiny_models.get(family) or build_tiny_model(family, tmp_path_factory.mktemp("qwen3") / family)
        torch.manual_seed(0)  # the LoRA A initialisation
        plugin = make_plugin(path, max_new_tokens=12)
        fill_lora_b(plugin.model, seed=3)
        plugins[family] = plugin
    return plugins


def fill_lora_b(model, seed):
    """Fill every LoRA B with normal draws from a generator seeded ``seed`` (peft starts B at zero, where the adapter
    changes nothing): the tokens then vary and depend on the adapter."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator))


def _plugin(decode_plugins, family):
    if family not in decode_plugins:
        pytest.skip(f"transformers has no {family}")
    return decode_plugins[family]


def _prompts(plugin):
    rows = plugin.dataset("train")[:3]
    model = plugin.model if plugin.cache_features else None
    prompts = plugin.encode_rows([rows[g] for g in GROUPS.tolist()], GROUPS, model=model)
    if plugin.adapter.name == "gemma3":  # every image resized to the tower's square: prompts differ in their text
        assert len({p["input_ids"].numel() for p in prompts}) > 1
    else:
        assert len({_image_layout(p) for p in prompts}) > 1  # mixed image sizes (InternVL: tile counts)
    return prompts


def _image_layout(prompt):
    """What tells a prompt's image sizes apart: its grids, or (InternVL, no grids) its tiles' or features' shape."""
    if "image_grid_thw" in prompt:
        return tuple(prompt["image_grid_thw"].flatten().tolist())
    return tuple(prompt.get("image_embeds", prompt.get("pixel_values")).shape)


def _generate(plugin, prompts, config, decoder, share, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        sequences, width = plugin.adapter.generate(plugin.model, prompts, config, share_prefill=share, decoder=decoder)
    return sequences[:, width:]


def _lengths(tokens, eos):
    """Each row's length up to and including its first EOS (the whole row without one)."""
    is_eos = torch.isin(tokens, torch.tensor(eos))
    return [int(flags.nonzero()[0]) + 1 if flags.any() else tokens.shape[1] for flags in is_eos]


def _config(plugin, sampled, **changes):
    config = plugin.generation_config(sampled)
    if sampled:
        config.temperature, config.top_k, config.top_p = 0.8, 60, 0.95
    for key, value in changes.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("family", ALL_FAMILIES)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("share", [False, True], ids=["plain", "shared"])
def test_tokens_match_hf_generate(decode_plugins, family, sampled, share):
    """The same tokens as ``generate`` (always run with a plain prefill here), with rows ending early: an ordinary
    token that some rows of the first run emit and a row that ran to ``max_new_tokens`` never does is made an extra
    EOS id of the second run, so the former end at it and the latter still runs to ``max_new_tokens``; everything
    after a row's EOS is pad."""
    plugin = _plugin(decode_plugins, family)
    prompts = _prompts(plugin)
    config = _config(plugin, sampled)
    first = _generate(plugin, prompts, config, "mmrl", share, seed=11)
    torch.testing.assert_close(first, _generate(plugin, prompts, config, "hf", False, seed=11), rtol=0, atol=0)
    assert first.shape[1] <= config.max_new_tokens

    pad, real_eos = plugin.adapter.pad_token_id, list(config.eos_token_id)
    lengths = _lengths(first, real_eos)
    full = [set(row.tolist()) for row, n in zip(first, lengths, strict=True) if n == first.shape[1]]
    candidates = [int(token) for column in first.T for token in column.tolist()]
    special = set(real_eos) | {pad}
    extra = next(token for token in candidates if token not in special and any(token not in row for row in full))
    ended = _config(plugin, sampled, eos_token_id=[*real_eos, extra])
    ours = _generate(plugin, prompts, ended, "mmrl", share, seed=11)
    theirs = _generate(plugin, prompts, ended, "hf", False, seed=11)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    lengths = _lengths(ours, [*real_eos, extra])
    for row, length in zip(ours, lengths, strict=True):
        assert (row[length:] == pad).all()
    assert ours.shape[1] == max(lengths) == config.max_new_tokens
    assert min(lengths) < max(lengths)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_sampling_scores_are_the_teacher_forced_distribution(decode_plugins, family):
    """Each step's scores (temperature 0.7, no top-k/top-p) give each sampled token the log-prob the plugin's
    teacher-forced pass computes for it: the decode steps see the positions and cache of the whole sequence."""
    plugin = _plugin(decode_plugins, family)
    assert_decode_scores_are_teacher_forced(plugin, _prompts(plugin), _config(plugin, True, top_k=0, top_p=1.0))


def assert_decode_scores_are_teacher_forced(plugin, prompts, config, temperature=0.7, seed=5):
    """Sample ``prompts`` with the plugin's decode loop at ``temperature`` (seeded) and check that each step's scores
    give each sampled token the log-prob of the plugin's teacher-forced pass at that temperature."""
    config.temperature = temperature
    torch.manual_seed(seed)
    with torch.no_grad():
        output, _ = plugin.adapter.generate(plugin.model, prompts, config, output_scores=True)
    tokens = output.tokens  # [n, C]
    scores = torch.stack(output.scores, dim=1).log_softmax(-1)  # [n, C, V]
    sampled = scores.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [n, C]
    saved = plugin.config.temperature
    plugin.config.temperature = temperature
    try:
        with torch.no_grad():
            logp, _ = plugin.token_logp(plugin.policy(), prompts, list(tokens), tokens.shape[1], with_entropy=False)
    finally:
        plugin.config.temperature = saved
    torch.testing.assert_close(logp, sampled, rtol=0, atol=1e-4)


def test_max_new_tokens_is_respected(decode_plugins):
    plugin = _plugin(decode_plugins, "qwen2_5_vl")
    prompts = _prompts(plugin)
    for budget in (1, 3):
        config = _config(plugin, True, max_new_tokens=budget, eos_token_id=[plugin.adapter.pad_token_id])
        tokens = _generate(plugin, prompts, config, "mmrl", True, seed=2)
        assert tokens.shape == (len(prompts), budget)


def test_rollout_is_the_same_with_either_decoder(decode_plugins):
    """The plugin's rollout (seeded from the batch, shared prefill, features cached) samples the same completions
    through ``decoder: mmrl`` and ``decoder: hf``."""
    from tests.vlm.conftest import prompt_batch

    plugin = _plugin(decode_plugins, "qwen2_vl")
    batch = prompt_batch(plugin.dataset("train")[:3], 3, seed=7)
    completions = {}
    try:
        for decoder in ("hf", "mmrl"):
            plugin.config.decoder = decoder
            completions[decoder] = plugin.rollout(plugin.policy(), batch).replay["completion_ids"]
    finally:
        plugin.config.decoder = "mmrl"
    assert len(completions["mmrl"]) == 9
    for ours, theirs in zip(completions["mmrl"], completions["hf"], strict=True):
        assert torch.equal(ours, theirs)


def test_scores_by_hand():
    """Suppression, temperature, top-k (ties with the k-th kept) and top-p on numbers worked by hand."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, 5.0, 4.0]])
    settings = SamplingSettings(max_new_tokens=1, eos_token_ids=(0,), pad_token_id=0, temperature=2.0, top_k=3,
                                top_p=0.6, suppress_token_ids=(4,))
    # /2 with token 4 suppressed: [0.5, 1.5, 1.0, 0.0, -inf, 2.0]; top-3: tokens 5, 1, 2 with probabilities
    # e^2, e^1.5, e^1 over their sum = 0.506, 0.307, 0.186; top-p 0.6 keeps 5 (0.506 < 0.6) and 1 (0.813 >= 0.6).
    scores = next_token_scores(logits, settings)
    inf = float("-inf")
    assert scores.tolist() == [[inf, 1.5, inf, inf, inf, 2.0]]
    probs = scores.softmax(-1)[0]
    assert math.isclose(float(probs[5]), 1 / (1 + math.exp(-0.5)), rel_tol=1e-6)

    only_k = next_token_scores(torch.tensor([[1.0, 2.0, 2.0, 0.0]]), SamplingSettings(
        max_new_tokens=1, eos_token_ids=(0,), pad_token_id=0, top_k=2))
    assert only_k.tolist() == [[inf, 2.0, 2.0, inf]]
    tied = next_token_scores(torch.tensor([[3.0, 2.0, 2.0, 0.0]]), SamplingSettings(
        max_new_tokens=1, eos_token_ids=(0,), pad_token_id=0, top_k=2))
    assert tied.tolist() == [[3.0, 2.0, 2.0, inf]]  # the k-th value's ties stay

    greedy = SamplingSettings(max_new_tokens=1, eos_token_ids=(0,), pad_token_id=0, do_sample=False,
                              temperature=2.0, top_k=1, suppress_token_ids=(4,))
    assert next_token_scores(logits, greedy).tolist() == [[1.0, 3.0, 2.0, 0.0, inf, 4.0]]  # only suppression


def test_settings_refuse_what_the_loop_does_not_implement(decode_plugins):
    plugin = _plugin(decode_plugins, "qwen2_5_vl")
    config = plugin.generation_config(True)
    assert SamplingSettings.from_generation_config(config).suppress_token_ids == tuple(plugin.suppressed_ids)
    config.repetition_penalty = 1.3
    with pytest.raises(ValueError, match="repetition_penalty=1.3.*decoder 'hf'"):
        SamplingSettings.from_generation_config(config)
    config.repetition_penalty, config.num_return_sequences = 1.0, 2
    with pytest.raises(ValueError, match="num_return_sequences=2"):
        SamplingSettings.from_generation_config(config)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingSettings(max_new_tokens=1, eos_token_ids=(0,), pad_token_id=0, top_p=1.5)


def test_decoder_option_is_validated():
    options = plugin_options("unused", decoder="beam")
    with pytest.raises(ConfigError) as error:
        from_dict(VLMPluginConfig, options, "plugin")
    assert error.value.key == "plugin.decoder" and "'mmrl'" in error.value.allowed and "\n" not in str(error.value)
    assert from_dict(VLMPluginConfig, plugin_options("unused"), "plugin").decoder == "mmrl"


def test_sdpa_attention_gives_generate_tokens_too(tiny_models):
    """The prebuilt 4D step mask in sdpa's boolean form (the tests above run eager attention, the additive form)."""
    plugin = make_plugin(tiny_models["qwen2_5_vl"], max_new_tokens=12, attn_implementation="sdpa")
    fill_lora_b(plugin.model, seed=4)
    prompts = _prompts(plugin)
    assert len({len(p["input_ids"]) for p in prompts}) > 1  # left padding: the mask matters
    for sampled in (False, True):
        config = _config(plugin, sampled)
        ours = _generate(plugin, prompts, config, "mmrl", True, seed=13)
        torch.testing.assert_close(ours, _generate(plugin, prompts, config, "hf", False, seed=13), rtol=0, atol=0)


def test_plain_lora_forwards_compute_peft_forward(decode_plugins):
    """Inside the block every plain LoRA layer of the model computes what peft's forward computes (one call per
    layer on a random input); outside it peft's forward is back; layers with dropout or an already wrapped forward
    keep theirs."""
    from peft.tuners.lora import Linear as LoraLinear

    from mmrl.plugins.vlm.decode import plain_lora_forwards

    plugin = _plugin(decode_plugins, "qwen2_5_vl")
    layers = [m for m in plugin.model.modules() if isinstance(m, LoraLinear)]
    inputs = [torch.randn(3, 2, layer.in_features, generator=torch.Generator().manual_seed(i))
              for i, layer in enumerate(layers)]
    with torch.no_grad():
        expected = [layer(x) for layer, x in zip(layers, inputs, strict=True)]
        with plain_lora_forwards(plugin.model) as switched:
            assert switched == len(layers) > 0
            assert all("forward" in vars(layer) for layer in layers)
            got = [layer(x) for layer, x in zip(layers, inputs, strict=True)]
    assert not any("forward" in vars(layer) for layer in layers)
    for value, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(value, reference, rtol=1e-6, atol=1e-6)

    dropped, wrapped = layers[0], layers[1]
    saved = dropped.lora_dropout["default"]
    dropped.lora_dropout["default"] = torch.nn.Dropout(0.5)
    wrapper = wrapped.forward  # an instance-level forward, as accelerate's device hooks install
    wrapped.forward = wrapper
    try:
        with plain_lora_forwards(plugin.model) as switched:
            assert switched == len(layers) - 2 and "forward" not in vars(dropped)
            assert vars(wrapped)["forward"] is wrapper
        assert vars(wrapped)["forward"] is wrapper
    finally:
        dropped.lora_dropout["default"] = saved
        del wrapped.forward


def test_text_only_prompts_match_hf_generate(decode_plugins):
    """Prompts without images (plain text positions on all three M-RoPE components), left-padded to different
    lengths, shared prefill on and off."""
    plugin = _plugin(decode_plugins, "qwen2_5_vl")
    adapter = plugin.adapter
    texts = [adapter.chat_text(adapter.messages(question, 0)) for question in
             ("Where is the red circle?", "How many squares are there in the image? Answer with a number.")]
    unique = adapter.encode(texts, [[], []])
    prompts = [unique[g] for g in (0, 1, 1, 0)]
    assert len(unique[0]["input_ids"]) != len(unique[1]["input_ids"])
    for sampled in (False, True):
        config = _config(plugin, sampled)
        theirs = _generate(plugin, prompts, config, "hf", False, seed=17)
        for share in (False, True):
            torch.testing.assert_close(_generate(plugin, prompts, config, "mmrl", share, seed=17), theirs,
                                       rtol=0, atol=0)


def test_sharded_parameters_decode_through_the_whole_model(decode_plugins, monkeypatch):
    """With sharded (DTensor) parameters, FSDP2's hooks gather the root module's weights (embeddings, LM head) only
    on the root's forward: every decode step then calls the whole model (one call per step after the prefill, not
    one in all) and keeps peft's LoRA forwards, and the tokens are still generate's."""
    import functools

    import mmrl.plugins.vlm.decode as decode_module

    plugin = _plugin(decode_plugins, "qwen2_5_vl")
    prompts = _prompts(plugin)
    config = _config(plugin, True)
    base = decode_module._base_model(plugin.model)
    calls = []
    original = type(base).forward

    @functools.wraps(original)  # keeps forward's signature: the step picks its cache argument's name from it
    def counted(self, *args, **kwargs):
        calls.append(kwargs["input_ids"].shape[1])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(base), "forward", counted)
    direct = _generate(plugin, prompts, config, "mmrl", True, seed=5)
    assert len(calls) == 1  # the prefill only: the steps call the language model directly
    calls.clear()
    monkeypatch.setattr(decode_module, "has_sharded_parameters", lambda model: True)
    monkeypatch.setattr(decode_module, "plain_lora_forwards", lambda model: pytest.fail("plain LoRA forwards used"))
    whole = _generate(plugin, prompts, config, "mmrl", True, seed=5)
    assert len(calls) == whole.shape[1] and calls[1:] == [1] * (whole.shape[1] - 1)  # prefill + one per new token
    torch.testing.assert_close(whole, direct, rtol=0, atol=0)


def test_sharded_parameters_are_detected():
    """A DTensor parameter (a one-process gloo mesh, in a subprocess so that no process group outlives it) is
    sharded; plain parameters are not."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import tempfile, torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        from mmrl.plugins.vlm.decode import has_sharded_parameters
        dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
        layer = torch.nn.Linear(4, 4)
        plain = has_sharded_parameters(layer)
        mesh = init_device_mesh("cpu", (1,))
        layer.weight = torch.nn.Parameter(distribute_tensor(layer.weight.data, mesh, [Shard(0)]))
        print(plain, has_sharded_parameters(layer))
        dist.destroy_process_group()
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["False", "True"]


@pytest.mark.slow
def test_a_model_sharded_over_two_processes_decodes_the_unsharded_tokens(tiny_models, tmp_path):
    """FSDP2 (torch's ``fully_shard`` on each decoder layer and the whole model, as Accelerate's FSDP2 recipes
    shard it) over two gloo processes: the plugin's decode loop on the sharded tiny Qwen2.5-VL with LoRA gives, on
    both processes, the tokens it gave unsharded, greedy and sampled (mixed image sizes, interleaved groups, shared
    prefill). Accelerate does not shard on a CPU, so the processes shard the model themselves
    (tests/vlm/sharded_decode.py)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("sharded_decode.py")
    store, outs = tmp_path / "store", [tmp_path / f"rank{rank}.json" for rank in range(2)]
    processes = [subprocess.Popen([sys.executable, str(script), str(rank), "2", str(store),
                                   str(tiny_models["qwen2_5_vl"]), str(out)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank, out in enumerate(outs)]
    logs = [process.communicate(timeout=300)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], "\n".join(log[-2000:] for log in logs)
    for out in outs:
        record = json.loads(out.read_text())
        assert record["sharded"] and record["layers"] >= 2
        for mode in ("greedy", "sampled"):
            assert record[mode]["equal"], (out.name, mode)
            assert record[mode]["shape"] == [len(GROUPS), 12] and record[mode]["distinct_tokens"] > 3
