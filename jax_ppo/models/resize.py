r"""Growing a model's vocabulary: new token-embedding rows (and LM-head columns) for added tokens.

When a tokenizer gains tokens (a new pad token for GPT-2, say; see `jax_ppo.models.tokenizer`),
the embedding table must gain rows, or their ids gather NaN (`jnp.take` fills out-of-range rows
with NaN) and poison every activation. `resize_token_embeddings` appends

.. math::  E_{new} = \frac{1}{V} \sum_{v < V} E_v \quad\text{(every new row)},\qquad
           W_{new} = \frac{1}{V} \sum_{v < V} W_{:, v} \quad\text{(untied head, every new column)}

so a new token's logit is the mean of the old logits, :math:`h^\top \bar W`, and its probability
stays small and stable (Hewitt, "Initializing new word embeddings for pretrained language models",
2021). The old rows and columns, hence the logits of every old token, are unchanged; a tied head
stays tied (it is the embedding table itself). `config.vocab_size` becomes the new size, so
`save_pretrained` writes a folder that `from_pretrained` and transformers load.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
from flax import nnx

from jax_ppo.models.config import ModelConfig


def _append_mean(x: jnp.ndarray, extra: int, axis: int) -> jnp.ndarray:
  """`x` with `extra` slices equal to its mean along `axis` (mean in float32) appended."""
  mean = jnp.mean(x.astype(jnp.float32), axis=axis, keepdims=True).astype(x.dtype)
  shape = list(x.shape)
  shape[axis] = extra
  return jnp.concatenate([x, jnp.broadcast_to(mean, shape)], axis=axis)


def _resized_config(config: ModelConfig, vocab_size: int) -> ModelConfig:
  source = config.source_config
  if source:
    raw = json.loads(source)
    raw["vocab_size"] = vocab_size
    source = json.dumps(raw)
  return dataclasses.replace(config, vocab_size=vocab_size, source_config=source)


def resize_token_embeddings(model: nnx.Module, new_vocab_size: int) -> nnx.Module:
  """Grows `model`'s vocabulary to `new_vocab_size` tokens, in place; returns `model`.

  Args:
    model: a `CausalLM` or `ScalarModel` (anything with `decoder.embed` and `config`).
    new_vocab_size: `V' >= V`, e.g. `len(tokenizer)` after adding a pad token. Rows `[V, V')` of
      the embedding `[V', D]` (and columns of an untied LM head `[D, V']`) are the mean of the
      old ones; `V' == V` changes nothing.

  Returns:
    `model`, with `config.vocab_size == new_vocab_size` in every submodule.

  Raises:
    ValueError: `new_vocab_size` is not an int or smaller than the current vocabulary (shrinking
      would delete trained rows).
  """
  config: ModelConfig = model.config
  old = config.vocab_size
  if isinstance(new_vocab_size, bool) or not isinstance(new_vocab_size, int):
    raise ValueError(f"new_vocab_size must be an int, got {new_vocab_size!r}.")
  if new_vocab_size < old:
    raise ValueError(
        f"new_vocab_size={new_vocab_size} is smaller than the model's vocabulary ({old}); "
        "resize_token_embeddings only grows the embedding (shrinking would drop trained rows)."
    )
  if new_vocab_size == old:
    return model
  extra = new_vocab_size - old
  embed = model.decoder.embed
  embed.embedding = nnx.Param(_append_mean(embed.embedding[...], extra, axis=0))
  head = getattr(model, "lm_head", None)
  if head is not None:  # Untied head: kernel [D, V].
    head.kernel = nnx.Param(_append_mean(head.kernel[...], extra, axis=-1))
    head.out_features = new_vocab_size
  new_config = _resized_config(config, new_vocab_size)
  for _, module in nnx.iter_modules(model):
    if isinstance(getattr(module, "config", None), ModelConfig) and module.config == config:
      module.config = new_config
  return model


__all__ = ["resize_token_embeddings"]
