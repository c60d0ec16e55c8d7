"""jax_ppo.sft: supervised fine-tuning, the first RLHF stage.

`config` (`SFTConfig`, its optimizer block `SFTOptimizer`), `steps` (the batch, the loss and
the compiled steps, on one device or a mesh), `trainer` (`SFTTrainer`, the host side).
"""

from jax_ppo.sft.config import SFTConfig, SFTOptimizer
from jax_ppo.sft.steps import SFTBatch, SFTSteps, sft_loss, token_nll
from jax_ppo.sft.trainer import SFTTrainer

__all__ = ["SFTBatch", "SFTConfig", "SFTOptimizer", "SFTSteps", "SFTTrainer", "sft_loss",
           "token_nll"]
