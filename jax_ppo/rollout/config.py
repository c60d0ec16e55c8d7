"""Configuration of the compiled sampler.

`SamplingParams` is what a response is sampled with (length limit, temperature, filters, stop
and pad ids): the block a stage config nests (`PPOConfig.sampling`, PPO's defaults in
`jax_ppo.ppo.config.PPOSampling`). `SamplingConfig` adds what only the sampler decides (greedy
decoding, responses per prompt, shape buckets, prompt truncation, early stop).
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
from typing import ClassVar


def _is_token_id(x) -> bool:
  """An int (or NumPy integer), not a bool, >= 0."""
  if isinstance(x, bool):
    return False
  try:
    return operator.index(x) >= 0
  except TypeError:
    return False


def _is_number(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
  """How each response is sampled: its length limit, the temperature, top-k / top-p and the
  stop and pad ids.

  Training defaults follow docs/rlhf_details.md item 3: one temperature everywhere, `top_k=0`,
  `top_p=1.0`. Errors name the field as `<OWNER>.<field>` (`SamplingConfig.temperature`, or
  `PPOConfig.sampling.temperature` for the block of a stage config).
  """

  max_new_tokens: int = 48
  """Response length limit `T`; rows that reach it without a stop token are truncated."""
  temperature: float = 1.0
  """Logits are divided by this before sampling and before every log-prob computation."""
  top_k: int = 0
  """Keep only the k most likely tokens (0 disables)."""
  top_p: float = 1.0
  """Nucleus sampling mass in (0, 1] (1 disables)."""
  stop_token_ids: tuple[int, ...] = ()
  """Ids that end a response (EOS and any extra stop ids); the stop token stays in the mask.
  Empty means responses always run to `max_new_tokens`."""
  pad_token_id: int = 0
  """Id written after the stop token and used for left padding of prompts (must not be EOS).
  Pad slots are always identified by masks, never by this id, so the id may also occur in text
  (Llama 2's `<unk>`); it must be inside the model's vocabulary (`Sampler` checks)."""
  decode_tensor: int | None = None
  """On a device mesh, the sampler's tensor-parallel width `k`: the rollout runs on the mesh's
  devices regrouped as `(data=n/k, fsdp=1, tensor=k)` (`jax_ppo.parallel.decode_mesh`), each
  device holding `1/k` of every weight matrix (split on query and key/value heads, MLP width and
  vocabulary, cast to the compute dtype once per rollout) and the KV cache of its group's rows
  for its heads. None: the rollout runs on the training mesh, whose FSDP split makes every
  decode step gather every layer's weights on every device (the whole model read per device
  per token). `k` must divide the device count and the model's key/value heads; ignored
  without a mesh. Tokens and log-probs agree with the training mesh's to float rounding (the
  split matrix products are summed across devices)."""

  OWNER: ClassVar[str | None] = None
  """How errors name this block (None: the class name)."""
  TEMPERATURE_FIX: ClassVar[str] = "use a value > 0"

  def __post_init__(self):
    def bad(field, want):
      owner = self.OWNER or type(self).__name__
      raise ValueError(f"{owner}.{field}={getattr(self, field)!r} is invalid: {want}.")

    if (not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool)
        or self.max_new_tokens < 1):
      bad("max_new_tokens", "use an int >= 1")
    if not _is_number(self.temperature) or not self.temperature > 0:
      bad("temperature", self.TEMPERATURE_FIX)
    if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
      bad("top_k", "use an int >= 0 (0 disables top-k)")
    if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
      bad("top_p", "use a value in (0, 1] (1 disables top-p)")
    if not _is_token_id(self.pad_token_id):
      bad("pad_token_id", "use the tokenizer's pad id, an int >= 0 that is not a stop id (a "
                          "tokenizer without a pad token needs one set, e.g. by "
                          "jax_ppo.models.load_tokenizer)")
    if self.decode_tensor is not None and (
        not isinstance(self.decode_tensor, int) or isinstance(self.decode_tensor, bool)
        or self.decode_tensor < 1):
      bad("decode_tensor", "use an int >= 1 dividing the device count and the model's "
                           "key/value heads, or None (the training mesh)")
    if not isinstance(self.stop_token_ids, (tuple, list)) or not all(
        _is_token_id(i) for i in self.stop_token_ids
    ):
      bad("stop_token_ids", "use a tuple of token ids, ints >= 0")
    # Plain ints in a tuple (NumPy integers or a list are accepted): the config stays hashable.
    object.__setattr__(self, "pad_token_id", operator.index(self.pad_token_id))
    object.__setattr__(self, "stop_token_ids", tuple(map(operator.index, self.stop_token_ids)))
    if self.pad_token_id in self.stop_token_ids:
      bad("pad_token_id", "PAD must differ from every stop/EOS id, or the policy never learns to "
                          "stop (give the tokenizer a dedicated pad token; item 1)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig(SamplingParams):
  """How responses are sampled during a rollout: `SamplingParams` and the sampler's own options.

  Evaluation usually sets `greedy=True` or a low temperature (docs/rlhf_details.md item 20).
  """

  greedy: bool = False
  """Argmax decoding; the log-probs are still those of `softmax(logits / temperature)`."""
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
  decode_segments: int = 4
  """Length-bucketed decode: the `T - 1` decode steps are split into this many loops of about
  equal length, and the steps of loop `k` read only the KV-cache slots that can be live by its
  last step (`jax_ppo.rollout.sampler.segment_schedule`), instead of all `S + T - 1` slots at
  every step. The cache bytes read per step average about `S + T (K + 1) / (2K)` slots instead
  of `S + T` (K = 4 at S = T = 512: 832 against 1023, the live slots average 768). Tokens and
  log-probs are those of one loop (1) but for the float summation order; each loop compiles
  its own decode step (compile time grows with K)."""

  TEMPERATURE_FIX: ClassVar[str] = "use a value > 0 (greedy=True for argmax decoding)"

  def __post_init__(self):
    super().__post_init__()

    def bad(field, want):
      raise ValueError(f"SamplingConfig.{field}={getattr(self, field)!r} is invalid: {want}.")

    if not isinstance(self.n_samples, int) or self.n_samples < 1:
      bad("n_samples", "use an int >= 1")
    if (not isinstance(self.decode_segments, int) or isinstance(self.decode_segments, bool)
        or self.decode_segments < 1):
      bad("decode_segments", "use an int >= 1 (1: one decode loop over the whole cache)")
    for field in ("prompt_buckets", "batch_buckets"):
      buckets = getattr(self, field)
      if not buckets or any(not isinstance(b, int) or b < 1 for b in buckets):
        bad(field, "use a non-empty tuple of positive ints")
      if tuple(sorted(set(buckets))) != tuple(buckets):
        bad(field, "list the buckets in strictly increasing order")

  @classmethod
  def from_params(cls, params: SamplingParams, **options) -> SamplingConfig:
    """The sampler's config for a stage's `sampling` block, with the sampler's own `options`
    (`n_samples=4`, `batch_buckets=(8,)`) or a field of the block replaced (`temperature=1.0`)."""
    values = {f.name: getattr(params, f.name) for f in dataclasses.fields(SamplingParams)}
    return cls(**{**values, **options})
