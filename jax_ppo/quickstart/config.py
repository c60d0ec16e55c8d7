"""Configuration of the quickstart pipeline (`experiments/quickstart.py`).

One frozen dataclass sized so that the whole pipeline (corpus and tokenizer, SFT, preference
pairs, reward model, PPO) finishes within about 10 minutes on 2 CPU cores; `smoke()` shrinks
every stage to a handful of steps for CI.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuickstartConfig:
  """Sizes and hyperparameters of the quickstart's five stages."""

  seed: int = 0
  """Seed of the corpus, tokenizer split, model init, sampling and labelling noise."""

  # --- data: synthetic reviews and the BPE tokenizer ---
  corpus_size: int = 4000
  """Synthetic reviews generated (`jax_ppo.quickstart.reviews.make_corpus`)."""
  eval_fraction: float = 0.1
  """Share of the corpus (and of the preference pairs) held out for evaluation."""
  vocab_size: int = 512
  """BPE vocabulary size (special tokens and the 256 byte symbols included)."""

  # --- model: a tiny Llama-style decoder, random init ---
  model_type: str = "llama"
  """"llama" or "qwen3" (q/k norms)."""
  hidden_size: int = 64
  intermediate_size: int = 192
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  max_length: int = 64
  """Longest prompt + response of SFT and reward-model rows (tokens)."""

  # --- SFT ---
  sft_steps: int = 500
  sft_batch_size: int = 32
  sft_learning_rate: float = 3e-3
  sft_eval_every: int = 100
  """Held-out loss every this many steps (0: only at the end)."""

  # --- preference pairs from SFT samples, labelled by the gold scorer plus noise ---
  pair_prompts: int = 768
  """Prompts sampled twice by the SFT policy; each gives one preference pair."""
  label_temperature: float = 0.15
  """Annotator noise: P(a preferred) = sigmoid((gold(a) - gold(b)) / label_temperature)."""
  hack_pair_fraction: float = 0.25
  """Extra pairs, as a fraction of pair_prompts: a sample against a degenerate rewrite of it
  (repeated word or sentence, adjective list, truncation), labelled the same way. Without them
  the reward model never sees such text and may score "great great great" highly."""

  # --- reward model (Bradley-Terry on the SFT trunk) ---
  rm_steps: int = 80
  rm_batch_size: int = 32
  rm_learning_rate: float = 1e-3
  rm_eval_every: int = 20

  # --- PPO ---
  ppo_updates: int = 60
  ppo_batch_size: int = 32
  ppo_minibatches: int = 2
  ppo_epochs: int = 2
  ppo_learning_rate: float = 1e-3
  kl_coef: float = 0.1
  """KL coefficient beta of the per-token penalty against the SFT model."""
  max_new_tokens: int = 32
  temperature: float = 0.8
  """Sampling temperature of the pair stage, PPO rollouts and evaluations."""
  missing_eos_penalty: float = -2.0
  """Normalised score of responses that hit max_new_tokens without EOS."""
  eval_every: int = 10
  """PPO updates between evaluations (and checkpoints)."""
  eval_samples: int = 64
  """Responses sampled and scored at each PPO evaluation (>= 64)."""

  def __post_init__(self):
    def bad(field: str, fix: str):
      raise ValueError(f"QuickstartConfig.{field}={getattr(self, field)!r} is invalid: {fix}.")

    for field in ("corpus_size", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "max_length", "sft_steps",
                  "sft_batch_size", "pair_prompts", "rm_steps", "rm_batch_size", "ppo_updates",
                  "ppo_batch_size", "ppo_minibatches", "ppo_epochs", "max_new_tokens",
                  "eval_every"):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        bad(field, "use an int >= 1")
    for field in ("sft_eval_every", "rm_eval_every"):
      value = getattr(self, field)
      if not isinstance(value, int) or value < 0:
        bad(field, "use an int >= 0")
    if self.model_type not in ("llama", "qwen3"):
      bad("model_type", "use 'llama' or 'qwen3'")
    if self.num_heads % self.num_kv_heads:
      bad("num_kv_heads", f"it must divide num_heads ({self.num_heads})")
    if self.head_dim % 2:
      bad("head_dim", "use an even number (rotary embeddings)")
    if not 0 < self.eval_fraction < 0.5:
      bad("eval_fraction", "use a value in (0, 0.5)")
    if self.corpus_size < 20:
      bad("corpus_size", "use at least 20 reviews")
    if self.pair_prompts < 10:
      bad("pair_prompts", "use at least 10 prompts (pairs are split into train and eval)")
    if self.eval_samples < 64:
      bad("eval_samples", "use at least 64 (each evaluation samples >= 64 responses)")
    if self.ppo_batch_size % self.ppo_minibatches:
      bad("ppo_batch_size", f"it must be divisible by ppo_minibatches ({self.ppo_minibatches})")
    for field in ("sft_learning_rate", "rm_learning_rate", "ppo_learning_rate", "temperature",
                  "label_temperature"):
      if not getattr(self, field) > 0:
        bad(field, "use a value > 0")
    if not 0 <= self.hack_pair_fraction <= 1:
      bad("hack_pair_fraction", "use a value in [0, 1]")
    if not self.kl_coef >= 0:
      bad("kl_coef", "use a value >= 0")
    if self.max_length < 16:
      bad("max_length", "use at least 16 tokens")


def smoke(**overrides) -> QuickstartConfig:
  """A configuration that runs every stage for a handful of steps (CI, tests)."""
  fields = dict(
      corpus_size=300, vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=1,
      num_heads=2, num_kv_heads=1, head_dim=16, sft_steps=6, sft_batch_size=8, sft_eval_every=3,
      pair_prompts=24, rm_steps=4, rm_batch_size=8, rm_eval_every=2, ppo_updates=2,
      ppo_batch_size=8, ppo_minibatches=1, ppo_epochs=1, max_new_tokens=12, eval_every=1,
      eval_samples=64,
  )
  fields.update(overrides)
  return QuickstartConfig(**fields)
