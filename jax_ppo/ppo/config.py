"""Configuration of a PPO (and GRPO / RLOO / REINFORCE++) run for language models.

One frozen, keyword-only dataclass, validated at construction: every error names the field and
the fix. The optimizer and the sampling are blocks of their own (`PPOConfig.optimizer`,
`PPOConfig.sampling`); `PPOConfig.MOVED_KEYS` maps the keys they held flat before
(`learning_rate` -> `optimizer.learning_rate`, `temperature` -> `sampling.temperature`).
Defaults follow "The N+ Implementation Details of RLHF with PPO" (Huang et al. 2024) and
`docs/rlhf_details.md`; the item numbers below refer to that list.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import ClassVar

from jax_ppo.core import CORRECTION_LEVELS, CORRECTION_MODES, KL_ESTIMATORS, REDUCTIONS
from jax_ppo.ppo.advantages import ADVANTAGE_FNS, CRITIC_MODES, GROUP_MODES
from jax_ppo.ppo.policy_losses import POLICY_LOSS_FNS, SEQUENCE_LEVEL_LOSSES
from jax_ppo.rollout.config import SamplingParams
from jax_ppo.training.optim import OptimizerConfig

ADVANTAGE_MODES = tuple(ADVANTAGE_FNS)
"""The advantage modes: the keys of `jax_ppo.ppo.advantages.ADVANTAGE_FNS`."""
POLICY_LOSSES = tuple(POLICY_LOSS_FNS)
"""The policy losses: the keys of `jax_ppo.ppo.policy_losses.POLICY_LOSS_FNS`."""
KL_CONTROLLERS = ("fixed", "adaptive", "multiplicative")
GRPO_SCALES = ("group", "batch", "none")
DYNAMIC_SAMPLING_METRICS = ("raw_score", "score")
"""What `PPOConfig.dynamic_sampling` compares within a group: raw or processed scores."""


OPTIMIZER_FIELDS = ("learning_rate", "lr_schedule", "warmup_steps", "adam_eps", "adam_b1",
                    "adam_b2", "weight_decay", "max_grad_norm")
"""The optimizer fields `PPOConfig` held flat before they moved into `PPOConfig.optimizer`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOOptimizer(OptimizerConfig):
  """PPO's optimizer block (`PPOConfig.optimizer`): `OptimizerConfig` with PPO's defaults
  (docs/rlhf_details.md item 17): a peak learning rate of 3e-6 decayed linearly to 0 and
  PyTorch-PPO's Adam epsilon 1e-5.

  `max_grad_norm` clips one global norm over the policy's and the critic's gradients, or one per
  model when the critic runs on a sub-mesh of its own (`RunConfig.placement.critic`,
  `jax_ppo.ppo.placed_critic`).
  """

  learning_rate: float = 3e-6
  """Peak learning rate of AdamW (reached after the warm-up)."""
  lr_schedule: str = "linear"
  """"constant", "linear" (decay to 0) or "cosine" (to 0), after the warm-up."""
  adam_eps: float = 1e-5
  """AdamW's epsilon (PyTorch-style PPO; item 17)."""
  critic_learning_rate: float | None = None
  """Peak learning rate of the critic (a separate value model's parameters, or the value head on
  the policy trunk), on the same warm-up and decay as `learning_rate`; None: `learning_rate`;
  0 freezes the critic. Logged as `lr/critic` when the run has a critic."""

  LR_HINT = "1e-6 to 3e-6 for full PPO fine-tuning"

  def __post_init__(self):
    super().__post_init__()
    value = self.critic_learning_rate
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value) or value < 0):
      raise ValueError(
          f"{type(self).__name__}.critic_learning_rate={value!r} is invalid: use a number >= 0 "
          "(e.g. 1e-5; 0 freezes the critic), or None for the policy's learning_rate.")

  @property
  def critic_lr_ratio(self) -> float | None:
    """`critic_learning_rate / learning_rate`: the factor of the critic's updates over the
    policy's (the schedule is shared), or None when the critic uses `learning_rate`."""
    if self.critic_learning_rate is None:
      return None
    return self.critic_learning_rate / self.learning_rate


SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "stop_token_ids",
                   "pad_token_id")
"""The sampling fields `PPOConfig` held flat before they moved into `PPOConfig.sampling`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOSampling(SamplingParams):
  """PPO's sampling block (`PPOConfig.sampling`): the sampler's `SamplingParams` with PPO's
  defaults (docs/rlhf_details.md items 3, 5, 7 and 20): temperature 0.7, top-k and top-p off.

  The temperature divides the logits of the rollout and of every log-prob the update takes (old,
  reference and new policy: item 3). `n_samples` is not here: it is batch geometry
  (`PPOConfig.n_samples`: `batch_size` is a multiple of it, the group advantages need it).
  """

  max_new_tokens: int = 48
  """Response length limit `T`."""
  temperature: float = 0.7
  """Sampling temperature; old, reference and new log-probs use the same one."""
  top_k: int = 0
  """Top-k during training rollouts (0 = off, the recommended training setting)."""
  top_p: float = 1.0
  """Top-p during training rollouts (1 = off)."""
  stop_token_ids: tuple[int, ...] = ()
  """Ids that end a response (EOS and extra stop ids). Empty: always `max_new_tokens`."""
  pad_token_id: int = 0
  """PAD id, distinct from EOS (item 1)."""

  OWNER: ClassVar[str | None] = "PPOConfig.sampling"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOConfig:
  """Hyperparameters of the RLHF loop. `B = batch_size` rollouts per update."""

  # --- batch geometry (item 18) ---
  batch_size: int = 8
  """Responses per update (prompts per update x `n_samples`)."""
  n_samples: int = 1
  """Responses per prompt; >= 2 for "grpo" and "rloo" (consecutive rows share a prompt)."""
  num_minibatches: int = 1
  """Optimizer steps per epoch; must divide `batch_size`."""
  gradient_accumulation_steps: int = 1
  """Micro-batches per minibatch (gradients summed, normalised by the minibatch token count)."""
  ppo_epochs: int = 4
  """Passes over each rollout batch, reshuffled every epoch."""

  # --- sampling and response penalties (items 3, 5, 7, 20) ---
  sampling: PPOSampling = dataclasses.field(default_factory=PPOSampling)
  """How training rollouts are sampled: the length limit, the temperature (also that of the old,
  reference and new log-probs), top-k / top-p and the stop and pad ids (`PPOSampling`; e.g.
  `ppo.sampling.max_new_tokens=64` on the command line)."""
  missing_eos_penalty: float | None = None
  """Score given to responses that hit `sampling.max_new_tokens` without a stop token (item 7);
  None keeps the reward model's score."""
  length_penalty: float = 0.0
  """Subtracted from the score per response token, against length reward hacking."""
  overlong_cache_length: int | None = None
  """DAPO's overlong reward shaping (`core.overlong_penalty`): over the last this many tokens
  before `sampling.max_new_tokens` the score falls linearly by up to `overlong_penalty`; None
  disables it."""
  overlong_penalty: float = 1.0
  """The penalty at `sampling.max_new_tokens` of the overlong shaping (DAPO: 1.0)."""

  # --- DAPO dynamic sampling (docs/rlhf_details.md item 24) ---
  dynamic_sampling: bool = False
  """DAPO's dynamic sampling (`jax_ppo.ppo.dynamic_sampling`): prompt groups whose `n_samples`
  scores are all equal (zero group advantage) are dropped and further prompt batches are drawn,
  sampled and scored until `prompts_per_update` groups with differing scores fill the batch;
  each draw consumes one batch of the prompt order. Needs a group advantage
  (`advantage_mode` "grpo" or "rloo") and one process. Logged: `train/num_gen_batches` (draws),
  `dynamic_sampling/dropped_fraction` (constant groups over groups drawn) and
  `dynamic_sampling/filled_groups`."""
  dynamic_sampling_max_draws: int = 10
  """Most prompt batches drawn per update with `dynamic_sampling` (verl's `max_num_gen_batches`,
  10 in its DAPO recipes). When they hold fewer varied groups than the batch needs, the constant
  groups drawn fill the rest (advantage 0: they change no policy gradient) instead of stopping
  the run as verl does, counted in `dynamic_sampling/filled_groups`."""
  dynamic_sampling_metric: str = "raw_score"
  """Which score a group must vary in to be kept: "raw_score" (the reward source's output, e.g.
  an exact-match accuracy, as DAPO filters on accuracy) or "score" (after `reward_scale` /
  `reward_shift` / `reward_clip`, the length, overlong and missing-EOS penalties: the score the
  advantages see)."""

  # --- rewards (items 8, 16) ---
  reward_scale: float = 1.0
  """Scores are mapped to `(score - reward_shift) * reward_scale` before clipping (item 16: set
  them so SFT samples have mean 0 and std 1)."""
  reward_shift: float = 0.0
  """See `reward_scale`."""
  reward_clip: float | None = 5.0
  """Scores are clipped to [-reward_clip, reward_clip] (None disables)."""
  whiten_rewards: bool = False
  """Whiten per-token rewards before GAE (off by default: it shortens outputs, item 11)."""

  # --- KL (items 8, 22) ---
  kl_coef: float = 0.05
  """Initial KL coefficient beta."""
  kl_controller: str = "fixed"
  """"fixed", "adaptive" (Ziegler et al. 2019) or "multiplicative" (x0.5 / x2)."""
  kl_target: float = 6.0
  """Target KL (per sequence, nats) for the adaptive controllers."""
  kl_horizon: int = 10000
  """Horizon (samples) of the adaptive controller."""
  kl_estimator: str = "k1"
  """Per-token estimator of the reward penalty ("k1", "k2", "k3", "abs")."""
  kl_in_reward: bool | None = None
  """True: `r_t = -beta kl_t` in the reward; False: `beta * KL` as a loss term (GRPO style, with
  `kl_loss_estimator`). None picks per mode: reward for "gae"/"rloo"/"reinforce++", loss for
  "grpo"."""
  kl_loss_estimator: str = "k3"
  """Estimator of the KL loss term when `kl_in_reward` is False."""

  # --- advantages (items 10, 11) ---
  advantage_mode: str = "gae"
  """"gae" (critic), "grpo", "rloo" or "reinforce++" (no critic): a key of
  `jax_ppo.ppo.advantages.ADVANTAGE_FNS`."""
  gamma: float = 1.0
  """Discount."""
  lam: float = 0.95
  """GAE lambda."""
  whiten_advantages: bool = True
  """Whiten GAE advantages over valid tokens (mean-shifted)."""
  grpo_scale: str = "group"
  """Std used by GRPO: "group", "batch" or "none"."""

  # --- losses (items 12, 13) ---
  clip_eps: float = 0.2
  """Policy ratio clip range."""
  clip_eps_high: float | None = None
  """Upper ratio clip (DAPO clip-higher); None uses `clip_eps`."""
  dual_clip: float | None = None
  """Dual-clip constant c > 1 for negative advantages; None disables."""
  value_clip_eps: float | None = 0.2
  """Value clip range around the rollout values (`cliprange_value`); None disables."""
  vf_coef: float = 0.1
  """Weight of the value loss."""
  entropy_coef: float = 0.0
  """Initial weight of the entropy bonus."""
  entropy_coef_final: float | None = None
  """Entropy weight reached after `total_updates` updates: update `n` (0-based) uses
  `entropy_coef + (entropy_coef_final - entropy_coef) * n / total_updates`, so the last update
  is one step short of it. None keeps the weight constant."""
  policy_loss: str = "ppo"
  """"ppo" (the clipped surrogate), "gspo" (sequence-level ratio; clip ranges such as 3e-4 /
  4e-4) or "cispo" (clipped stop-gradient weight, bounded above by `clip_eps_high`, else
  `clip_eps`): a key of `jax_ppo.ppo.policy_losses.POLICY_LOSS_FNS`."""
  loss_reduction: str = "token-mean"
  """"token-mean", "seq-mean-token-mean", "seq-mean-token-sum" or "token-sum-norm" (Dr. GRPO:
  the masked sum over B x T, with `grpo_scale="none"`)."""
  rollout_correction_level: str | None = None
  """Correct the policy loss for the sampler's log-probs differing from the trainer's
  (`core.rollout_correction_weights`): "token" or "sequence" importance weights of the trainer's
  old log-probs over the sampler's, which multiply each token's loss (through its advantage);
  None: off. The sampler-trainer KL is logged either way (`rollout_correction/kl`)."""
  rollout_correction_mode: str = "truncate"
  """"truncate" (TIS: `min(w, cap)`) or "mask" (drop tokens or sequences with `w > cap`)."""
  rollout_correction_cap: float = 2.0
  """The cap of the rollout-correction weights (> 0)."""
  target_kl: float | None = None
  """Stop the remaining epochs of an update once the epoch's mean approximate KL exceeds this."""

  # --- optimisation (item 17) ---
  optimizer: PPOOptimizer = dataclasses.field(default_factory=PPOOptimizer)
  """AdamW, its clip and its schedule over `total_optimizer_steps` (`PPOOptimizer`; e.g.
  `ppo.optimizer.learning_rate=1e-6` on the command line)."""
  max_consecutive_skips: int | None = 5
  """An optimizer step whose loss or gradient is NaN/inf is skipped (parameters and optimizer
  state unchanged, counted in the `skipped_updates` metric); after this many consecutive
  updates with skipped steps the run stops with `NonFiniteUpdates` (None: never stop)."""
  total_updates: int = 100
  """Number of PPO updates (rollout batches) of the run; sets the LR and entropy schedules."""

  # --- experience replay ---
  replay_buffer_size: int = 0
  """Keep the last K rollout batches with their behaviour log-probs and replay them (0 = off)."""
  replay_batches_per_update: int = 0
  """Replayed batches trained on after each fresh one, under the same clipped objective."""

  # --- layer loops (performance only; the numbers are the same) ---
  train_scan_layers: bool | None = None
  """Layer loop of the training forward/backward (old, reference and new log-probs, values):
  True `lax.scan` (compile time independent of depth), False unrolled (no per-layer weight
  copies: ~20% faster fwd+bwd on CPU for shallow models, compile time grows with depth), None
  keeps each model's own `scan_layers`."""
  rollout_scan_layers: bool | None = None
  """Layer loop of the sampler's prefill and decode (same choices). On CPU the scanned decode
  step is ~2.5x faster than the unrolled one at the TRL benchmark shape."""

  seed: int = 0
  """Seed of the run (sampling keys, shuffles, model init)."""

  MOVED_KEYS: ClassVar[dict[str, str]] = {
      **{f: f"optimizer.{f}" for f in OPTIMIZER_FIELDS},
      **{f: f"sampling.{f}" for f in SAMPLING_FIELDS},
  }
  """Old flat optimizer and sampling keys -> their place in the `optimizer` and `sampling`
  blocks (`jax_ppo.config_io`)."""

  def __post_init__(self):
    def bad(field: str, fix: str):
      raise ValueError(f"PPOConfig.{field}={getattr(self, field)!r} is invalid: {fix}.")

    def positive_int(field: str):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        bad(field, "use an int >= 1")

    for f in dataclasses.fields(self):  # numbers before any comparison (no TypeError below)
      value = getattr(self, f.name)
      if f.type in ("float", "float | None") and not (
          (value is None and f.type != "float")
          or (isinstance(value, numbers.Real) and not isinstance(value, bool))):
        bad(f.name, "use a number" + (" or None" if f.type != "float" else ""))
    for field in ("batch_size", "n_samples", "num_minibatches", "gradient_accumulation_steps",
                  "ppo_epochs", "total_updates", "kl_horizon"):
      positive_int(field)
    for field, choices in (
        ("advantage_mode", ADVANTAGE_MODES),
        ("kl_controller", KL_CONTROLLERS),
        ("kl_estimator", KL_ESTIMATORS),
        ("kl_loss_estimator", KL_ESTIMATORS),
        ("loss_reduction", REDUCTIONS),
        ("grpo_scale", GRPO_SCALES),
        ("policy_loss", POLICY_LOSSES),
        ("rollout_correction_mode", CORRECTION_MODES),
        ("dynamic_sampling_metric", DYNAMIC_SAMPLING_METRICS),
    ):
      if getattr(self, field) not in choices:
        bad(field, f"choose one of {choices}")
    if self.batch_size % self.n_samples:
      bad("batch_size", f"it must be a multiple of n_samples ({self.n_samples})")
    if self.batch_size % self.num_minibatches:
      bad("batch_size", f"it must be divisible by num_minibatches ({self.num_minibatches})")
    if self.minibatch_size % self.gradient_accumulation_steps:
      bad(
          "gradient_accumulation_steps",
          f"it must divide the minibatch size batch_size / num_minibatches = "
          f"{self.minibatch_size}",
      )
    if self.advantage_mode in GROUP_MODES and self.n_samples < 2:
      bad("n_samples", f"advantage_mode={self.advantage_mode!r} needs n_samples >= 2")
    if not isinstance(self.dynamic_sampling, bool):
      bad("dynamic_sampling", "use True or False")
    positive_int("dynamic_sampling_max_draws")
    if self.dynamic_sampling and self.advantage_mode not in GROUP_MODES:
      bad("dynamic_sampling", f"it drops prompt groups whose scores are all equal, which carry "
                              f"no signal only under a group advantage, not under "
                              f"advantage_mode={self.advantage_mode!r}: use advantage_mode "
                              f"'grpo' or 'rloo' with n_samples >= 2, or dynamic_sampling=False")
    if not isinstance(self.sampling, PPOSampling):
      bad("sampling", "pass a PPOSampling (jax_ppo.ppo.config)")
    if not 0 <= self.gamma <= 1:
      bad("gamma", "use a value in [0, 1]")
    if not 0 <= self.lam <= 1:
      bad("lam", "use a value in [0, 1]")
    if not self.clip_eps > 0:
      bad("clip_eps", "use a value > 0 (e.g. 0.2)")
    if self.clip_eps_high is not None and not self.clip_eps_high > 0:
      bad("clip_eps_high", "use a value > 0 or None")
    if self.dual_clip is not None and not self.dual_clip > 1:
      bad("dual_clip", "use a value > 1 (e.g. 3.0) or None")
    if self.value_clip_eps is not None and not self.value_clip_eps > 0:
      bad("value_clip_eps", "use a value > 0 or None")
    sequence_loss = self.policy_loss in SEQUENCE_LEVEL_LOSSES
    if (sequence_loss and self.gradient_accumulation_steps > 1
        and self.loss_reduction not in ("seq-mean-token-mean", "seq-mean-token-sum")):
      bad("loss_reduction", f"policy_loss={self.policy_loss!r} averages over sequences, so with "
                            "gradient_accumulation_steps > 1 the other terms must too: use "
                            "'seq-mean-token-mean'")
    if self.rollout_correction_level not in (None, *CORRECTION_LEVELS):
      bad("rollout_correction_level", f"choose one of {CORRECTION_LEVELS} or None (off)")
    if sequence_loss and self.rollout_correction_level == "token":
      bad("rollout_correction_level", f"policy_loss={self.policy_loss!r} has one ratio per "
                                      "sequence: use 'sequence'")
    if not self.rollout_correction_cap > 0:
      bad("rollout_correction_cap", "use a value > 0 (e.g. 2.0)")
    if self.overlong_cache_length is not None and (
        isinstance(self.overlong_cache_length, bool)
        or not isinstance(self.overlong_cache_length, int)
        or not 1 <= self.overlong_cache_length <= self.sampling.max_new_tokens):
      bad("overlong_cache_length", f"use an int in [1, sampling.max_new_tokens = "
                                   f"{self.sampling.max_new_tokens}] or None (off)")
    if not self.overlong_penalty >= 0:
      bad("overlong_penalty", "use a value >= 0")
    for field in ("train_scan_layers", "rollout_scan_layers"):
      value = getattr(self, field)
      if value is not None and not isinstance(value, bool):
        bad(field, "use True (lax.scan), False (unrolled) or None (the model's setting)")
    for field in ("kl_coef", "vf_coef", "entropy_coef", "length_penalty"):
      if not getattr(self, field) >= 0:
        bad(field, "use a value >= 0")
    if self.entropy_coef_final is not None and not self.entropy_coef_final >= 0:
      bad("entropy_coef_final", "use a value >= 0 or None")
    if not self.kl_target > 0:
      bad("kl_target", "use a value > 0")
    for field in ("reward_shift", "missing_eos_penalty"):
      value = getattr(self, field)
      if value is not None and not math.isfinite(value):
        bad(field, "use a finite number")
    if self.reward_clip is not None and not self.reward_clip > 0:
      bad("reward_clip", "use a value > 0 or None")
    if not self.reward_scale > 0:
      bad("reward_scale", "use a value > 0")
    if self.target_kl is not None and not self.target_kl > 0:
      bad("target_kl", "use a value > 0 or None")
    if not isinstance(self.optimizer, OptimizerConfig):
      bad("optimizer", "pass a PPOOptimizer (jax_ppo.ppo.config)")
    if self.optimizer.critic_learning_rate is not None and not self.uses_critic:
      raise ValueError(
          f"PPOConfig.optimizer.critic_learning_rate={self.optimizer.critic_learning_rate!r} "
          f"is set but advantage_mode={self.advantage_mode!r} trains no critic; leave it None "
          "(or use advantage_mode='gae').")
    if self.optimizer.warmup_steps > self.total_optimizer_steps:
      bad("optimizer", f"its warmup_steps ({self.optimizer.warmup_steps}) exceeds the run's "
                       f"{self.total_optimizer_steps} optimizer steps")
    for field in ("replay_buffer_size", "replay_batches_per_update"):
      value = getattr(self, field)
      if not isinstance(value, int) or value < 0:
        bad(field, "use an int >= 0")
    if self.replay_batches_per_update > self.replay_buffer_size:
      bad("replay_batches_per_update", "it cannot exceed replay_buffer_size")
    if self.max_consecutive_skips is not None and (
        not isinstance(self.max_consecutive_skips, int)
        or isinstance(self.max_consecutive_skips, bool) or self.max_consecutive_skips < 1):
      bad("max_consecutive_skips", "use an int >= 1 or None (never stop)")

  # --- derived values ---
  @property
  def prompts_per_update(self) -> int:
    return self.batch_size // self.n_samples

  @property
  def minibatch_size(self) -> int:
    return self.batch_size // self.num_minibatches

  @property
  def microbatch_size(self) -> int:
    return self.minibatch_size // self.gradient_accumulation_steps

  @property
  def uses_critic(self) -> bool:
    return self.advantage_mode in CRITIC_MODES

  @property
  def kl_enters_reward(self) -> bool:
    if self.kl_in_reward is not None:
      return self.kl_in_reward
    return self.advantage_mode != "grpo"

  @property
  def total_optimizer_steps(self) -> int:
    per_update = self.ppo_epochs * self.num_minibatches * (1 + self.replay_batches_per_update)
    return self.total_updates * per_update
