"""Steps that trained on no sample: a warning for each, and an error when no step of a run trained on any.

A sample of a step enters the loss unless the collector made it padding (mask zeroed): under
``rewards.on_nonfinite: skip`` a sample with a NaN or infinite reward is dropped, and under dynamic sampling so is a
sample whose group has no reward spread. When every sample of a step is dropped, the loss has no active action and
its policy gradient is zero: the step learned nothing. One such step in a run is worth a warning; a run in which
every step was like that (a reward that is NaN for every sample, say) must not end as a success.
"""

from __future__ import annotations

import sys

from tqdm.auto import tqdm

from mmrl.config import TrainConfig
from mmrl.reward import RewardScorer
from mmrl.trainer.geometry import BatchGeometry


class NoUpdateError(RuntimeError):
    """No step of a run trained on any sample. ``str(error)`` is one line naming the cause."""


def trained_samples(metrics: dict[str, float], geometry: BatchGeometry) -> int:
    """Samples of a step that entered the loss, over all processes: the step's samples less the padding and the
    truncated samples that ``algorithm.mask_truncated`` left out."""
    return (geometry.samples - round(metrics.get("samples/padded", 0.0))
            - round(metrics.get("samples/truncated_masked", 0.0)))


#: Empty steps whose warning is always printed; after them only the 2^k-th (so a run whose reward is NaN for 400
#: steps prints about a dozen lines, not 400; metrics.jsonl's ``samples/trained`` records every step).
PRINT_FIRST = 3


def _worth_printing(count: int) -> bool:
    """Whether the ``count``-th empty step of a run prints its warning: the first few, then powers of two."""
    return count <= PRINT_FIRST or count & (count - 1) == 0


class UpdateMonitor:
    """Watches the metrics of every training step for steps in which no sample entered the loss.

    Args:
        config: The run's config (for the cause: ``on_nonfinite``, dynamic sampling).
        geometry: Batch sizes of the run.
        scorer: The training rewards; its non-finite counts name the rewards that dropped samples.
        is_main_process: Only the main process prints the warnings.

    Attributes:
        steps: Steps observed in this run (a resumed run counts from its resumption).
        empty_steps: The observed steps that trained on no sample.
    """

    def __init__(self, config: TrainConfig, geometry: BatchGeometry, scorer: RewardScorer, is_main_process: bool):
        self.config = config
        self.geometry = geometry
        self.scorer = scorer
        self.is_main_process = is_main_process
        self.steps = 0
        self.empty_steps: list[int] = []
        self.last_cause = ""
        self._counts = dict(scorer.nonfinite_counts)

    def observe(self, step: int, metrics: dict[str, float]) -> str | None:
        """Record one finished step and add its ``samples/trained`` to ``metrics``; returns a one-line warning when the
        step trained on no sample, else None. The main process prints it for the first :data:`PRINT_FIRST` such
        steps and then for the 2^k-th, with a tally."""
        counts = dict(self.scorer.nonfinite_counts)
        nonfinite = [name for name, count in counts.items() if count > self._counts.get(name, 0)]
        self._counts = counts
        self.steps += 1
        trained = trained_samples(metrics, self.geometry)
        metrics["samples/trained"] = float(trained)
        if trained > 0:
            return None
        self.empty_steps.append(step)
        self.last_cause = self._cause(metrics, nonfinite)
        warning = f"step {step} trained on no sample: {self.last_cause}"
        if self.is_main_process and _worth_printing(len(self.empty_steps)):
            count = len(self.empty_steps)
            tally = "" if count <= PRINT_FIRST else f" ({count} such steps of {self.steps} so far)"
            tqdm.write(f"mmrl: warning: {warning}{tally}", file=sys.stderr)  # keeps the progress bar intact
        return warning

    def check(self) -> None:
        """Raise :class:`NoUpdateError` when every step of this run trained on no sample."""
        if self.steps and len(self.empty_steps) == self.steps:
            raise NoUpdateError(
                f"no step of this run trained on any sample ({self.steps} step(s), nothing learned); "
                f"at step {self.empty_steps[-1]}: {self.last_cause}"
            )

    def _cause(self, metrics: dict[str, float], nonfinite: list[str]) -> str:
        samples = self.geometry.samples
        masked = round(metrics.get("samples/truncated_masked", 0.0))
        if masked and masked >= samples - round(metrics.get("samples/padded", 0.0)):
            return (f"all {masked} samples that entered the step ran out of the generation budget (rollout.truncated) "
                    "and algorithm.mask_truncated leaves such samples out of the loss (raise the plugin's "
                    "generation budget)")
        invalid = round(metrics.get("samples/invalid", 0.0))  # per sampling round, averaged over the rounds
        named = ", ".join(repr(name) for name in nonfinite)
        rewards = f" (reward{'s' if len(nonfinite) > 1 else ''} {named})" if nonfinite else ""
        if invalid >= samples:
            return (f"all {samples} samples had a NaN or infinite reward{rewards}, and rewards.on_nonfinite=skip "
                    "drops such samples")
        dynamic = self.config.rollout.dynamic_sampling
        rounds = round(metrics.get("samples/rounds", 1.0))
        if invalid:
            return (f"dynamic sampling kept no sample in {rounds} round(s): about {invalid} of {samples} samples per "
                    f"round had a NaN or infinite reward{rewards} and no group of the others had a reward spread "
                    f"above rollout.dynamic_sampling.tolerance={dynamic.tolerance}")
        return (f"dynamic sampling kept no sample in {rounds} round(s): no group had a reward spread above "
                f"rollout.dynamic_sampling.tolerance={dynamic.tolerance}")
