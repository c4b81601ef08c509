"""Training: sharded jit step, AdamW, Orbax checkpoints, metrics. Entry points: train, evaluate."""

from mllm.train.evaluation import evaluate
from mllm.train.loop import TrainingDiverged, train

__all__ = ["TrainingDiverged", "evaluate", "train"]
