"""Block ("canvas") diffusion with uniform-token noise: DiffusionGemma's sampler and its likelihood surrogate.

DiffusionGemma (``google/diffusiongemma-26B-A4B-it``; transformers' ``DiffusionGemmaForBlockDiffusion``) writes its
answer in canvases of ``canvas_length`` tokens, one after another. A causal encoder reads the prompt and every
finished canvas into a KV cache; a bidirectional decoder, sharing the encoder's weights, denoises the next canvas
while reading that cache. There is no mask token: noise is a uniformly random vocabulary token.

**Sampling** (:func:`canvas_generate`; transformers ``generation_diffusion_gemma.py``, ``generate`` and
``_denoising_step``, 5.25.0). For each canvas, start from uniform random tokens and repeat for ``n = N .. 1``
(at most ``N`` steps):

1. logits of the decoder on the current canvas, with the previous step's tempered logits as self-conditioning
   (none at the first step), divided by the temperature ``T_n = t_min + (t_max − t_min)·n/N``
   (``LinearTemperatureScheduleLogitsProcessor``);
2. a token per position drawn from ``softmax(l/T_n)``; the positions of lowest entropy are accepted, as many as keep
   ``Σ_{j≤k} H_(j) − H_(k) ≤ entropy_bound`` over the entropies sorted ascending (``EntropyBoundSampler``, after
   arXiv:2505.24857); the accepted positions take the drawn token, every other position a new uniform random token;
3. a row stops early when its argmax canvas has not changed for ``stability_threshold`` steps and the mean entropy
   of its tempered logits is below ``confidence_threshold`` (``StableAndConfidentStoppingCriteria``).

The canvas written out is the **argmax** of the last step's tempered logits. Tokens after the first stop token are
replaced by the padding id, and a row whose canvas holds a stop token gets only padding in later canvases (the
encoder still reads them, as transformers does). :func:`canvas_generate` runs the same loop with one
``torch.Generator`` per sample (a sample does not depend on its batch); with the global RNG and one sample it draws
the same numbers in the same order as ``model.generate`` (``tests/dllm/test_canvas.py`` compares them token for
token).

**Likelihood** (:func:`canvas_token_logprobs`, estimator ``uniform_one_step``). The model's own training objective
is the surrogate, as d1's one-step estimator is for masked models: NeMo AutoModel's DiffusionGemma SFT
(NVIDIA-NeMo/Automodel@36044ad, ``recipes/dllm/strategy.py`` ``BlockDiffusionStrategy`` L907-983,
``components/datasets/dllm/corruption.py`` ``corrupt_uniform_random`` L267-337, ``recipes/dllm/train_ft.py``
``DiffusionGemmaSFTRecipe`` L785-1000, ``components/models/diffusion_gemma/model.py`` L610-655) draws one level
``t ~ U(eps, 1)`` per example, replaces each response token by a uniform random token with probability ``t``, lets
the encoder read the **clean** prompt and response and the decoder denoise each canvas against the clean prompt
plus the clean earlier canvases (block-causal), and scores the clean token at **every** supervised canvas position,
corrupted or not, without ``1/t`` weights; the last canvas is filled with EOS after the response. Self-conditioning
follows the same recipe: a first decoder pass without gradients gives the logits that a second pass reads, per
example with probability ``self_conditioning_p`` (0.5). The per-token log-probability of completion token ``i`` of a
draw is therefore ``log p_θ(x^i | prompt, x^{<canvas}, z_t)``; the plugin averages it over the draws and uses it as
d1's per-token log-prob (a per-token ratio; old, new and reference policies scored on the same draws).

Deliberate differences from the SFT recipe, each for RL: every canvas holding completion tokens is scored (the
recipe picks one at random per step, an unbiased estimate of the same sum at a fraction of the cost); only the
completion's tokens up to and including its first stop token are scored (the EOS fill after it is read, and
corrupted, as in training, but is not an action of the sampled answer); the encoder's autoregressive loss is not
part of the surrogate (it is a training regulariser, not a likelihood of the sampled answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mmrl.config import ConfigError, config_field

# transformers' DiffusionGemmaGenerationConfig._get_default_generation_params (5.25.0): used when neither the config
# nor the checkpoint's generation_config.json sets a value.
SAMPLER_DEFAULTS = {"t_min": 0.4, "t_max": 0.8, "entropy_bound": 0.1, "stability_threshold": 1,
                    "confidence_threshold": 0.005}


@dataclass
class CanvasSamplerConfig:
    """``plugin.canvas_sampler``: the sampler of canvas models (DiffusionGemma). Null values come from the
    checkpoint's ``generation_config.json``, else from transformers' defaults. The number of denoising steps per
    canvas is ``plugin.steps / (gen_length / block_length)``."""

    t_min: float | None = config_field(None, minimum=0.0, exclusive_minimum=True,
                                       help="Temperature at the last denoising step.", ref="transformers: 0.4")
    t_max: float | None = config_field(None, minimum=0.0, exclusive_minimum=True,
                                       help="Temperature at the first denoising step.", ref="transformers: 0.8")
    entropy_bound: float | None = config_field(
        None, minimum=0.0, exclusive_minimum=True,
        help="Entropy budget of the positions accepted per step (higher: more tokens per step).",
        ref="transformers EntropyBoundSampler: 0.1; arXiv:2505.24857")
    adaptive_stopping: bool = config_field(
        True, help="Stop a canvas early when its argmax is stable and its mean entropy low (False: always run every "
        "step).")
    stability_threshold: int | None = config_field(
        None, minimum=0, help="Steps the argmax canvas must stay unchanged to stop early.", ref="transformers: 1")
    confidence_threshold: float | None = config_field(
        None, minimum=0.0, exclusive_minimum=True,
        help="Mean token entropy of the tempered logits below which a stable canvas stops.",
        ref="transformers: 0.005")

    def validate(self, path: str) -> None:
        if self.t_min is not None and self.t_max is not None and not self.t_max > self.t_min:
            raise ConfigError(f"{path}.t_max", self.t_max, f"a temperature above t_min ({self.t_min})")

    def resolve(self, generation_config: dict[str, Any], steps_per_canvas: int) -> CanvasSampling:
        """The sampler's numbers: this config's, else the checkpoint's ``generation_config.json``, else
        :data:`SAMPLER_DEFAULTS`."""
        saved = dict(generation_config)
        sampler = saved.get("sampler_config")
        if isinstance(sampler, dict) and "entropy_bound" in sampler:
            saved["entropy_bound"] = sampler["entropy_bound"]

        def pick(name: str) -> Any:
            value = getattr(self, name)
            if value is None:
                value = saved.get(name)
            return SAMPLER_DEFAULTS[name] if value is None else value

        sampling = CanvasSampling(
            steps=int(steps_per_canvas), t_min=float(pick("t_min")), t_max=float(pick("t_max")),
            entropy_bound=float(pick("entropy_bound")),
            stability_threshold=int(pick("stability_threshold")) if self.adaptive_stopping else None,
            confidence_threshold=float(pick("confidence_threshold")) if self.adaptive_stopping else None,
        )
        if not sampling.t_max > sampling.t_min:
            raise ConfigError("plugin.canvas_sampler.t_max", sampling.t_max,
                              f"a temperature above t_min ({sampling.t_min})")
        return sampling


@dataclass(frozen=True)
class CanvasSampling:
    """Resolved sampler settings (:meth:`CanvasSamplerConfig.resolve`). ``stability_threshold`` and
    ``confidence_threshold`` are None when adaptive stopping is off."""

    steps: int
    t_min: float
    t_max: float
    entropy_bound: float
    stability_threshold: int | None = None
    confidence_threshold: float | None = None

    def temperature(self, remaining: int, device: torch.device | None = None) -> Tensor:
        """``T_n`` at the step with ``remaining = n`` steps left (``n = N`` first, ``n = 1`` last), a float32 scalar
        computed in transformers' order of float32 operations (``LinearTemperatureScheduleLogitsProcessor``), so that
        the tempered logits are the same bits."""
        fraction = torch.tensor(remaining, dtype=torch.int32, device=device) / self.steps
        return self.t_min + (self.t_max - self.t_min) * fraction


@dataclass
class CanvasOutput:
    """Completions of :func:`canvas_generate`.

    Attributes:
        completion_ids: ``[B, G]`` long: the argmax canvases, the padding id after the first stop token.
        step_map: ``[B, G]`` long: the global step (``canvas·steps + j``, 0-based) from which the position's argmax
            no longer changed; -1 in the canvases after the row's stop token.
        decoder_passes: ``[B]`` long: denoising steps spent on each row (its canvases before it stopped).
        decoder_calls: Batched decoder forwards run (each canvas runs until its last row stops).
        canvases: Canvases decoded (the loop ends when every row has its stop token).
    """

    completion_ids: Tensor
    step_map: Tensor
    decoder_passes: Tensor
    decoder_calls: int = 0
    canvases: int = 0


def text_config(model: nn.Module) -> Any:
    """The text config of a DiffusionGemma model (vocabulary, stop token)."""
    return model.config.get_text_config()


def new_cache(model: nn.Module) -> Any:
    """An empty ``DynamicCache`` for the encoder of ``model`` (any module whose ``config`` is DiffusionGemma's)."""
    from transformers import DynamicCache

    return DynamicCache(config=text_config(model))


def entropy_bound_accept(entropy: Tensor, bound: float) -> Tensor:
    """The positions the entropy-bound sampler accepts: the lowest-entropy ones, as many as keep the sum of the
    accepted entropies minus their largest within ``bound`` (transformers ``EntropyBoundSampler.accept_canvas``).

    Shapes:
        entropy ``[B, L]`` → ``bool [B, L]``.
    """
    ordered, order = torch.sort(entropy, dim=-1, descending=False)
    keep = ordered.cumsum(dim=-1) - ordered <= bound  # sorted ascending: the current one is the largest so far
    return torch.zeros_like(keep).scatter(-1, order, keep)


def _per_row(generators: Sequence[torch.Generator] | None, draw: Any) -> Tensor:
    """``draw(generator)`` per row, stacked (one global-RNG call for the whole batch when ``generators`` is None)."""
    if generators is None:
        return draw(None)
    return torch.stack([draw(g) for g in generators])


@torch.no_grad()
def canvas_generate(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    gen_length: int,
    sampling: CanvasSampling,
    stop_ids: Sequence[int],
    pad_id: int,
    generators: Sequence[torch.Generator] | None = None,
) -> CanvasOutput:
    """Sample ``gen_length`` tokens canvas by canvas, as transformers' ``DiffusionGemmaForBlockDiffusion.generate``
    (see the module docstring), with one generator per row.

    Args:
        model: A ``DiffusionGemmaForBlockDiffusion`` (bare, not wrapped).
        prompt_ids: ``[B, P]`` left-padded prompts.
        prompt_mask: ``[B, P]`` 1 for real prompt tokens.
        gen_length: Tokens to write; a multiple of the model's ``canvas_length``.
        sampling: Steps per canvas, temperatures, entropy bound and adaptive stopping.
        stop_ids: Tokens that end a completion.
        pad_id: What fills a completion after its first stop token.
        generators: One CPU or device generator per row; None draws from the global RNG in transformers' order
            (for the comparison with ``generate``).

    Shapes:
        → ``completion_ids [B, G]``, ``step_map [B, G]``, ``decoder_passes [B]``.
    """
    canvas_length = int(model.config.canvas_length)
    vocab = int(text_config(model).vocab_size)
    batch, prompt_length = prompt_ids.shape
    device = prompt_ids.device
    if gen_length % canvas_length:
        raise ValueError(f"gen_length {gen_length} must be a multiple of the model's canvas_length {canvas_length}")
    if generators is not None and len(generators) != batch:
        raise ValueError(f"{len(generators)} generators for {batch} prompts")
    steps = sampling.steps
    stops = torch.tensor(list(stop_ids), device=device)
    cache = new_cache(model)
    attention = prompt_mask.bool()  # [B, P + k·C]: the encoder's keys so far (padding hidden)
    encoder_ids = prompt_ids
    encoder_positions = torch.arange(prompt_length, device=device)
    completion = torch.full((batch, gen_length), pad_id, dtype=torch.long, device=device)
    step_map = torch.full((batch, gen_length), -1, dtype=torch.long, device=device)
    passes = torch.zeros(batch, dtype=torch.long, device=device)
    calls, canvases = 0, 0
    finished_rows = torch.zeros(batch, dtype=torch.bool, device=device)

    def uniform_tokens(generator: torch.Generator | None) -> Tensor:
        shape = (batch, canvas_length) if generator is None else (canvas_length,)
        return torch.randint(0, vocab, shape, device=device if generator is None else generator.device,
                             generator=generator).to(device)

    for canvas in range(gen_length // canvas_length):
        start = prompt_length + canvas * canvas_length
        model.model.encoder(input_ids=encoder_ids, attention_mask=attention, cache=cache,
                            position_ids=encoder_positions.unsqueeze(0))
        decoder_mask = torch.nn.functional.pad(attention, (0, canvas_length), value=True)
        decoder_positions = torch.arange(start, start + canvas_length, device=device).unsqueeze(0)
        current = _per_row(generators, uniform_tokens)  # [B, C] uniform noise
        argmax = current
        self_conditioning = None
        done = torch.zeros(batch, dtype=torch.bool, device=device)  # adaptive stopping of this canvas
        history = None  # [S, B, C] the last argmax canvases (stability)
        changed = torch.zeros(batch, canvas_length, dtype=torch.long, device=device)
        canvases += 1
        for index, remaining in enumerate(range(steps, 0, -1)):
            passes += (~(done | finished_rows)).long()
            calls += 1
            logits = model(decoder_input_ids=current, self_conditioning_logits=self_conditioning,
                           decoder_attention_mask=decoder_mask, cache=cache,
                           decoder_position_ids=decoder_positions).logits  # [B, C, V]
            tempered = logits / sampling.temperature(remaining, device)
            probs = torch.softmax(tempered, dim=-1, dtype=torch.float32)
            if generators is None:
                drawn = torch.multinomial(probs.view(-1, vocab), num_samples=1).view(batch, canvas_length)
            else:
                drawn = torch.stack([torch.multinomial(probs[row], 1, generator=g).squeeze(-1).to(device)
                                     for row, g in enumerate(generators)])
            new_argmax = tempered.argmax(dim=-1)
            entropy = torch.distributions.Categorical(logits=tempered).entropy()  # [B, C]
            accept = entropy_bound_accept(entropy, sampling.entropy_bound)
            accepted = torch.where(accept, drawn, current)
            renoised = torch.where(accept, accepted, _per_row(generators, uniform_tokens))
            if sampling.stability_threshold is not None:
                if done.any():  # stopped rows keep their canvas, argmax and logits
                    new_argmax = torch.where(done[:, None], argmax, new_argmax)
                    renoised = torch.where(done[:, None], current, renoised)
                    tempered = torch.where(done[:, None, None], self_conditioning, tempered)
                stable, history = _stable(history, new_argmax, sampling.stability_threshold)
                # The step's entropy: a row already done stays done whatever its value, so the stopped rows' swapped
                # logits need no second entropy pass.
                done = done | (stable & (entropy.mean(dim=-1) < sampling.confidence_threshold))
            changed = torch.where(new_argmax != argmax, canvas * steps + index, changed)
            argmax, current = new_argmax, renoised
            self_conditioning = tempered.to(model.model.decoder.embed_tokens.weight.dtype)
            if bool(done.all()):
                break
        # Finalise the canvas: padding after the first stop token, and everywhere for rows finished before.
        written = argmax.clone()
        written[finished_rows] = pad_id
        is_stop = torch.isin(written, stops)
        after_stop = is_stop.long().cumsum(dim=-1) - is_stop.long() > 0
        written[after_stop] = pad_id
        columns = slice(canvas * canvas_length, (canvas + 1) * canvas_length)
        completion[:, columns] = written
        step_map[:, columns] = torch.where(finished_rows[:, None], -1, changed)  # -1: nothing decoded for the row
        finished_rows = finished_rows | is_stop.any(dim=-1)
        if bool(finished_rows.all()):
            break
        attention = torch.nn.functional.pad(attention, (0, canvas_length), value=True)
        encoder_ids = written
        encoder_positions = torch.arange(start, start + canvas_length, device=device)
    return CanvasOutput(completion_ids=completion, step_map=step_map, decoder_passes=passes, decoder_calls=calls,
                        canvases=canvases)


def _stable(history: Tensor | None, argmax: Tensor, threshold: int) -> tuple[Tensor, Tensor | None]:
    """transformers ``StableAndConfidentStoppingCriteria``'s stability half: whether ``argmax`` equals each of the
    last ``threshold`` argmax canvases, and the updated history.

    Shapes:
        history ``[S, B, C]`` or None, argmax ``[B, C]`` → ``bool [B]``, ``[S, B, C]``.
    """
    if threshold == 0:
        return torch.ones(argmax.shape[0], dtype=torch.bool, device=argmax.device), history
    if history is None:
        history = torch.full((threshold, *argmax.shape), -1, dtype=argmax.dtype, device=argmax.device)
    stable = (history == argmax[None]).all(dim=-1).all(dim=0)
    history = torch.roll(history, shifts=-1, dims=0)
    history[-1] = argmax
    return stable, history


# ---------------------------------------------------------------------- likelihood
@dataclass
class UniformPlan:
    """The noise of ``D`` draws for ``B`` completions of width ``G`` (estimator ``uniform_one_step``).

    Attributes:
        corrupted: ``bool [D, B, G]``: positions replaced by ``tokens`` (real tokens and the EOS fill of the last
            canvas, each with probability ``t`` of its draw).
        tokens: ``long [D, B, G]``: the uniform random replacements.
        self_conditioning: ``bool [D, B]``: whether the draw's scoring pass reads a first pass's logits.
        weights: ``float32 [D, B, G]``: 1 at the scored positions (the real completion tokens), 0 elsewhere.
    """

    corrupted: Tensor
    tokens: Tensor
    self_conditioning: Tensor
    weights: Tensor

    @property
    def num_samples(self) -> int:
        return self.corrupted.shape[0]


def draw_uniform_plan(completion_mask: Tensor, *, canvas_length: int, vocab_size: int, num_samples: int,
                      generators: Sequence[torch.Generator], eps: float = 1e-3,
                      self_conditioning_p: float = 0.5) -> UniformPlan:
    """Draw ``num_samples`` corruptions per completion, sample ``b`` from ``generators[b]`` alone (so a sample's plan
    does not depend on its batch): per draw ``t ~ U(eps, 1)``, each position of the canvases that hold real tokens
    corrupted with probability ``t`` and replaced by a uniform random token, and a self-conditioning coin with
    probability ``self_conditioning_p`` (NeMo AutoModel's ``corrupt_uniform_random`` with one ``t`` per example, and
    ``_decide_self_conditioning``; module docstring).

    Shapes:
        completion_mask ``[B, G]`` → a plan of ``[D, B, G]`` tensors.
    """
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"eps must be in [0, 1), got {eps}")
    if not 0.0 <= self_conditioning_p <= 1.0:
        raise ValueError(f"self_conditioning_p must be in [0, 1], got {self_conditioning_p}")
    if len(generators) != completion_mask.shape[0]:
        raise ValueError(f"{len(generators)} generators for {completion_mask.shape[0]} completions")
    real = completion_mask.bool().cpu()
    batch, width = real.shape
    window = canvas_window(real, canvas_length)  # [B, G] the canvases a draw corrupts
    corrupted, tokens, coins = [], [], []
    for row, generator in enumerate(generators):
        t = eps + (1.0 - eps) * torch.rand(num_samples, 1, generator=generator, dtype=torch.float64)  # [D, 1]
        hit = torch.rand(num_samples, width, generator=generator, dtype=torch.float64) < t  # [D, G]
        corrupted.append(hit & window[row])
        tokens.append(torch.randint(0, vocab_size, (num_samples, width), generator=generator))
        coins.append(torch.rand(num_samples, generator=generator, dtype=torch.float64) < self_conditioning_p)
    device = completion_mask.device
    weights = real.float().unsqueeze(0).expand(num_samples, batch, width).contiguous()
    return UniformPlan(corrupted=torch.stack(corrupted, dim=1).to(device), tokens=torch.stack(tokens, dim=1).to(device),
                       self_conditioning=torch.stack(coins, dim=1).to(device), weights=weights.to(device))


def canvas_window(real: Tensor, canvas_length: int) -> Tensor:
    """The positions of the canvases that hold at least one real completion token (the ones a scoring pass reads).

    Shapes:
        real ``[B, G]`` → ``bool [B, G]``.
    """
    count = real.long().sum(dim=-1)  # [B] real tokens: a prefix of the completion
    canvases = (count + canvas_length - 1) // canvas_length
    positions = torch.arange(real.shape[1], device=real.device)
    return positions.unsqueeze(0) < (canvases * canvas_length).unsqueeze(1)


def canvas_token_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    plan: UniformPlan,
    *,
    canvas_length: int,
    eos_id: int,
    micro_batch: int | None = None,
    encoder: nn.Module | None = None,
) -> Tensor:
    """``log p_θ(x^i | prompt, clean earlier canvases, noisy canvas)`` of every real completion token, per draw.

    The encoder reads the prompt, then each clean canvas after the decoder has scored it (the order of sampling, so
    sliding-window layers see what they saw then); the decoder reads the draw's noisy canvas. A completion's clean
    canvas after its first stop token is filled with ``eos_id`` (the SFT recipe's EOS fill). Gradients flow through
    the decoder pass and the encoder's cache; the self-conditioning pass runs without gradients.

    Args:
        model: ``DiffusionGemmaForBlockDiffusion`` (possibly wrapped for data parallelism): called for the decoder.
        encoder: The bare model's ``model.encoder`` (default: ``model.model.encoder``).
        micro_batch: Completions per pass (each with its ``D`` draws); None: all.

    Shapes:
        prompt_ids, prompt_mask ``[B, P]``; completion_ids, completion_mask ``[B, G]``; plan ``[D, B, G]``
        → ``float32 [D, B, G]``, zero where nothing is scored.
    """
    draws = plan.num_samples
    batch, width = completion_ids.shape
    if plan.corrupted.shape != (draws, batch, width):
        raise ValueError(f"plan drawn for {tuple(plan.corrupted.shape)}, completions are {tuple(completion_ids.shape)}")
    if width % canvas_length:
        raise ValueError(f"completion width {width} is not a multiple of canvas_length {canvas_length}")
    encoder = encoder if encoder is not None else model.model.encoder
    out = torch.zeros(draws, batch, width, dtype=torch.float32, device=completion_ids.device)
    step = batch if micro_batch is None else int(micro_batch)
    for begin in range(0, batch, step):
        rows = slice(begin, begin + step)
        out[:, rows] = _score_rows(model, encoder, prompt_ids[rows], prompt_mask[rows], completion_ids[rows],
                                   completion_mask[rows], _slice_plan(plan, rows), canvas_length, eos_id)
    return out


