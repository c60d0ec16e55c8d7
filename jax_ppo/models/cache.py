"""The KV cache of batched, left-padded generation: `KVCache` and `init_cache`.

`CausalLM.prefill` fills it from a padded prompt batch and `CausalLM.decode_step` appends one
token per row; the sampler (`jax_ppo.rollout`) carries it through its `lax.while_loop`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_ppo.models.config import ModelConfig

Array = jax.Array


class KVCache(NamedTuple):
  """Preallocated key/value cache for batched left-padded generation (a pytree).

  Slots `[0, index)` are written; all rows share the write index, rows differ by their masks and
  positions. With `T = max_length`:

  Attributes:
    k: `[L, B, K, T, Dh]` keys after RoPE (and q/k norm); head-major, so that one head's keys
      are contiguous and decoding attends without transposing the cache.
    v: `[L, B, K, T, Dh]` values.
    mask: `[B, T]` bool, True on slots that hold a real (attendable) token.
    slot_positions: `[B, T]` int32 position id of the token in each slot (sliding windows).
    positions: `[B]` int32 position id the next valid token of each row gets (its number of
      valid tokens so far).
    index: `[]` int32 next slot to write (same for every row).
  """

  k: Array
  v: Array
  mask: Array
  slot_positions: Array
  positions: Array
  index: Array

  @property
  def max_length(self) -> int:
    return self.k.shape[3]


def init_cache(
    config: ModelConfig, *, batch_size: int, max_length: int, dtype=jnp.float32
) -> KVCache:
  """An empty `KVCache` for `batch_size` rows of at most `max_length` tokens (prompt + new)."""
  if batch_size <= 0 or max_length <= 0:
    raise ValueError(
        f"batch_size and max_length must be positive, got {batch_size} and {max_length}."
    )
  shape = (config.num_layers, batch_size, config.num_kv_heads, max_length, config.head_dim)
  return KVCache(
      k=jnp.zeros(shape, dtype),
      v=jnp.zeros(shape, dtype),
      mask=jnp.zeros((batch_size, max_length), bool),
      slot_positions=jnp.zeros((batch_size, max_length), jnp.int32),
      positions=jnp.zeros((batch_size,), jnp.int32),
      index=jnp.zeros((), jnp.int32),
  )
