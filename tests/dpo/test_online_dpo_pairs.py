"""`jax_ppo.dpo.online_pairs`: the chosen sample is the highest scored of its prompt and the
rejected one the lowest, never the same sample, ties marked; pairs taken from a rollout score
the sampled tokens (their sequence log-probs are the sampler's own, and those of the same pair
laid out right-padded by `dpo_pairs`)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jax_ppo.dpo import dpo_pairs, rollout_pairs, select_pairs, sequence_logprobs
from jax_ppo.models import CausalLM
from jax_ppo.rollout.config import SamplingConfig
from jax_ppo.rollout.sampler import Sampler
from tests.preference_toys import EOS, MODEL

pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")


def test_the_chosen_sample_is_the_higher_scored_one():
  scores = np.array([[0.2, 0.9], [1.0, -1.0], [0.5, 0.5], [3.0, 3.0]])
  chosen, rejected, tie = select_pairs(scores)
  np.testing.assert_array_equal(chosen, [1, 0, 0, 0])
  np.testing.assert_array_equal(rejected, [0, 1, 1, 1])  # ties: two distinct samples
  np.testing.assert_array_equal(tie, [False, False, True, True])
  chosen, rejected, tie = select_pairs(np.array([[0.0, 2.0, -1.0, 2.0, -1.0]]))
  assert (chosen[0], rejected[0], tie[0]) == (1, 4, False)  # best first, worst last


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float64, hnp.array_shapes(min_dims=2, max_dims=2, min_side=2, max_side=6),
                  elements=st.integers(-3, 3).map(float)))
def test_chosen_is_a_best_and_rejected_a_worst_sample(scores):
  chosen, rejected, tie = select_pairs(scores)
  rows = np.arange(scores.shape[0])
  np.testing.assert_array_equal(scores[rows, chosen], scores.max(axis=1))
  np.testing.assert_array_equal(scores[rows, rejected], scores.min(axis=1))
  assert np.all(chosen != rejected)
  np.testing.assert_array_equal(tie, scores[rows, chosen] == scores[rows, rejected])


def test_bad_scores_are_refused():
  with pytest.raises(ValueError, match=r"must be \[P, n\] with P >= 1 and n >= 2, got shape "
                                       r"\(3, 1\)"):
    select_pairs(np.zeros((3, 1)))
  with pytest.raises(ValueError, match="must be"):
    select_pairs(np.zeros(4))
  with pytest.raises(ValueError, match="NaN or inf"):
    select_pairs(np.array([[0.0, np.nan]]))


def test_rollout_pairs_score_the_sampled_tokens():
  model = CausalLM(MODEL, rngs=nnx.Rngs(0))
  sampler = Sampler(model, SamplingConfig(max_new_tokens=6, n_samples=2, stop_token_ids=(EOS,),
                                          batch_buckets=(3,), prompt_buckets=(8,)))
  prompts = [[3, 4, 5], [6, 8], [9, 10, 11, 12]]
  rollout = sampler(prompts, jax.random.key(3))
  chosen, rejected = np.array([1, 2, 5]), np.array([0, 3, 4])
  pairs = rollout_pairs(rollout, chosen, rejected)
  s = rollout.prompt_ids.shape[1] + rollout.response_ids.shape[1]
  assert pairs.chosen_ids.shape == pairs.rejected_mask.shape == (3, s)
  lp = lambda ids, mask, resp: np.asarray(sequence_logprobs(model, ids, mask, resp))  # noqa: E731
  behaviour = np.sum(np.where(np.asarray(rollout.response_mask), np.asarray(rollout.logprobs),
                              0.0), axis=1)
  got_c = lp(pairs.chosen_ids, pairs.chosen_mask, pairs.chosen_response)
  got_r = lp(pairs.rejected_ids, pairs.rejected_mask, pairs.rejected_response)
  np.testing.assert_allclose(got_c, behaviour[chosen], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(got_r, behaviour[rejected], rtol=1e-4, atol=1e-4)
  # The same pairs, right padded from their token lists, have the same log-probs.
  resp_ids, resp_mask = np.asarray(rollout.response_ids), np.asarray(rollout.response_mask)
  side = lambda i: (prompts[i // 2], resp_ids[i][resp_mask[i]].tolist())  # noqa: E731
  right = dpo_pairs([side(i) for i in chosen], [side(i) for i in rejected], pad_token_id=0)
  np.testing.assert_allclose(
      lp(right.chosen_ids, right.chosen_mask, right.chosen_response), got_c, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
      lp(right.rejected_ids, right.rejected_mask, right.rejected_response), got_r, rtol=1e-5,
      atol=1e-5)
