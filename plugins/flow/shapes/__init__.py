"""The shapes world: an offline text-to-image Flow-GRPO demo that runs on a laptop CPU (docs/shapes.md).

A miniature of Flow-GRPO's GenEval experiment: 32×32 images of one to three coloured shapes, a tiny SD3 pipeline
(built from diffusers' and transformers' own classes, loaded by the flow plugin like SD3.5) pretrained here with
flow matching, and the rule-based ``shapes`` reward (:mod:`mmrl.rewards.shapes`) that checks objects, colours,
counts and positions from the pixels.

Modules (nothing heavy is imported by this package):

- :mod:`~mmrl.plugins.flow.shapes.world`: the palette, shapes, prompt grammar, layouts, rendering and the split of
  compositions into training and held-out prompts; ``python -m mmrl.plugins.flow.shapes.world FOLDER`` writes the
  dataset files.
- :mod:`~mmrl.plugins.flow.shapes.model`: the pipeline (a latent MMDiT, word-level tokenizers built locally; the
  exact pixel identity VAE of the first model is kept as an option).
- :mod:`~mmrl.plugins.flow.shapes.autoencoder`: the latent autoencoder (``AutoencoderTiny``) and the script that
  trains it on the world's renderings.
- :mod:`~mmrl.plugins.flow.shapes.pretrain`: the flow-matching pretraining script that made ``assets/pipeline``.
- :mod:`~mmrl.plugins.flow.shapes.sampling`: sampling and scoring outside the trainer.
- :mod:`~mmrl.plugins.flow.shapes.report`: the score before and after a run, per task, the grids and the
  reward curve.
"""
