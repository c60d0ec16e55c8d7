"""Configuration of the compiled sampler."""

from __future__ import annotations

import dataclasses
import operator


def _is_token_id(x) -> bool:
  """An int (or NumPy integer), not a bool, >= 0."""
  if isinstance(x, bool):
    return False
  try:
    return operator.index(x) >= 0
  except TypeError:
    return False


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
  """How responses are sampled during a rollout.

  Training defaults follow docs/rlhf_details.md item 3: one temperature everywhere, `top_k=0`,
  `top_p=1.0`. Evaluation usually sets `greedy=True` or a low temperature (item 20).
  """

  max_new_tokens: int = 48
  """Response length limit `T`; rows that reach it without a stop token are truncated."""
  temperature: float = 1.0
  """Logits are divided by this before sampling and before every log-prob computation."""
  top_k: int = 0
  """Keep only the k most likely tokens (0 disables)."""
  top_p: float = 1.0
  """Nucleus sampling mass in (0, 1] (1 disables)."""
  greedy: bool = False
  """Argmax decoding; the log-probs are still those of `softmax(logits / temperature)`."""
  stop_token_ids: tuple[int, ...] = ()
  """Ids that end a response (EOS and any extra stop ids); the stop token stays in the mask.
  Empty means responses always run to `max_new_tokens`."""
  pad_token_id: int = 0
  """Id written after the stop token and used for left padding of prompts (must not be EOS).
  Pad slots are always identified by masks, never by this id, so the id may also occur in text
  (Llama 2's `<unk>`); it must be inside the model's vocabulary (`Sampler` checks)."""
  n_samples: int = 1
  """Responses per prompt (`n` for GRPO/RLOO); they occupy consecutive rows."""
  prompt_buckets: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048)
  """Prompt lengths are left-padded up to the smallest bucket that fits, so a run compiles at
  most `len(prompt_buckets) * len(batch_buckets)` sampler programs."""
  batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
  """Batch sizes (prompts x n_samples) are padded up to the smallest bucket that fits."""
  truncate_prompts: bool = False
  """Left-truncate prompts that are too long for the context instead of raising."""
  early_stop: bool = True
  """Stop decoding once every row has produced a stop token."""

  def __post_init__(self):
    def bad(field, value, want):
      raise ValueError(f"SamplingConfig.{field}={value!r} is invalid: {want}.")

    if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
      bad("max_new_tokens", self.max_new_tokens, "use an int >= 1")
    if not self.temperature > 0:
      bad("temperature", self.temperature, "use a value > 0 (greedy=True for argmax decoding)")
    if not isinstance(self.top_k, int) or self.top_k < 0:
      bad("top_k", self.top_k, "use an int >= 0 (0 disables top-k)")
    if not 0.0 < self.top_p <= 1.0:
      bad("top_p", self.top_p, "use a value in (0, 1] (1 disables top-p)")
    if not isinstance(self.n_samples, int) or self.n_samples < 1:
      bad("n_samples", self.n_samples, "use an int >= 1")
    if not _is_token_id(self.pad_token_id):
      bad("pad_token_id", self.pad_token_id,
          "use a token id (an int >= 0) that is not a stop id; load_tokenizer chooses one")
    if not isinstance(self.stop_token_ids, (tuple, list)) or not all(
        _is_token_id(i) for i in self.stop_token_ids
    ):
      bad("stop_token_ids", self.stop_token_ids, "use a tuple of token ids (ints >= 0)")
    # Plain ints in a tuple (NumPy integers or a list are accepted): the config stays hashable.
    object.__setattr__(self, "pad_token_id", operator.index(self.pad_token_id))
    object.__setattr__(self, "stop_token_ids", tuple(map(operator.index, self.stop_token_ids)))
    if self.pad_token_id in self.stop_token_ids:
      bad(
          "pad_token_id",
          self.pad_token_id,
          "PAD must differ from every stop/EOS id, or the policy never learns to stop "
          "(give the tokenizer a dedicated pad token)",
      )
    for field in ("prompt_buckets", "batch_buckets"):
      buckets = getattr(self, field)
      if not buckets or any(not isinstance(b, int) or b < 1 for b in buckets):
        bad(field, buckets, "use a non-empty tuple of positive ints")
      if tuple(sorted(set(buckets))) != tuple(buckets):
        bad(field, buckets, "list the buckets in strictly increasing order")
