"""Length rewards for text completions.

``overlong_penalty`` is DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, §3.4, eq. 13): with a
generation budget of L_max tokens and a buffer of L_cache tokens before it, a completion of |y| tokens gets

    0                                    if |y| ≤ L_max − L_cache
    ((L_max − L_cache) − |y|) / L_cache  if L_max − L_cache < |y| ≤ L_max
    −1                                   if |y| > L_max

times ``factor``, added to the task reward (list both rewards, weight 1 each). verl's DAPO reward manager computes
the same (volcengine/verl@b178a3c ``verl/workers/reward_manager/dapo.py:77, 116-122``: ``overlong_buffer.len``
L_cache, ``penalty_factor``, the budget ``max_resp_len``; exceeding length ``|y| − (L_max − L_cache)``, penalty
``min(−exceed / L_cache · factor, 0)``, with |y| the response's attention-mask length, end-of-sequence token
included), and its DAPO recipe sets L_max 20480, L_cache 4096, factor 1.0 (verl@246cac4
``recipe/dapo/run_dapo_early_qwen2.5_32b.sh:18-21``). With the budget enforced by generation |y| never exceeds
L_max, where both give −factor; beyond it DAPO's formula stays at −1 (verl's would keep falling).

The reward reads the completion length in tokens from ``payload["completion_tokens"]`` (the vlm, dllm and toy
plugins write it: tokens up to and including the end-of-sequence token, all of them without one).
"""

from __future__ import annotations

import math
from typing import Annotated

import torch

from mmrl.registry import Range
from mmrl.reward import RewardError, RewardInput


def overlong_penalty(batch: RewardInput, *, max_length: Annotated[int, Range(1)],
                     buffer: Annotated[int, Range(1)],
                     factor: Annotated[float, Range(0.0)] = 1.0,
                     output: str = "completion_tokens") -> list[float]:
    """DAPO's soft overlong punishment (module docstring): 0 up to ``max_length − buffer`` tokens, then falling
    linearly to ``−factor`` at ``max_length``, ``−factor`` beyond.

    Args:
        max_length: L_max, the generation budget in tokens (the plugin's ``max_new_tokens`` or generation length).
        buffer: L_cache, the tokens before the budget over which the penalty grows; at most ``max_length``.
        factor: Scale of the penalty (verl's ``overlong_buffer.penalty_factor``).
        output: Payload entry holding each completion's length in tokens.
    """
    if max_length < 1:
        raise RewardError(f"overlong_penalty: max_length must be at least 1 token, got {max_length}")
    if not 1 <= buffer <= max_length:
        raise RewardError(f"overlong_penalty: buffer must be in [1, max_length={max_length}], got {buffer}")
    if not math.isfinite(factor) or factor < 0:
        raise RewardError(f"overlong_penalty: factor must be a finite number >= 0, got {factor}")
    lengths = batch.output(output)
    lengths = lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
    start = max_length - buffer
    scores = []
    for length in lengths:
        if length > max_length:
            scores.append(-factor)
        else:
            scores.append(factor * min(start - float(length), 0.0) / buffer)
    return scores
