"""The pure pieces of pairwise reward-model training (`jax_ppo.reward_model.pairwise`): the
Bradley-Terry loss and accuracy against NumPy, the margin, scores read at the last valid token
with any padding, and the normalisation's gain and bias."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

from jax_ppo.models.config import ModelConfig
from jax_ppo.models.heads import ScalarModel
from jax_ppo.reward_model import bradley_terry_loss, normalisation_from_scores, preference_pairs
from jax_ppo.reward_model.pairwise import pair_scores

MODEL = ModelConfig(
    model_type="llama", vocab_size=24, hidden_size=16, intermediate_size=32, num_layers=1,
    num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=48,
)


def np_reference(rc, rr, margin, weight):
  d = np.asarray(rc, np.float64) - np.asarray(rr, np.float64) - np.asarray(margin, np.float64)
  w = np.asarray(weight, np.float64)
  loss = np.sum(w * np.logaddexp(0.0, -d)) / np.sum(w)  # -log sigmoid(d), stably
  accuracy = np.sum(w * (np.asarray(rc) > np.asarray(rr))) / np.sum(w)
  return loss, accuracy


_scores = st.lists(st.floats(-30, 30, width=32), min_size=1, max_size=8)


@given(_scores, _scores, _scores, st.lists(st.floats(0, 2, width=32), min_size=8, max_size=8))
def test_loss_and_accuracy_match_numpy(rc, rr, margin, weight):
  n = min(len(rc), len(rr), len(margin))
  rc, rr, margin = (np.asarray(x[:n], np.float32) for x in (rc, rr, margin))
  weight = np.asarray(weight[:n], np.float32)
  weight[0] = max(weight[0], 0.5)  # at least one pair counts
  loss, metrics = jax.jit(bradley_terry_loss)(rc, rr, margin=margin, weight=weight)
  ref_loss, ref_acc = np_reference(rc, rr, margin, weight)
  assert loss.dtype == jnp.float32 and np.isfinite(float(loss))
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(float(metrics["accuracy"]), ref_acc, atol=1e-6)
  np.testing.assert_allclose(float(metrics["margin"]), np.sum(weight * (rc - rr)) / weight.sum(),
                             rtol=1e-5, atol=1e-4)


def test_margin_shifts_the_loss_as_the_formula_says():
  rc = jnp.array([1.0, 0.5, -2.0, 3.0])
  rr = jnp.array([0.0, 1.0, -2.5, -1.0])
  margin = jnp.array([0.0, 0.5, 1.0, 2.0])
  with_margin, m1 = bradley_terry_loss(rc, rr, margin=margin)
  shifted, _ = bradley_terry_loss(rc - margin, rr)  # m enters exactly like a lower r_chosen
  np.testing.assert_allclose(float(with_margin), float(shifted), rtol=1e-6)
  np.testing.assert_allclose(float(with_margin), np_reference(rc, rr, margin, np.ones(4))[0],
                             rtol=1e-6)
  plain, m0 = bradley_terry_loss(rc, rr)
  assert float(with_margin) > float(plain)  # a margin asks for a wider separation
  assert float(m1["accuracy"]) == float(m0["accuracy"]) == 0.75  # not part of the accuracy
  # Per pair: d/dm of -log sigmoid(d - m) is sigmoid(m - d) (> 0, and 1/2 at m = d).
  grad = jax.grad(lambda m: bradley_terry_loss(rc[:1], rr[:1], margin=m)[0])(jnp.array([1.0]))
  np.testing.assert_allclose(float(grad[0]), 0.5, rtol=1e-6)


def pad_row(seq, length, side):
  ids = np.zeros(length, np.int32)
  mask = np.zeros(length, np.int32)
  sl = slice(0, len(seq)) if side == "right" else slice(length - len(seq), length)
  ids[sl], mask[sl] = seq, 1
  return ids, mask


def test_scores_are_read_at_the_last_valid_token_with_left_and_right_padding():
  model = ScalarModel(MODEL, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  rng = np.random.default_rng(0)
  seqs = [list(rng.integers(3, 24, size=n)) for n in (4, 6, 6, 4)]  # two shapes: two compiles
  chosen, rejected = seqs[:2], seqs[2:]

  @jax.jit
  def score(state, ids, mask):
    return nnx.merge(graphdef, state).score(ids, mask)

  # Reference: each sequence alone, unpadded; its score is the output at its own last token.
  ref = [float(score(state, np.array([s]), np.ones((1, len(s)), np.int32))[0]) for s in seqs]

  def pairs(side_c, side_r, junk=0):
    rows = [pad_row(s, 9, side) for s, side in zip(chosen + rejected,
                                                 (side_c, side_c, side_r, side_r), strict=True)]
    ids = np.stack([r[0] for r in rows])
    mask = np.stack([r[1] for r in rows])
    ids = np.where(mask == 1, ids, junk)  # whatever the pad slots hold
    return preference_pairs(ids[:2], mask[:2], ids[2:], mask[2:], margin=[0.3, -0.2])

  fn = jax.jit(lambda s, p: pair_scores(nnx.merge(graphdef, s), p))
  for sides, junk in (("right", "right"), 0), (("left", "left"), 0), (("left", "right"), 11):
    c, r = fn(state, pairs(*sides, junk=junk))
    np.testing.assert_allclose(np.concatenate([c, r]), ref, atol=2e-5, err_msg=str(sides))
    loss, metrics = bradley_terry_loss(c, r, margin=jnp.array([0.3, -0.2]))
    ref_loss, ref_acc = np_reference(ref[:2], ref[2:], [0.3, -0.2], [1, 1])
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    assert float(metrics["accuracy"]) == ref_acc


def test_normalisation_from_scores():
  s = np.array([2.0, 4.0, 9.0, -1.0])
  n = normalisation_from_scores(s)
  z = n["gain"] * s + n["bias"]
  np.testing.assert_allclose([z.mean(), z.std()], [0.0, 1.0], atol=1e-12)
  assert n["mean"] == 3.5 and n["samples"] == 4
  for bad, match in (([1.0], ">= 2"), ([1.0, np.nan], "NaN"), ([3.0, 3.0, 3.0], "std")):
    with pytest.raises(ValueError, match=match):
      normalisation_from_scores(np.array(bad))
