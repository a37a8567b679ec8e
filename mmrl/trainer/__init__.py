"""The Accelerate training loop and its parts (sampler, credit step, metrics, EMA, checkpoints)."""

from mmrl.trainer.trainer import Trainer, TrainResult

__all__ = ["TrainResult", "Trainer"]
