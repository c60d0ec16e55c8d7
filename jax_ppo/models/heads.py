"""Scalar models on the decoder trunk: reward models and separate value models.

A scalar head (`jax_ppo.models.layers.ScalarHead`, also a policy's value head) maps every final
hidden state to one number, :math:`r_t = w^\\top h_t + b`. A reward model reads it at the last
valid token of each row (the EOS position, docs/rlhf_details.md item 6); a value model reads it at
every token. Initialisation follows "The N+ Implementation Details of RLHF with PPO" (Huang et al.
2024; docs/rlhf_details.md item 15): a reward head is `N(0, 1/sqrt(D + 1))` with a zero bias, a
value model starts as a copy of the reward model, and a value head sharing the policy's trunk
starts at zero.

Reward normalisation (docs/rlhf_details.md item 16) is folded into the head:
`ScalarModel.rescale_scores(gain, bias)` makes every output `gain * r + bias` by setting
`w <- gain * w` and `b <- gain * b + bias`, so the normalised scores need no extra state and reach
PPO through `score` unchanged. A Hugging Face head has no bias: `save_pretrained` writes the
scaled `w` as `score.weight` and `b` into `config.json` (`SCORE_BIAS_KEY`), which
`load_scalar_model` reads back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_ppo.core import last_valid_index
from jax_ppo.models.config import ModelConfig
from jax_ppo.models.layers import ScalarHead
from jax_ppo.models.transformer import DEFAULT_REMAT, Decoder

Array = jax.Array

class ScalarModel(nnx.Module):
  """A decoder trunk with a `ScalarHead`: a reward model or a separate value model.

  `model(ids, attention_mask=m)` returns per-token scalars `[B, S]` float32 (values);
  `model.score(ids, attention_mask=m)` returns `[B]`, the scalar at each row's last valid token
  (rewards). Hugging Face `*ForSequenceClassification` checkpoints with one label load into it
  (`load_scalar_model`), their `score.weight` becoming the head's kernel (and the
  `SCORE_BIAS_KEY` of their `config.json`, when present, its bias).
  """

  def __init__(
      self,
      config: ModelConfig,
      *,
      head_init: str = "reward",
      dtype=jnp.float32,
      param_dtype=jnp.float32,
      remat: str = DEFAULT_REMAT,
      scan_layers: bool = True,
      rngs: nnx.Rngs,
  ):
    self.config = config
    self.dtype = dtype
    self.decoder = Decoder(
        config, dtype=dtype, param_dtype=param_dtype, remat=remat, scan_layers=scan_layers,
        rngs=rngs,
    )
    self.score_head = ScalarHead(
        config.hidden_size, init=head_init, param_dtype=param_dtype, rngs=rngs
    )

  def hidden_states(self, input_ids: Array, attention_mask: Array | None = None, *,
                    positions: Array | None = None, use_lora: bool = True) -> Array:
    """Final hidden states `[B, S, D]` of the trunk."""
    return self.decoder(input_ids, attention_mask, positions=positions, use_lora=use_lora)

  def __call__(self, input_ids: Array, attention_mask: Array | None = None, *,
               positions: Array | None = None, use_lora: bool = True) -> Array:
    """Per-token scalars `[B, S]` float32 (a value model's `V_t`)."""
    h = self.hidden_states(input_ids, attention_mask, positions=positions, use_lora=use_lora)
    return self.score_head(h)

  def score(self, input_ids: Array, attention_mask: Array | None = None, *,
            use_lora: bool = True) -> Array:
    """Scores `[B]` float32 read at the last valid token of each row (a reward model's output).

    Args:
      input_ids: `[B, S]` ids of prompt + response, left- and/or right-padded.
      attention_mask: `[B, S]`, 1 on real tokens; the score is read at the last index where it
        is 1 (`jax_ppo.core.last_valid_index`); None means all ones (the last slot).
    """
    if attention_mask is None:
      attention_mask = jnp.ones(input_ids.shape, bool)
    per_token = self(input_ids, attention_mask, use_lora=use_lora)
    return read_last_valid(per_token, attention_mask)

  def rescale_scores(self, gain: float | Array, bias: float | Array) -> None:
    """In place: `score` (and the per-token outputs) become `gain * r + bias`.

    Reward normalisation (docs/rlhf_details.md item 16): with `gain = 1 / std` and
    `bias = -mean / std` of the scores of SFT-policy samples, those samples score with mean 0 and
    std 1 afterwards (`jax_ppo.reward_model.pairwise.normalisation_from_scores`). The pair is folded
    into the head (`ScalarHead.rescale`), so it is saved and loaded with the model.
    """
    self.score_head.rescale(gain, bias)


def read_last_valid(x: Array, attention_mask: Array) -> Array:
  """`x` `[B, S]` read at the last index where `attention_mask` `[B, S]` is 1 -> `[B]`.

  Rows without a valid token read slot 0 (their mask says they are empty).
  """
  last = jnp.maximum(last_valid_index(attention_mask), 0)
  return jnp.take_along_axis(x, last[:, None], axis=1)[:, 0]


def value_model_from_reward_model(reward_model: ScalarModel) -> ScalarModel:
  """A value model initialised as an independent copy of a reward model (N+ detail)."""
  graphdef, state = nnx.split(reward_model)
  return nnx.merge(graphdef, jax.tree.map(jnp.array, state))
