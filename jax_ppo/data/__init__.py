"""Data: prompt datasets with a deterministic, resumable order."""

from jax_ppo.data.prompts import PromptDataset

__all__ = ["PromptDataset"]
