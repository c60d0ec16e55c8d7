"""`RunConfig.dtype="bfloat16"`: bfloat16 compute with float32 master weights and float32
log-softmax. One fused PPO update (two epochs) in bfloat16 is close to the same update in float32
(same initial weights, same rollout); weights, optimizer state and log-probs stay float32."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo.models.transformer import CausalLM
from jax_ppo.ppo import PPOTrainer
from jax_ppo.rewards import TokenScorer
from jax_ppo.runs.common import DTYPES
from tests.ppo.conftest import CONFIG, MODEL, count_target, prompts

#: bfloat16 keeps 8 significant bits (relative rounding 2^-9 ~ 0.002). Measured on this tiny
#: model (jax 0.10.2, CPU): per-token log-probs differ by at most 5e-3, the losses (means over
#: tokens, two epochs) by about 1e-4, the mean sequence KL by 1e-3. The bounds leave room for
#: other backends' rounding but fail on a real numerical error.
LOGPROB_ATOL = 3e-2
LOSS_ATOL = 2e-3
KL_ATOL = 5e-3
CONFIG_1 = dataclasses.replace(CONFIG, num_minibatches=1, ppo_epochs=2, entropy_coef=0.01)


def _trainer(dtype):
  """A trainer whose trained weights (value head included) are moved away from the reference,
  so that the KL, the values and the second epoch's ratios are not trivially equal."""
  policy = CausalLM(MODEL, dtype=DTYPES[dtype], param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  trainer = PPOTrainer(CONFIG_1, policy, reward=TokenScorer(count_target), prompts=prompts())
  leaves, tree = jax.tree.flatten(trainer.state.policy)
  keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
  moved = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
           for x, k in zip(leaves, keys, strict=True)]
  trainer.state = trainer.state.replace(policy=jax.tree.unflatten(tree, moved))
  return trainer


@pytest.mark.slow
def test_bfloat16_update_is_close_to_float32():
  f32, bf16 = _trainer("float32"), _trainer("bfloat16")
  for a, b in zip(jax.tree.leaves(f32.state.params), jax.tree.leaves(bf16.state.params),
                  strict=True):
    np.testing.assert_array_equal(a, b)  # same float32 master weights to start with
  prompt_ids, _ = f32.dataset.batch(0, CONFIG_1.prompts_per_update)
  rollout = f32.sampler(prompt_ids, jax.random.PRNGKey(0), state=f32.policy_state())
  scores = f32.scorer(rollout, None)
  out = {}
  for name, t in (("f32", f32), ("bf16", bf16)):
    state, batch, exp, metrics = t.steps.experience_update(t.state, t.frozen, rollout, scores)
    out[name] = (state, batch, exp, metrics)
    jaxpr = str(jax.make_jaxpr(t.steps.outputs)(state.params, t.frozen, batch))
    b, steps = batch.response_ids.shape
    assert f"f32[{b},{steps},{MODEL.vocab_size}]" in jaxpr  # the log-softmax runs in float32
    assert (f"bf16[{b},{steps},{MODEL.vocab_size}]" in jaxpr) == (name == "bf16")  # the logits
  (_, b0, e0, m0), (s1, b1, e1, m1) = out["f32"], out["bf16"]
  for leaf in jax.tree.leaves((s1.params, s1.opt_state)):
    assert leaf.dtype in (jnp.float32, jnp.int32), leaf.dtype  # master weights, Adam moments
  assert b1.old_logprobs.dtype == b1.ref_logprobs.dtype == jnp.float32
  mask = np.asarray(b0.response_mask)
  diff = np.abs(np.asarray(b1.old_logprobs) - np.asarray(b0.old_logprobs))[mask]
  assert diff.max() < LOGPROB_ATOL, diff.max()
  assert diff.max() > 0  # bfloat16 really ran
  for name in ("loss/policy_avg", "loss/value_avg", "loss/total_avg", "policy/entropy_avg"):
    assert abs(float(m1[name]) - float(m0[name])) < LOSS_ATOL, (name, m1[name], m0[name])
  assert abs(float(m0["loss/policy_avg"])) > 10 * LOSS_ATOL  # a loss that can tell them apart
  assert abs(float(e1["objective/kl"]) - float(e0["objective/kl"])) < KL_ATOL
