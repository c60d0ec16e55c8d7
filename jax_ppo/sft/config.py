"""The configuration of an SFT run: `SFTConfig` and its optimizer block `SFTOptimizer`.

`SFTConfig.optimizer` is the training kit's `OptimizerConfig` (`jax_ppo.training.optim`) with
SFT's defaults (`SFTOptimizer`: peak learning rate 2e-5, cosine decay, AdamW epsilon 1e-8); a
file that gives `sft: {optimizer: {learning_rate: 1e-5}}` keeps the other SFT defaults. The
optimizer fields were flat fields of `SFTConfig` before the block existed (`learning_rate`,
`lr_schedule`, ...): `SFTConfig.MOVED_KEYS` maps each old key to its place in the block, so a
file or override that still uses one is refused with one error naming the new key, and a run
folder saved before the change resumes with the same meaning (`jax_ppo.config_io.migrate_keys`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jax_ppo.data.sft import ASSISTANT_TURNS
from jax_ppo.training.optim import OptimizerConfig, check_stage_fields, is_int

OPTIMIZER_KEYS = ("learning_rate", "lr_schedule", "warmup_steps", "adam_b1", "adam_b2",
                  "adam_eps", "weight_decay", "max_grad_norm")
"""The optimizer fields that `SFTConfig` held flat before the `optimizer` block."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTOptimizer(OptimizerConfig):
  """`OptimizerConfig` with SFT's defaults (the fields and their checks are the kit's)."""

  learning_rate: float = 2e-5
  """Peak learning rate of AdamW (reached after the warm-up)."""
  lr_schedule: str = "cosine"
  """"constant", "linear" (decay to 0) or "cosine" (to 0), after the warm-up."""
  adam_eps: float = 1e-8
  """AdamW's epsilon (PyTorch's default)."""

  LR_HINT: ClassVar[str] = "1e-5 to 1e-4 for full SFT fine-tuning"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
  """Hyperparameters of an SFT run. A batch is `batch_size` rows of `max_length` tokens."""

  # --- data ---
  max_length: int = 512
  """Tokens per row; longer examples keep their prompt and lose the end of the response. At most
  the model's context (`max_position_embeddings` of its config.json): `jax-ppo sft` refuses a
  longer value before any weights load."""
  packing: bool = False
  """Pack several examples into each row (segment ids keep them apart)."""
  add_eos: bool = True
  """Append EOS to every response (unless it holds one), so the model learns to stop."""
  prompt_field: str = "prompt"
  """Record field of the prompt string."""
  response_field: str = "response"
  """Record field of the response (a string, or a chat after a chat prompt); the default also
  reads TRL's "completion" (prompt-completion datasets), and a record with both "response" and
  "completion" is an error naming its line."""
  messages_field: str = "messages"
  """Record field of a chat (list of `{role, content}` turns, rendered by the chat template)."""
  assistant_turns: str = "all"
  """Assistant turns of a chat that are targets: "all" (the user turns between them are context)
  or "last" (every earlier turn is context)."""
  pad_token_id: int | None = None
  """Id written into padding (never attended to, never a target); None: the tokenizer's, or 0."""
  eos_token_id: int | None = None
  """Id appended to responses; None: the tokenizer's EOS."""
  eval_fraction: float = 0.0
  """Share of the training examples held out for evaluation when no eval set is given."""

  # --- batch geometry and length ---
  batch_size: int = 8
  """Rows per optimizer step (the global batch: on a mesh its rows are split over the devices
  of `data` x `fsdp`)."""
  gradient_accumulation_steps: int = 1
  """Microbatches per step (gradients summed; the loss is normalised by the step's tokens)."""
  num_epochs: int = 1
  """Passes over the training rows when `total_steps` is None."""
  total_steps: int | None = None
  """Optimizer steps of the run; None: `num_epochs` passes."""
  eval_every: int = 0
  """Evaluate on the held-out split every this many steps (0: only when `evaluate()` is
  called)."""

  # --- optimisation ---
  optimizer: SFTOptimizer = dataclasses.field(default_factory=SFTOptimizer)
  """AdamW, clipping, warm-up and schedule (`SFTOptimizer`: the kit's block, SFT's defaults)."""
  max_consecutive_skips: int | None = 5
  """Steps skipped in a row (non-finite loss or gradient: parameters left unchanged) before
  `train()` stops with `NonFiniteUpdates`; None never stops."""
  train_scan_layers: bool | None = None
  """Layer loop of the training forward/backward (see `PPOConfig.train_scan_layers`)."""
  seed: int = 0
  """Seed of the held-out split, the packing order and the batch order."""

  MOVED_KEYS: ClassVar[dict[str, str]] = {key: f"optimizer.{key}" for key in OPTIMIZER_KEYS}
  """Old flat key -> its place in the `optimizer` block (`jax_ppo.config_io`)."""

  def __post_init__(self):
    def bad(field: str, fix: str):
      raise ValueError(f"SFTConfig.{field}={getattr(self, field)!r} is invalid: {fix}.")

    for field, low in (("max_length", 2), ("batch_size", 1), ("gradient_accumulation_steps", 1),
                       ("num_epochs", 1), ("eval_every", 0)):
      if not is_int(getattr(self, field)) or getattr(self, field) < low:
        bad(field, f"use an int >= {low}")
    check_stage_fields(self, bad, data="the data")
    if self.batch_size % self.gradient_accumulation_steps:
      bad("batch_size", f"it must be divisible by gradient_accumulation_steps "
                        f"({self.gradient_accumulation_steps})")
    for field in ("packing", "add_eos"):
      if not isinstance(getattr(self, field), bool):
        bad(field, "use True or False")
    for field in ("prompt_field", "response_field", "messages_field"):
      if not isinstance(getattr(self, field), str) or not getattr(self, field):
        bad(field, "give the record's field name as a non-empty string")
    if self.assistant_turns not in ASSISTANT_TURNS:
      bad("assistant_turns", f"use one of {list(ASSISTANT_TURNS)}")
    if not 0 <= self.eval_fraction < 1:
      bad("eval_fraction", "use a value in [0, 1) (e.g. 0.05), or pass eval_data")

  @property
  def microbatch_size(self) -> int:
    """Rows per microbatch (`batch_size / gradient_accumulation_steps`)."""
    return self.batch_size // self.gradient_accumulation_steps


__all__ = ["OPTIMIZER_KEYS", "SFTConfig", "SFTOptimizer"]
