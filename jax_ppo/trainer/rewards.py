"""Reward sources: a reward model, a Python function of text, or a jittable function of ids.

Every scorer is called as `scorer(rollout, reward_state) -> scores [B]` (float32) on the rollout's
truncated responses (PAD after the stop token, RLHF_DETAILS.md item 5); `reward_state` is the
reward model's frozen parameters (`FrozenParams.reward`) or None.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_ppo.rollout.sampler import Rollout

Array = jax.Array


def decode_rollout(tokenizer, rollout: Rollout) -> tuple[list[str], list[str]]:
  """Prompt and response texts of every row (padding dropped, special tokens kept)."""
  prompt_ids = np.asarray(rollout.prompt_ids)
  prompt_mask = np.asarray(rollout.prompt_mask).astype(bool)
  response_ids = np.asarray(rollout.response_ids)
  response_mask = np.asarray(rollout.response_mask).astype(bool)
  prompts = [tokenizer.decode(ids[m].tolist()) for ids, m in zip(prompt_ids, prompt_mask,
                                                                     strict=True)]
  responses = [tokenizer.decode(ids[m].tolist()) for ids, m in zip(response_ids, response_mask,
                                                                       strict=True)]
  return prompts, responses


def check_scores(scores, batch: int, *, source: str) -> np.ndarray:
  """Validates host-side scores: `[batch]` finite floats, else a ValueError saying what is wrong."""
  try:
    arr = np.asarray(scores, dtype=np.float32)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{source} must return numbers, one per response; got {scores!r}.") from e
  if arr.shape != (batch,):
    raise ValueError(
        f"{source} returned scores of shape {arr.shape} for {batch} responses; return one float "
        "per response, in order."
    )
  bad = np.flatnonzero(~np.isfinite(arr))
  if bad.size:
    raise ValueError(
        f"{source} returned non-finite scores at rows {bad[:10].tolist()} "
        f"(values {arr[bad[:10]].tolist()}); return finite floats (clip or replace NaN/inf)."
    )
  return arr


class FunctionScorer:
  """Scores from a Python function `fn(prompts, responses) -> sequence of floats`.

  With a tokenizer the function receives decoded texts; without one it receives lists of token
  ids (valid tokens only).
  """

  def __init__(self, fn: Callable[[list, list], Sequence[float]], *, tokenizer=None):
    self.fn = fn
    self.tokenizer = tokenizer

  def __call__(self, rollout: Rollout, reward_state=None) -> Array:
    del reward_state
    b = rollout.response_ids.shape[0]
    if self.tokenizer is not None:
      prompts, responses = decode_rollout(self.tokenizer, rollout)
    else:
      pm = np.asarray(rollout.prompt_mask).astype(bool)
      rm = np.asarray(rollout.response_mask).astype(bool)
      prompts = [r[m].tolist() for r, m in zip(np.asarray(rollout.prompt_ids), pm, strict=True)]
      responses = [r[m].tolist() for r, m in zip(np.asarray(rollout.response_ids), rm,
                                                  strict=True)]
    return jnp.asarray(check_scores(self.fn(prompts, responses), b, source="The reward function"))


class TokenScorer:
  """Scores from a jittable `fn(prompt_ids, prompt_mask, response_ids, response_mask) -> [B]`.

  Runs on device without leaving the compiled world, e.g. a count of target tokens.
  """

  def __init__(self, fn: Callable[[Array, Array, Array, Array], Array]):
    self.fn = fn
    self._jitted = jax.jit(fn)

  def __call__(self, rollout: Rollout, reward_state=None) -> Array:
    del reward_state
    scores = self._jitted(
        rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.response_mask
    )
    if scores.shape != rollout.response_ids.shape[:1]:
      raise ValueError(
          f"The token reward function returned shape {scores.shape}; expected "
          f"{rollout.response_ids.shape[:1]} (one score per response)."
      )
    return scores.astype(jnp.float32)


class RewardModelScorer:
  """Scores from a reward model (`jax_ppo.models.ScalarModel`) read at the last valid token.

  When the reward model has its own tokenizer that differs from the policy's (RLHF_DETAILS.md
  item 21), responses are decoded with the policy tokenizer and re-tokenized with the reward
  tokenizer (right-aligned to `max_length`); otherwise the policy's ids are scored directly.

  Args:
    reward_model: the reward model; it is split once, its state goes into `FrozenParams`.
    policy_tokenizer: needed when re-tokenizing.
    reward_tokenizer: the reward model's tokenizer, when it may differ from the policy's.
    max_length: re-tokenized sequences are truncated on the left to this many tokens.
  """

  def __init__(
      self,
      reward_model: nnx.Module,
      *,
      policy_tokenizer=None,
      reward_tokenizer=None,
      max_length: int = 1024,
  ):
    self.graphdef, self.state = nnx.split(reward_model)
    self.policy_tokenizer = policy_tokenizer
    self.reward_tokenizer = reward_tokenizer
    self.max_length = max_length
    self.retokenize = reward_tokenizer is not None and (
        policy_tokenizer is None or policy_tokenizer.get_vocab() != reward_tokenizer.get_vocab()
    )
    if self.retokenize and policy_tokenizer is None:
      raise ValueError(
          "RewardModelScorer needs `policy_tokenizer` to decode responses for a reward model "
          "with a different tokenizer."
      )
    graphdef = self.graphdef

    @jax.jit
    def score(state, ids, mask):
      return nnx.merge(graphdef, state).score(ids, mask)

    self._score = score

  def _retokenized(self, rollout: Rollout) -> tuple[np.ndarray, np.ndarray]:
    prompts, responses = decode_rollout(self.policy_tokenizer, rollout)
    tok = self.reward_tokenizer
    seqs = [tok(p + r, add_special_tokens=False)["input_ids"][-self.max_length :]
            for p, r in zip(prompts, responses, strict=True)]
    length = max(len(s) for s in seqs)
    length = 1 << max(length - 1, 0).bit_length()  # bucket to a power of two: bounded compiles
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = np.full((len(seqs), length), pad, np.int32)
    mask = np.zeros((len(seqs), length), np.int32)
    for i, s in enumerate(seqs):
      ids[i, length - len(s):] = s
      mask[i, length - len(s):] = 1
    return ids, mask

  def __call__(self, rollout: Rollout, reward_state=None) -> Array:
    state = self.state if reward_state is None else reward_state
    if self.retokenize:
      ids, mask = self._retokenized(rollout)
      return self._score(state, ids, mask)
    return self._score(state, rollout.sequence_ids, rollout.attention_mask)
