r"""The pure pieces of pairwise reward-model training: preference pairs, the Bradley-Terry loss,
the pairs' scores and the reward normalisation's gain and bias.

.. math::
   \mathcal{L} = -\frac{1}{N} \sum_i \log \sigma\bigl(r_c^{(i)} - r_r^{(i)} - m_i\bigr)

in float32, the scores read at the last valid token of prompt + response
(`jax_ppo.models.ScalarModel.score`: the trunk's hidden states and a scalar head, never
full-vocabulary logits). `jax_ppo.reward_model.steps` compiles the steps on them and
`jax_ppo.reward_model.trainer` drives them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jax_ppo.models.heads import ScalarModel

Array = jax.Array


class PreferencePairs(struct.PyTreeNode):
  """`N` tokenized preference pairs; chosen and rejected rows share the length `S`.

  Attributes:
    chosen_ids, rejected_ids: `[N, S]` int32 ids of prompt + response (left and/or right
      padding allowed).
    chosen_mask, rejected_mask: `[N, S]` int32, 1 on real tokens; each row needs one.
    margin: `[N]` float32 per-pair margin (0 for none).
  """

  chosen_ids: Array
  chosen_mask: Array
  rejected_ids: Array
  rejected_mask: Array
  margin: Array

  @property
  def num_pairs(self) -> int:
    return int(self.chosen_ids.shape[0])

  def take(self, index: np.ndarray) -> PreferencePairs:
    """The pairs at `index` (host arrays)."""
    return jax.tree.map(lambda x: np.asarray(x)[index], self)


def preference_pairs(
    chosen_ids, chosen_mask, rejected_ids, rejected_mask, margin=None, *, name: str = "pairs"
) -> PreferencePairs:
  """Validated `PreferencePairs` from arrays (host numpy; see its attributes for shapes).

  Raises:
    ValueError: naming the array and the fix, or the first row without a valid token.
  """
  arrays = {"chosen_ids": chosen_ids, "chosen_mask": chosen_mask, "rejected_ids": rejected_ids,
            "rejected_mask": rejected_mask}
  arrays = {k: np.asarray(v) for k, v in arrays.items()}
  shape = arrays["chosen_ids"].shape
  if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
    raise ValueError(f"{name}.chosen_ids must be [N, S] with N, S >= 1, got shape {shape}.")
  for k, v in arrays.items():
    if v.shape != shape:
      raise ValueError(f"{name}.{k} has shape {v.shape}; every array must be {shape} (pad "
                       "chosen and rejected rows to the same length).")
    if not (np.issubdtype(v.dtype, np.integer) or v.dtype == bool):
      raise ValueError(f"{name}.{k} must hold integers, got dtype {v.dtype}.")
  for side in ("chosen", "rejected"):
    empty = np.flatnonzero(~np.any(arrays[f"{side}_mask"] != 0, axis=1))
    if empty.size:
      raise ValueError(f"{name}: {side} row {int(empty[0])} has no valid token (its mask is all "
                       "0); drop the pair or fix its mask.")
  margin = np.zeros(shape[0], np.float32) if margin is None else np.asarray(margin, np.float32)
  if margin.shape != (shape[0],) or not np.all(np.isfinite(margin)):
    raise ValueError(f"{name}.margin must be {shape[0]} finite numbers, got shape "
                     f"{margin.shape}.")
  return PreferencePairs(
      chosen_ids=arrays["chosen_ids"].astype(np.int32),
      chosen_mask=(arrays["chosen_mask"] != 0).astype(np.int32),
      rejected_ids=arrays["rejected_ids"].astype(np.int32),
      rejected_mask=(arrays["rejected_mask"] != 0).astype(np.int32), margin=margin,
  )


def bradley_terry_loss(
    chosen_scores: Array, rejected_scores: Array, *, margin: Array | None = None,
    weight: Array | None = None, total: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
  r"""Mean of :math:`-\log\sigma(r_c - r_r - m)` over the pairs, in float32.

  With `total`, the means become shares of a larger batch's means:
  :math:`\sum_i w_i x_i / \text{total}`. A step split into microbatches passes each microbatch
  its own weights and the whole step's weight sum as `total`; the microbatches' losses, metrics
  and gradients then add up to the whole batch's (each microbatch weighted by its number of real
  pairs).

  Args:
    chosen_scores, rejected_scores: `[B]` scores of the chosen and rejected sequences.
    margin: `[B]` per-pair margin `m` (None: 0).
    weight: `[B]` pair weights (e.g. 0 on padding rows; None: all 1); the loss and metrics are
      weighted means.
    total: float32 scalar the weighted sums are divided by (None: the sum of `weight`, floored at
      1e-8).

  Returns:
    `(loss, metrics)`: metrics `accuracy` (share with :math:`r_c > r_r`), `margin` (mean
    :math:`r_c - r_r`), `chosen`, `rejected` (mean scores), `pairs` (weight sum of these `B`
    pairs).
  """
  if chosen_scores.ndim != 1 or chosen_scores.shape != rejected_scores.shape:
    raise ValueError(f"chosen_scores and rejected_scores must both be [B], got "
                     f"{chosen_scores.shape} and {rejected_scores.shape}.")
  rc, rr = chosen_scores.astype(jnp.float32), rejected_scores.astype(jnp.float32)
  m = jnp.zeros_like(rc) if margin is None else jnp.asarray(margin, jnp.float32)
  w = jnp.ones_like(rc) if weight is None else jnp.asarray(weight, jnp.float32)
  total = jnp.maximum(jnp.sum(w), 1e-8) if total is None else total
  mean = lambda x: jnp.sum(w * x) / total  # noqa: E731
  loss = mean(-jax.nn.log_sigmoid(rc - rr - m))
  metrics = {"accuracy": mean((rc > rr).astype(jnp.float32)), "margin": mean(rc - rr),
             "chosen": mean(rc), "rejected": mean(rr), "pairs": jnp.sum(w)}
  return loss, metrics


def pair_scores(model: ScalarModel, pairs: PreferencePairs) -> tuple[Array, Array]:
  """`(chosen [B], rejected [B])` scores, from one forward pass over the `2B` rows."""
  ids = jnp.concatenate([pairs.chosen_ids, pairs.rejected_ids])
  mask = jnp.concatenate([pairs.chosen_mask, pairs.rejected_mask])
  scores = model.score(ids, mask)
  b = pairs.chosen_ids.shape[0]
  return scores[:b], scores[b:]


def normalisation_from_scores(scores) -> dict[str, float]:
  """`{gain, bias, mean, std, samples}` so that `gain * s + bias` has mean 0 and std 1 on `scores`.

  `gain = 1 / std`, `bias = -mean / std`, with the population std (ddof 0), computed in float64.

  Raises:
    ValueError: fewer than 2 scores, a non-finite score, or a std of (almost) 0 (the reward
      model gives every sample the same score: nothing to normalise).
  """
  s = np.asarray(jax.device_get(scores), np.float64).reshape(-1)
  if s.size < 2:
    raise ValueError(f"Reward normalisation needs >= 2 sample scores, got {s.size}.")
  if not np.all(np.isfinite(s)):
    raise ValueError(f"{int(np.sum(~np.isfinite(s)))} of the {s.size} sample scores are NaN or "
                     "infinite; check the reward model and the samples.")
  mean, std = float(s.mean()), float(s.std())
  if not std > 1e-6 * max(1.0, abs(mean)):
    raise ValueError(f"The {s.size} sample scores have std {std:.3g} (mean {mean:.4g}): the "
                     "reward model does not tell these samples apart; train it further or "
                     "sample more diverse responses.")
  return {"gain": 1.0 / std, "bias": -mean / std, "mean": mean, "std": std,
          "samples": int(s.size)}


__all__ = [
    "PreferencePairs",
    "bradley_terry_loss",
    "normalisation_from_scores",
    "pair_scores",
    "preference_pairs",
]
