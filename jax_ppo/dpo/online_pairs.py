"""Online DPO's preference pairs: the best and the worst scored of each prompt's sampled
responses, as `DPOPairs` rows in the sampler's layout.

`select_pairs` picks, for each prompt, the chosen (highest score) and the rejected (lowest
score) sample and marks the prompts whose samples all score the same (ties). `rollout_pairs`
takes those rows out of a `jax_ppo.rollout.sampler.Rollout` as `DPOPairs`: each row is the
left-padded prompt followed by the response (PAD after its stop token), its attention mask and
its response tokens marked, so the sequence log-probs of `jax_ppo.dpo.steps` read the very
tokens that were sampled (positions come from the mask, so left padding changes nothing).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_ppo.dpo.pairs import DPOPairs
from jax_ppo.rollout.sampler import Rollout


def select_pairs(scores_pn: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The chosen and rejected sample of each prompt, from the scores of its `n` samples.

  Args:
    scores_pn: `[P, n]` finite scores, `n >= 2`: row `p` holds the scores of prompt `p`'s
      samples (the rollout's rows `p * n` to `p * n + n - 1`).

  Returns:
    `(chosen [P], rejected [P], tie [P])`: `chosen` the index in `[0, n)` of the first highest
    score, `rejected` of the last lowest one (never the same sample: when every score ties,
    chosen is 0 and rejected `n - 1`, an arbitrary order), int64; `tie` True where every sample
    of the prompt scores the same (the pair carries no preference).

  Raises:
    ValueError: a shape other than `[P, n]` with `n >= 2`, or a non-finite score.
  """
  scores = np.asarray(scores_pn, np.float64)
  if scores.ndim != 2 or scores.shape[1] < 2 or scores.shape[0] < 1:
    raise ValueError(f"select_pairs: scores_pn must be [P, n] with P >= 1 and n >= 2, got shape "
                     f"{scores.shape}.")
  if not np.all(np.isfinite(scores)):
    raise ValueError("select_pairs: scores_pn holds NaN or inf; every sample needs a finite "
                     "score.")
  n = scores.shape[1]
  chosen = np.argmax(scores, axis=1)
  rejected = n - 1 - np.argmin(scores[:, ::-1], axis=1)
  tie = scores.max(axis=1) == scores.min(axis=1)
  return chosen, rejected, tie


def rollout_pairs(rollout: Rollout, chosen_rows: np.ndarray, rejected_rows: np.ndarray
                  ) -> DPOPairs:
  """`DPOPairs` `[P, S + T]` of the rollout's rows `chosen_rows [P]` and `rejected_rows [P]`.

  Args:
    rollout: `B` rows of prompt `[B, S]` (left padded) and response `[B, T]`.
    chosen_rows, rejected_rows: `[P]` int row indices into the rollout (e.g.
      `p * n + select_pairs(...)[0]`).

  Returns:
    `DPOPairs` whose ids are the prompt + response ids, mask the attention mask and response the
    response's valid tokens (through the stop token), int32, on the rollout's devices.
  """
  ids = rollout.sequence_ids
  mask = rollout.attention_mask.astype(jnp.int32)
  response = jnp.concatenate([jnp.zeros_like(rollout.prompt_mask, jnp.int32),
                              rollout.response_mask.astype(jnp.int32)], axis=1)
  take = lambda x, rows: jnp.take(x, jnp.asarray(rows, jnp.int32), axis=0)  # noqa: E731
  out = {}
  for side, rows in (("chosen", chosen_rows), ("rejected", rejected_rows)):
    out.update({f"{side}_ids": take(ids, rows).astype(jnp.int32),
                f"{side}_mask": take(mask, rows), f"{side}_response": take(response, rows)})
  return DPOPairs(**out)


__all__ = ["rollout_pairs", "select_pairs"]
