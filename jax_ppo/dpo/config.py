"""The DPO stage's configuration: `DPOConfig` and its optimizer block `DPOOptimizer`.

`DPOConfig.optimizer` is the training kit's `OptimizerConfig` (`jax_ppo.training.optim`) at
DPO's defaults (`DPOOptimizer`: AdamW at 1e-6, decayed linearly to 0, eps 1e-8: TRL's
`DPOConfig` defaults). The loss is `jax_ppo.core.dpo_loss` with `beta`, `loss_type` and
`label_smoothing`. Online DPO (`jax_ppo.dpo.online`) also reads `n_samples` and `sampling`
(`DPOSampling`: the compiled sampler's `SamplingParams` at TRL's `OnlineDPOConfig` defaults).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from jax_ppo.core.preference import DPO_LOSS_TYPES
from jax_ppo.rollout.config import SamplingParams
from jax_ppo.training.optim import OptimizerConfig, check_stage_fields, is_int


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOOptimizer(OptimizerConfig):
  """`OptimizerConfig` at DPO's defaults (only the defaults differ)."""

  learning_rate: float = 1e-6
  """Peak learning rate of AdamW (TRL's DPO default; LoRA takes ~10-100x more)."""
  lr_schedule: str = "linear"
  """"constant", "linear" (decay to 0) or "cosine" (to 0), after the warm-up."""
  adam_eps: float = 1e-8
  """AdamW's epsilon (PyTorch's default)."""

  LR_HINT: ClassVar[str] = "about 1e-6 to 5e-7 for a full DPO fine-tune"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOSampling(SamplingParams):
  """How online DPO samples its responses: `SamplingParams` at TRL's `OnlineDPOConfig` defaults
  (64 new tokens, temperature 0.9). The sampler's pad id is `DPOConfig.pad_token_id`, else the
  tokenizer's, else `pad_token_id` here; empty `stop_token_ids` stop at `DPOConfig.eos_token_id`,
  the tokenizer's and the model's EOS ids (`jax_ppo.dpo.online.sampler_ids`)."""

  max_new_tokens: int = 64
  """Response length limit `T`; rows that reach it without a stop token are truncated."""
  temperature: float = 0.9
  """Sampling temperature (the DPO loss reads the model's own distribution, temperature 1)."""

  OWNER: ClassVar[str | None] = "DPOConfig.sampling"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOConfig:
  """Hyperparameters of a DPO run. A batch is `batch_size` preference pairs."""

  # --- loss ---
  beta: float = 0.1
  """> 0: the strength of the KL constraint to the reference (DPO's temperature, IPO's
  regulariser). Implicit rewards are `beta * (log pi - log pi_ref)`."""
  loss_type: str = "sigmoid"
  """"sigmoid" (DPO; cDPO with label_smoothing), "ipo" or "hinge" (`jax_ppo.core.dpo_loss`)."""
  label_smoothing: float = 0.0
  """In [0, 0.5): the assumed share of flipped preference labels (cDPO; "sigmoid" only)."""

  # --- data ---
  max_length: int = 512
  """Tokens of prompt + response per row; a longer response loses its end, then a longer prompt
  its start (at least one prompt token is kept)."""
  add_eos: bool = True
  """Append EOS to every response (unless it ends with one), as sampled responses end."""
  prompt_field: str = "prompt"
  chosen_field: str = "chosen"
  rejected_field: str = "rejected"
  """Record fields (text or chats, explicit or implicit prompt: `jax_ppo.data.preferences`)."""
  pad_token_id: int | None = None
  """Id written into padding; None: the tokenizer's, or 0."""
  eos_token_id: int | None = None
  """Id appended to responses; None: the tokenizer's EOS, else the model config's first."""
  eval_fraction: float = 0.0
  """Share of the training pairs held out for evaluation when no eval data is given."""

  # --- online DPO (`OnlineDPOTrainer`, `DPORunConfig.prompts_path`) ---
  n_samples: int = 2
  """Online DPO: responses sampled per prompt, >= 2; the best scored is the chosen response, the
  worst the rejected one (TRL samples 2). Pairs whose scores all tie train nothing."""
  sampling: DPOSampling = dataclasses.field(default_factory=DPOSampling)
  """Online DPO: how the responses are sampled (`dpo.sampling.max_new_tokens=...`)."""

  # --- schedule ---
  batch_size: int = 8
  """Preference pairs per optimizer step (each a chosen and a rejected row); online DPO: prompts
  per step (each gives one pair)."""
  gradient_accumulation_steps: int = 1
  """Microbatches per optimizer step (gradients summed; the loss is the mean over the step's
  pairs); must divide `batch_size`."""
  num_epochs: int = 1
  """Passes over the pairs when `total_steps` is None."""
  total_steps: int | None = None
  """Optimizer steps of the run; None: `num_epochs` passes."""
  eval_every: int = 0
  """Evaluate on the held-out split every this many steps (0: only when `evaluate()` is
  called)."""
  eval_batch_size: int = 16
  """Pairs per evaluation batch (and per batch of `precompute_reference`)."""
  precompute_reference: bool = False
  """Compute the reference's log-probs of every training and held-out pair once, before the
  first step (in batches of `eval_batch_size` pairs, logged as `time/reference_s`), keep them on
  the host and train the policy alone against them (TRL's `precompute_ref_log_probs`): a step
  then runs no reference forward, and without LoRA the reference's weights are freed. The same
  losses and weights as False within float32 rounding (while the policy still is the reference,
  rounding may count a tied pair in `rewards/accuracies`); a resumed run computes them again (one
  reference forward over all pairs). False: the reference runs in every step."""

  # --- optimisation ---
  optimizer: DPOOptimizer = dataclasses.field(default_factory=DPOOptimizer)
  """AdamW, its schedule and the gradient clip (`dpo.optimizer.learning_rate=...`)."""
  max_consecutive_skips: int | None = 5
  """Stop with `NonFiniteUpdates` after this many consecutive steps skipped for a NaN/inf loss or
  gradient (None: never stop)."""
  train_scan_layers: bool | None = None
  """Layer loop of the training forward/backward (see `PPOConfig.train_scan_layers`)."""
  seed: int = 0
  """Seed of the held-out split and the batch order."""

  def check_warmup(self, total_steps: int) -> None:
    """Refuses a warm-up longer than the run's `total_steps` optimizer steps (known only once
    the trainer has counted its data), naming `DPOConfig.optimizer.warmup_steps`."""
    if self.optimizer.warmup_steps > total_steps:
      raise ValueError(f"DPOConfig.optimizer.warmup_steps={self.optimizer.warmup_steps} is "
                       f"invalid: it exceeds the run's {total_steps} optimizer steps; lower it "
                       "or train longer.")

  def __post_init__(self):
    def bad(field: str, fix: str):
      raise ValueError(f"DPOConfig.{field}={getattr(self, field)!r} is invalid: {fix}.")

    number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
    if not (number(self.beta) and math.isfinite(self.beta) and self.beta > 0):
      bad("beta", "use a finite value > 0 (e.g. 0.1)")
    if self.loss_type not in DPO_LOSS_TYPES:
      bad("loss_type", f"use one of {list(DPO_LOSS_TYPES)}")
    if not (number(self.label_smoothing) and 0 <= self.label_smoothing < 0.5):
      bad("label_smoothing", "use a value in [0, 0.5) (0: plain DPO)")
    if self.label_smoothing and self.loss_type != "sigmoid":
      bad("label_smoothing", f"it applies to loss_type 'sigmoid' (cDPO) only, not "
                             f"{self.loss_type!r}; set it to 0")
    for field, low in (("max_length", 2), ("batch_size", 1), ("num_epochs", 1),
                       ("eval_every", 0), ("eval_batch_size", 1),
                       ("gradient_accumulation_steps", 1)):
      if not is_int(getattr(self, field)) or getattr(self, field) < low:
        bad(field, f"use an int >= {low}")
    if self.batch_size % self.gradient_accumulation_steps:
      bad("gradient_accumulation_steps",
          f"it must divide batch_size ({self.batch_size}) into equal microbatches")
    check_stage_fields(self, bad, data="the pairs")
    for field in ("add_eos", "precompute_reference"):
      if not isinstance(getattr(self, field), bool):
        bad(field, "use True or False")
    for field in ("prompt_field", "chosen_field", "rejected_field"):
      if not isinstance(getattr(self, field), str) or not getattr(self, field):
        bad(field, "give the record's field name as a non-empty string")
    if not (number(self.eval_fraction) and 0 <= self.eval_fraction < 1):
      bad("eval_fraction", "use a value in [0, 1) (e.g. 0.05), or pass eval data")
    if not is_int(self.n_samples) or self.n_samples < 2:
      bad("n_samples", "use an int >= 2 (online DPO pairs the best and the worst of a prompt's "
                       "samples; TRL uses 2)")
    if not isinstance(self.sampling, DPOSampling):
      bad("sampling", "give a mapping of DPOSampling fields (max_new_tokens, temperature, ...)")


__all__ = ["DPOConfig", "DPOOptimizer", "DPOSampling"]
