"""The reward-model stage's configuration: `RewardModelConfig` and its optimizer block.

`RewardModelConfig.optimizer` is the training kit's `OptimizerConfig` at the reward model's
defaults (`RewardModelOptimizer`: AdamW at 1e-5, decayed linearly to 0, eps 1e-8). Configs saved
before the block existed kept its eight fields flat (`reward.learning_rate`); `MOVED_KEYS` maps
each to `optimizer.<field>`, so such a run folder resumes with the same meaning, and a config file
or override that still writes the flat key gets one error naming the new one
(`jax_ppo.config_io`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jax_ppo.training.optim import OptimizerConfig, check_stage_fields, is_int

OPTIMIZER_FIELDS = ("learning_rate", "lr_schedule", "warmup_steps", "adam_b1", "adam_b2",
                    "adam_eps", "weight_decay", "max_grad_norm")
"""The fields `RewardModelConfig` had flat before `optimizer` held them."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardModelOptimizer(OptimizerConfig):
  """`OptimizerConfig` at the reward model's defaults (only the defaults differ)."""

  learning_rate: float = 1e-5
  """Peak learning rate of AdamW (about 1e-5 for a full fine-tune; LoRA takes ~10x more)."""
  lr_schedule: str = "linear"
  """"constant", "linear" (decay to 0) or "cosine" (to 0), after the warm-up."""
  adam_eps: float = 1e-8
  """AdamW's epsilon (PyTorch's default)."""

  LR_HINT = "about 1e-5 for a full reward-model fine-tune"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardModelConfig:
  """Hyperparameters of a reward-model run. A batch is `batch_size` preference pairs."""

  MOVED_KEYS: ClassVar[dict[str, str]] = {f: f"optimizer.{f}" for f in OPTIMIZER_FIELDS}
  """Flat keys of configs written before the optimizer block -> their place in it."""

  # --- data ---
  max_length: int = 512
  """Tokens of prompt + response; longer sequences lose their start (the score is read at the
  end). At most the model's context (`max_position_embeddings` of its config.json): `jax-ppo
  reward` refuses a longer value before any weights load."""
  add_eos: bool = True
  """Append EOS to every response (unless it ends with one), as the policy's responses end."""
  prompt_field: str = "prompt"
  chosen_field: str = "chosen"
  rejected_field: str = "rejected"
  margin_field: str = "margin"
  """Record fields (the margin field is optional in a record; absent means 0)."""
  pad_token_id: int | None = None
  """Id written into padding; None: the tokenizer's, or 0."""
  eval_fraction: float = 0.0
  """Share of the training pairs held out for evaluation when no eval_data is given."""
  eos_token_id: int | None = None
  """Id appended to responses; None: the tokenizer's EOS, else the model config's first."""

  # --- schedule ---
  batch_size: int = 16
  """Preference pairs per optimizer step (each a chosen and a rejected row)."""
  gradient_accumulation_steps: int = 1
  """Microbatches per optimizer step: `batch_size / gradient_accumulation_steps` pairs go through
  the model at a time and their gradients are summed, so the step equals the whole batch's (the
  loss is the mean over the step's pairs); must divide `batch_size`."""
  num_epochs: int = 1
  """Passes over the pairs when `total_steps` is None (one pass is usual: reward models
  overfit quickly, Ouyang et al. 2022)."""
  total_steps: int | None = None
  """Optimizer steps of the run; None: `num_epochs` passes."""
  eval_every: int = 0
  """Evaluate on the held-out split every this many steps (0: only when `evaluate()` is
  called)."""
  eval_batch_size: int = 32
  """Pairs per evaluation (and scoring) batch."""

  # --- optimisation ---
  optimizer: RewardModelOptimizer = dataclasses.field(default_factory=RewardModelOptimizer)
  """AdamW, its schedule and the gradient clip (`reward.optimizer.learning_rate=...`)."""
  max_consecutive_skips: int | None = 5
  """Stop with `NonFiniteUpdates` after this many consecutive steps skipped for a NaN/inf loss or
  gradient (None: never stop)."""
  train_scan_layers: bool | None = None
  """Layer loop of the training forward/backward (see `PPOConfig.train_scan_layers`)."""
  seed: int = 0
  """Seed of the batch order."""

  def __post_init__(self):
    def bad(field: str, fix: str):
      raise ValueError(f"RewardModelConfig.{field}={getattr(self, field)!r} is invalid: {fix}.")

    for field, low in (("max_length", 2), ("batch_size", 1), ("num_epochs", 1),
                       ("eval_every", 0), ("eval_batch_size", 1),
                       ("gradient_accumulation_steps", 1)):
      if not is_int(getattr(self, field)) or getattr(self, field) < low:
        bad(field, f"use an int >= {low}")
    if self.batch_size % self.gradient_accumulation_steps:
      bad("gradient_accumulation_steps",
          f"it must divide batch_size ({self.batch_size}) into equal microbatches")
    check_stage_fields(self, bad, data="the pairs")
    if not isinstance(self.add_eos, bool):
      bad("add_eos", "use True or False")
    for field in ("prompt_field", "chosen_field", "rejected_field", "margin_field"):
      if not isinstance(getattr(self, field), str) or not getattr(self, field):
        bad(field, "give the record's field name as a non-empty string")
    if not (isinstance(self.eval_fraction, (int, float)) and 0 <= self.eval_fraction < 1):
      bad("eval_fraction", "use a value in [0, 1) (e.g. 0.05), or pass eval_data")


__all__ = ["OPTIMIZER_FIELDS", "RewardModelConfig", "RewardModelOptimizer"]
