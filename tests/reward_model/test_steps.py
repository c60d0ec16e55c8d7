"""The compiled reward-model steps (`jax_ppo.reward_model.steps`): gradient accumulation gives
the whole batch's step, the learning rate is logged under the kit's one name, and no program
holds full-vocabulary logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo.models.config import ModelConfig
from jax_ppo.models.heads import ScalarModel
from jax_ppo.reward_model import RewardModelOptimizer, RewardModelSteps, preference_pairs
from jax_ppo.training.optim import make_optimizer
from jax_ppo.training.state import LR_METRIC, init_stage_state

# V = 29 is no other dimension of the model or the batch (S = 11): an array with a dimension
# of 29 and rank >= 3 can only be logits.
MODEL = ModelConfig(
    model_type="llama", vocab_size=29, hidden_size=16, intermediate_size=32, num_layers=2,
    num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=48,
)
N, S = 8, 11


def _pairs(seed: int = 0, n: int = N):
  """`n` pairs of random lengths, right-padded to `S` (rows of several lengths in each
  microbatch), with random margins."""
  rng = np.random.default_rng(seed)

  def side():
    ids = rng.integers(3, MODEL.vocab_size, size=(n, S)).astype(np.int32)
    lengths = rng.integers(2, S + 1, size=n)
    mask = (np.arange(S)[None, :] < lengths[:, None]).astype(np.int32)
    return np.where(mask == 1, ids, 0), mask

  (ci, cm), (ri, rm) = side(), side()
  return preference_pairs(ci, cm, ri, rm, rng.normal(0, 0.5, size=n).astype(np.float32))


def _steps(accumulation: int, optimizer: RewardModelOptimizer, total_steps: int = 4):
  model = ScalarModel(MODEL, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx, schedule = make_optimizer(optimizer, total_steps)
  steps = RewardModelSteps(graphdef=graphdef, optimizer=tx, schedule=schedule,
                           accumulation_steps=accumulation)
  return steps, init_stage_state(tx, params), rest


def test_accumulation_gives_the_whole_batch_step():
  """Two steps with 1, 2 and 4 microbatches: the same loss, metrics, gradient norm and
  parameters within 1e-6. (`adam_eps=1` keeps Adam's first steps proportional to the gradient,
  so the parameters show any difference of the gradients instead of its sign.)"""
  optimizer = RewardModelOptimizer(learning_rate=0.1, lr_schedule="constant", adam_eps=1.0)
  batches = [_pairs(0), _pairs(1)]
  results = {}
  for k in (1, 2, 4):
    steps, state, rest = _steps(k, optimizer)
    history = []
    for pairs in batches:
      state, metrics = steps.train_step(state, rest, pairs)
      history.append({key: float(v) for key, v in metrics.items()})
    results[k] = (jax.tree.map(np.asarray, state.params), history)
  params1, history1 = results[1]
  moved = max(float(np.max(np.abs(a - b))) for a, b in zip(
      jax.tree.leaves(params1), jax.tree.leaves(_steps(1, optimizer)[1].params), strict=True))
  assert moved > 1e-2  # the steps really moved the parameters
  for k in (2, 4):
    params, history = results[k]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params1), strict=True):
      np.testing.assert_allclose(a, b, atol=1e-6, rtol=0, err_msg=f"accumulation {k}")
    for got, want in zip(history, history1, strict=True):
      assert got.keys() == want.keys()
      for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-6, rel=1e-6), (k, key)


def test_learning_rate_is_logged_under_the_kits_name():
  optimizer = RewardModelOptimizer(learning_rate=0.2, warmup_steps=2)
  steps, state, rest = _steps(1, optimizer, total_steps=4)
  lrs = []
  for seed in range(3):
    state, metrics = steps.train_step(state, rest, _pairs(seed))
    assert "train/learning_rate" not in metrics
    lrs.append(float(metrics[LR_METRIC]))
  np.testing.assert_allclose(lrs, [0.0, 0.1, 0.2], atol=1e-7)  # warm-up from 0, step 0 first


def _shapes(jaxpr) -> list[tuple[int, ...]]:
  """Shapes of every value computed in `jaxpr`, sub-programs (scan, cond, remat) included."""
  out = []
  for eqn in jaxpr.eqns:
    out.extend(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          out.extend(_shapes(inner))
  return out


@pytest.mark.parametrize("accumulation", [1, 2])
def test_no_program_computes_full_vocabulary_logits(accumulation):
  """The scores are the trunk's hidden states `[B, S, D]` through a scalar head: no value of
  the train, eval or score program is `[..., V]`-wide past the embedding table `[V, D]` (and its
  gradient)."""
  steps, state, rest = _steps(accumulation, RewardModelOptimizer())
  pairs = _pairs(0)
  weight = jnp.ones(N, jnp.float32)
  programs = {
      "train": jax.make_jaxpr(steps.train_impl)(state, rest, pairs),
      "eval": jax.make_jaxpr(steps.eval_impl)(state.params, rest, pairs, weight),
      "scores": jax.make_jaxpr(steps.scores_impl)(state.params, rest, pairs.chosen_ids,
                                                  pairs.chosen_mask),
  }
  for name, closed in programs.items():
    shapes = _shapes(closed.jaxpr)
    assert any(len(s) == 3 and s[-1] == MODEL.hidden_size for s in shapes), name  # [B, S, D]
    wide = [s for s in shapes if MODEL.vocab_size in s and len(s) >= 3]
    assert wide == [], (name, wide)
