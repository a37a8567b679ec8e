"""Seeds derived from integers, for every source of randomness in a run (public API for plugins).

A run never draws from one shared random stream: each piece of randomness gets its own seed, derived from the run's
seed and the integers that identify it (a step, a sample, a purpose tag). What a sample draws then depends on its
own seed only, not on the batch, the micro-batch or the number of processes it happens to be in, which is what makes
one process and two processes sample the same thing (:class:`mmrl.plugin.PromptBatch.seeds`). Plugins that draw
noise of their own (shared initial noise per group, a mask plan per sample) derive their seeds here as well, with a
purpose tag of their own so that two purposes never share a stream::

    from mmrl.seeding import derive_seed

    generator = torch.Generator().manual_seed(derive_seed(sample_seed, MY_PURPOSE_TAG))
"""

from __future__ import annotations

MASK64 = (1 << 64) - 1


def splitmix64(value: int) -> int:
    """One round of SplitMix64 (Steele et al. 2014): a fast, well-mixed 64-bit hash."""
    value = (value + 0x9E3779B97F4A7C15) & MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
    return value ^ (value >> 31)


def derive_seed(*parts: int) -> int:
    """Mix integers into one seed in [0, 2**63) (stable across processes, platforms and Python versions).

    Args:
        parts: The integers that identify the randomness (the order matters: ``derive_seed(1, 2) != derive_seed(2,
            1)``); negative and wider-than-64-bit integers are taken modulo 2**64.

    Returns:
        A non-negative seed below 2**63, usable with ``torch.Generator.manual_seed`` (``% 2**32`` for NumPy).
    """
    value = 0
    for part in parts:
        value = splitmix64(value ^ (int(part) & MASK64))
    return value >> 1


__all__ = ["derive_seed", "splitmix64"]
