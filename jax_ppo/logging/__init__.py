"""jax_ppo.logging: run logging off the training thread (JSONL, TensorBoard, W&B, progress), and
PNG plots of a run folder's metrics (`write_plots`)."""

from jax_ppo.logging.metrics_logger import (
    DEFAULT_PROGRESS_KEYS,
    METRICS_FILE,
    SAMPLES_FILE,
    STEP_METRIC,
    TENSORBOARD_DIR,
    WANDB_ID_FILE,
    MetricsLogger,
)
from jax_ppo.logging.plots import PLOTS_DIR, write_plots

__all__ = [
    "DEFAULT_PROGRESS_KEYS",
    "METRICS_FILE",
    "PLOTS_DIR",
    "SAMPLES_FILE",
    "STEP_METRIC",
    "TENSORBOARD_DIR",
    "WANDB_ID_FILE",
    "MetricsLogger",
    "write_plots",
]
