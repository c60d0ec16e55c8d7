"""jax_ppo.sft: supervised fine-tuning, the first RLHF stage (`SFTConfig`, `SFTTrainer`)."""

from jax_ppo.sft.trainer import SFTConfig, SFTTrainer

__all__ = ["SFTConfig", "SFTTrainer"]
