"""Log-probs and entropies of response tokens under a causal LM's head, chunked when the
vocabulary is large: the one log-prob path of training, evaluation and the sampler.

`head_logprobs` scores tokens from final hidden states: below `LOGITS_CHUNK_BYTES` of float32
logits it projects the whole `[B, T, D]` hidden states to `[B, T, V]` logits at once (the fastest
path at small vocabularies); above it, `jax_ppo.core.chunked_logprobs` projects and reduces
`T`-chunk by `T`-chunk, so neither the forward nor the backward pass holds the whole logits
(at Qwen's 151,936-token vocabulary 8 x 1024 float32 logits take 5 GB, a chunk of 55 steps
256 MiB; the chunks are made even, `logits_chunk`). Same numbers either way
(tests/models/test_logprobs.py).

The teacher-forced pass over prompt + response that scores a rollout's responses (old,
reference, new and evaluation log-probs) is `jax_ppo.ppo.forward.response_logprobs`, which
calls `head_logprobs`; SFT's loss calls it too (`jax_ppo.sft.steps`).
"""

from __future__ import annotations

import jax

from jax_ppo import core
from jax_ppo.parallel.rules import rows_per_device

Array = jax.Array


LOGITS_CHUNK_BYTES = 256 * 2**20
"""Default limit on the float32 logits of one log-prob/entropy pass on one device (256 MiB):
e.g. 8 rows x 55 steps at a 151,936-token vocabulary. Every vocabulary up to ~65k at 8 x 128
response tokens stays unchunked."""


def logits_chunk(rows: int, steps: int, vocab: int, limit: int | None) -> int | None:
  """Steps per chunk for `rows x steps` tokens over `vocab` entries, or None (no chunking).

  None when `limit` is None or the whole float32 logits `rows * steps * vocab * 4` bytes fit in
  `limit`. Otherwise the fewest chunks whose logits fit, as even as they can be: with `m` the
  most steps that fit (at least 1), `n = ceil(steps / m)` chunks of `ceil(steps / n)` steps, so
  the padded last chunk computes fewer than `n` extra steps (512 steps at Qwen's vocabulary, 8
  rows: 10 chunks of 52, 520 steps computed; chunks of the most, 55, would compute 550).
  """
  row_bytes = rows * vocab * 4
  if limit is None or steps * row_bytes <= limit:
    return None
  most = max(1, min(steps, limit // row_bytes))
  chunks = -(-steps // most)
  return -(-steps // chunks)


def head_logprobs(
    model,
    hidden: Array,
    tokens: Array,
    temperature: float | Array,
    *,
    entropy: str | None = None,
    chunk_bytes: int | None = LOGITS_CHUNK_BYTES,
) -> tuple[Array, Array | None]:
  """Log-probs (and entropies) `[B, T]` float32 of `tokens` under `model`'s LM head.

  Args:
    model: a `CausalLM` (its `logits_from_hidden` and `config.vocab_size` are used).
    hidden: `[B, T, D]` final hidden states; position `t` scores `tokens[:, t]`.
    tokens: `[B, T]` int token ids.
    temperature: the sampling temperature (docs/rlhf_details.md item 3).
    entropy: "grad", "no_grad" (under `stop_gradient`) or None (not computed, returns None).
    chunk_bytes: float32 logits above this many bytes per device are computed in chunks over
      `T` (`logits_chunk` of the rows one device holds: all of them on one device, their share
      of the batch axes under `MeshJit`); None never chunks.

  Returns:
    `(logprobs, entropy)`, float32 `[B, T]` each (`entropy` None when not asked for).
  """
  if entropy not in ("grad", "no_grad", None):
    raise ValueError(f"`entropy` must be 'grad', 'no_grad' or None, got {entropy!r}.")
  b, t = tokens.shape
  # per device: on a mesh each device holds its share of the rows (and of their logits)
  chunk = logits_chunk(rows_per_device(b), t, model.config.vocab_size, chunk_bytes)
  if chunk is not None:
    return core.chunked_logprobs(
        hidden, model.logits_from_hidden, tokens, temperature, chunk_size=chunk, entropy=entropy
    )
  logits = model.logits_from_hidden(hidden)
  logprobs = core.gather_logprobs(logits, tokens, temperature)
  if entropy is None:
    return logprobs, None
  src = logits if entropy == "grad" else jax.lax.stop_gradient(logits)
  return logprobs, core.entropy_from_logits(src, temperature)
