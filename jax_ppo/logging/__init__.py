"""jax_ppo.logging: run logging off the training thread (JSONL, TensorBoard, W&B, progress)."""

from jax_ppo.logging.metrics_logger import (
    DEFAULT_PROGRESS_KEYS,
    METRICS_FILE,
    SAMPLES_FILE,
    TENSORBOARD_DIR,
    MetricsLogger,
)

__all__ = [
    "DEFAULT_PROGRESS_KEYS",
    "METRICS_FILE",
    "SAMPLES_FILE",
    "TENSORBOARD_DIR",
    "MetricsLogger",
]