def _slice_plan(plan: UniformPlan, rows: slice) -> UniformPlan:
    return UniformPlan(corrupted=plan.corrupted[:, rows], tokens=plan.tokens[:, rows],
                       self_conditioning=plan.self_conditioning[:, rows], weights=plan.weights[:, rows])


def _score_rows(model: nn.Module, encoder: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                completion_mask: Tensor, plan: UniformPlan, canvas_length: int, eos_id: int) -> Tensor:
    draws = plan.num_samples
    batch, width = completion_ids.shape
    prompt_length = prompt_ids.shape[1]
    device = completion_ids.device
    real = completion_mask.bool()
    scored = plan.weights != 0  # [D, b, G]
    # Clean canvases: the completion, EOS after its real tokens (the SFT recipe's fill of the last canvas).
    clean = torch.where(real, completion_ids, torch.full_like(completion_ids, eos_id))  # [b, G]
    noisy = torch.where(plan.corrupted, plan.tokens, clean.unsqueeze(0))  # [D, b, G]
    # Rows are completion-major from here (row b·D + d): the encoder reads each clean completion D times.
    noisy = noisy.transpose(0, 1).reshape(batch * draws, width)
    scored_rows = scored.transpose(0, 1).reshape(batch * draws, width)
    coins = plan.self_conditioning.transpose(0, 1).reshape(batch * draws)
    targets = completion_ids.repeat_interleave(draws, dim=0)  # [b·D, G]
    repeated_clean = clean.repeat_interleave(draws, dim=0)
    canvases = int(canvas_window(real, canvas_length).sum(dim=-1).max().item()) // canvas_length if real.any() else 0
    out = torch.zeros(batch * draws, width, dtype=torch.float32, device=device)
    if canvases == 0:
        return out.view(batch, draws, width).transpose(0, 1)
    cache = new_cache(encoder)
    attention = prompt_mask.bool().repeat_interleave(draws, dim=0)  # [b·D, P]
    encoder(input_ids=prompt_ids.repeat_interleave(draws, dim=0), attention_mask=attention, cache=cache,
            position_ids=torch.arange(prompt_length, device=device).unsqueeze(0))
    values, where_rows, where_cols = [], [], []
    for canvas in range(canvases):
        start = prompt_length + canvas * canvas_length
        columns = slice(canvas * canvas_length, (canvas + 1) * canvas_length)
        decoder_mask = torch.nn.functional.pad(attention, (0, canvas_length), value=True)
        inputs = {"decoder_input_ids": noisy[:, columns], "decoder_attention_mask": decoder_mask, "cache": cache,
                  "decoder_position_ids": torch.arange(start, start + canvas_length, device=device).unsqueeze(0)}
        self_conditioning = None
        if bool(coins.any()):  # the recipe's pass 1: no gradients, the same canvas and cache
            with torch.no_grad():
                self_conditioning = model(**inputs).logits.detach()
        logits = model(**inputs, self_conditioning_logits=self_conditioning,
                       self_conditioning_mask=coins if self_conditioning is not None else None).logits  # [b·D, C, V]
        where = scored_rows[:, columns]  # [b·D, C]
        if bool(where.any()):
            picked = logits[where].float().log_softmax(dim=-1)  # [k, V]
            values.append(picked.gather(-1, targets[:, columns][where].unsqueeze(-1)).squeeze(-1))
            position = where.nonzero()
            where_rows.append(position[:, 0])
            where_cols.append(position[:, 1] + canvas * canvas_length)
        if canvas + 1 < canvases:  # the clean canvas joins the context of the next one
            encoder(input_ids=repeated_clean[:, columns], attention_mask=decoder_mask, cache=cache,
                    position_ids=torch.arange(start, start + canvas_length, device=device).unsqueeze(0))
            attention = decoder_mask
    if values:
        out = out.index_put((torch.cat(where_rows), torch.cat(where_cols)), torch.cat(values))
    return out.view(batch, draws, width).transpose(0, 1)


def uniform_one_step_scores(token_logp: Tensor, plan: UniformPlan) -> Tensor:
    """Each token's log-prob averaged over the draws (d1's per-token value), zero where unscored.

    Shapes:
        token_logp ``[D, B, G]`` → ``[B, G]``.
    """
    return (plan.weights.to(token_logp.dtype) * token_logp).mean(dim=0)


__all__ = ["SAMPLER_DEFAULTS", "CanvasOutput", "CanvasSamplerConfig", "CanvasSampling", "UniformPlan",
           "canvas_generate", "canvas_token_logprobs", "canvas_window", "draw_uniform_plan",
           "entropy_bound_accept", "text_config", "uniform_one_step_scores"]
