"""DAPO's dynamic sampling (Yu et al. 2025): train only on prompt groups whose scores differ.

Under a group advantage ("grpo", "rloo") a prompt whose `n_samples` responses all get the same
score has advantage 0 on every token: it adds no policy gradient and only dilutes the batch.
With `PPOConfig.dynamic_sampling` the trainer (`PPOTrainer.step`) draws prompt batches of
`prompts_per_update` prompts (batch positions `data_position, data_position + 1, ...`), samples
and scores each, and stops once `prompts_per_update` groups with differing scores are in hand,
or after `dynamic_sampling_max_draws` draws. This module holds the pure host-side parts:

* `draw_key`: the sampling key of each draw (draw 0 uses the update's own key, so an update whose
  first draw keeps every group is exactly the update without dynamic sampling);
* `varied_groups`: which groups of one draw have differing scores;
* `select_groups`: which groups of which draw make up the batch: the varied groups in draw
  order, and, when the cap on draws is hit first, the constant groups in draw order after them
  (zero-advantage groups: they leave the policy gradient unchanged, so the batch keeps its
  static shape without repeating, and so over-weighting, any varied group);
* `assemble_rollout`, `assemble_rows`, `assemble_texts`: the batch's rows taken from the draws,
  whose prompts may be left-padded to different lengths (`left_pad_rollout` pads them to the
  longest, itself a prompt bucket, so the compiled programs see no new shape);
* `sampling_metrics`: what each update logs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np

from jax_ppo.rollout.sampler import Rollout

Array = jax.Array

DRAW_STREAM = 0x44415043
"""`fold_in` data of the key stream of draws 1, 2, ... (`draw_key`), apart from the sampler's
micro-batch keys `fold_in(key, i)`."""

METRICS = ("dynamic_sampling/dropped_fraction", "train/num_gen_batches",
           "dynamic_sampling/filled_groups")
"""The metrics `sampling_metrics` returns (verl's name for the number of draws)."""


def draw_key(key: Array, draw: int) -> Array:
  """The sampling key of draw `draw` of an update whose key is `key`: `key` itself for draw 0,
  `fold_in(fold_in(key, DRAW_STREAM), draw)` for the extra draws."""
  if draw == 0:
    return key
  return jax.random.fold_in(jax.random.fold_in(key, DRAW_STREAM), draw)


def varied_groups(scores: np.ndarray, n_samples: int) -> np.ndarray:
  """`[P]` bool: True for the groups whose scores are not all equal.

  Args:
    scores: `[P * n_samples]` scores of one draw; rows `[i * n, (i + 1) * n)` are prompt `i`'s.
    n_samples: responses per prompt `n`.
  """
  scores = np.asarray(scores)
  if scores.ndim != 1 or scores.shape[0] % n_samples:
    raise ValueError(f"scores has shape {scores.shape}: expected [P * n_samples] with "
                     f"n_samples={n_samples}.")
  groups = scores.reshape(-1, n_samples)
  return np.any(groups != groups[:, :1], axis=1)


class Selection(NamedTuple):
  """The groups of an update's batch, in batch order.

  Attributes:
    draw: `[P]` int, the draw each group comes from.
    group: `[P]` int, its index among that draw's prompts.
    kept: how many of them have varied scores (they come first).
    filled: how many are constant groups filling the batch (the cap on draws was hit).
  """

  draw: np.ndarray
  group: np.ndarray
  kept: int
  filled: int


def select_groups(varied: Sequence[np.ndarray], num_groups: int) -> Selection:
  """The first `num_groups` varied groups over the draws, in draw order, then as many constant
  groups (in draw order) as the batch still lacks.

  Args:
    varied: `varied_groups` of each draw so far, `[P]` bool each.
    num_groups: the batch's groups `P` (`prompts_per_update`).

  Raises:
    ValueError: the draws hold fewer than `num_groups` groups in all.
  """
  index = [(d, g) for d, v in enumerate(varied) for g in range(len(v))]
  flags = np.concatenate([np.asarray(v, bool) for v in varied]) if varied else np.zeros(0, bool)
  if len(index) < num_groups:
    raise ValueError(f"{len(index)} groups drawn, fewer than the batch's {num_groups}.")
  order = [i for i in range(len(index)) if flags[i]][:num_groups]
  kept = len(order)
  order += [i for i in range(len(index)) if not flags[i]][:num_groups - kept]
  return Selection(draw=np.array([index[i][0] for i in order], np.int64),
                   group=np.array([index[i][1] for i in order], np.int64),
                   kept=kept, filled=num_groups - kept)


def left_pad_rollout(rollout: Rollout, length: int, *, pad_token_id: int) -> Rollout:
  """`rollout` (host arrays) with its prompts left-padded to `length` slots.

  The new slots hold `pad_token_id`, prompt mask 0 and position 0, exactly what the sampler
  writes into the left padding of a longer prompt bucket (items 1, 2), so the rows mean the
  same tokens at the same positions.
  """
  extra = length - rollout.prompt_ids.shape[1]
  if extra < 0:
    raise ValueError(f"Cannot pad prompts of {rollout.prompt_ids.shape[1]} slots to {length}.")
  if extra == 0:
    return rollout
  pad = ((0, 0), (extra, 0))
  return rollout.replace(
      prompt_ids=np.pad(rollout.prompt_ids, pad, constant_values=pad_token_id),
      prompt_mask=np.pad(rollout.prompt_mask, pad),
      positions=np.pad(rollout.positions, pad),
  )


def group_rows(selection: Selection, n_samples: int) -> tuple[np.ndarray, np.ndarray]:
  """`(draw [B], row [B])`: the draw and the row within it of each row of the batch
  (`B = P * n_samples`, each group's `n_samples` consecutive rows)."""
  offsets = np.arange(n_samples)
  draw = np.repeat(selection.draw, n_samples)
  row = (selection.group[:, None] * n_samples + offsets[None, :]).reshape(-1)
  return draw, row


def assemble_rows(arrays: Sequence[np.ndarray], selection: Selection,
                  n_samples: int) -> np.ndarray:
  """The batch's rows of per-row arrays of the draws (e.g. the `[B]` scores), `[B, ...]`."""
  draw, row = group_rows(selection, n_samples)
  return np.stack([np.asarray(arrays[d])[r] for d, r in zip(draw, row, strict=True)])


def assemble_rollout(rollouts: Sequence[Rollout], selection: Selection, *, n_samples: int,
                     pad_token_id: int) -> Rollout:
  """The batch's `Rollout` (host arrays): the selected groups' rows of the draws, their prompts
  left-padded to the longest prompt length among the draws used (`left_pad_rollout`).

  Args:
    rollouts: each draw's rollout (host or device arrays), `[P * n_samples, ...]` fields.
    selection: `select_groups`' choice.
    n_samples: responses per prompt.
    pad_token_id: the PAD id of the new prompt slots.
  """
  used = sorted(set(selection.draw.tolist()))
  host = {d: jax.tree.map(np.asarray, rollouts[d]) for d in used}
  length = max(r.prompt_ids.shape[1] for r in host.values())
  padded = [left_pad_rollout(host[d], length, pad_token_id=pad_token_id) if d in host else None
            for d in range(len(rollouts))]
  fields = {f.name: assemble_rows([None if r is None else getattr(r, f.name) for r in padded],
                                  selection, n_samples)
            for f in dataclasses.fields(Rollout)}
  return Rollout(**fields)


def assemble_texts(texts: Sequence[Sequence[str] | None], selection: Selection) -> list | None:
  """The batch's prompt texts (one per group) from each draw's, or None without texts."""
  if any(t is None for t in texts):
    return None
  return [texts[d][g] for d, g in zip(selection.draw, selection.group, strict=True)]


def sampling_metrics(varied: Sequence[np.ndarray], selection: Selection) -> dict[str, float]:
  """An update's dynamic-sampling metrics (`METRICS`).

  * `dynamic_sampling/dropped_fraction`: constant groups over the groups drawn, all draws;
  * `train/num_gen_batches`: the prompt batches drawn (verl's name);
  * `dynamic_sampling/filled_groups`: constant groups in the trained batch (non-zero only when
    the cap on draws was hit).
  """
  flags = np.concatenate([np.asarray(v, bool) for v in varied])
  return {
      "dynamic_sampling/dropped_fraction": float(np.mean(~flags)),
      "train/num_gen_batches": float(len(varied)),
      "dynamic_sampling/filled_groups": float(selection.filled),
  }


__all__ = [
    "DRAW_STREAM",
    "METRICS",
    "Selection",
    "assemble_rollout",
    "assemble_rows",
    "assemble_texts",
    "draw_key",
    "group_rows",
    "left_pad_rollout",
    "sampling_metrics",
    "select_groups",
    "varied_groups",
]
