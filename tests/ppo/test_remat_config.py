"""`RunConfig.remat` reaches the policy and the critic of a `build_trainer` run (the CLI path),
shows up as `jax.checkpoint` with the chosen policy in the traced update, and leaves the
gradients unchanged; the default is "dots" (its memory: `tests/models/test_knobs.py`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("torch", reason="torch builds the tiny Hugging Face models")

from jax_ppo.models import DEFAULT_REMAT, REMAT_POLICIES, Decoder, set_remat  # noqa: E402
from jax_ppo.ppo import PPOConfig, PPOOptimizer, PPOSampling  # noqa: E402
from jax_ppo.ppo.batch import batch_view  # noqa: E402
from jax_ppo.ppo.loss import coefficients  # noqa: E402
from jax_ppo.rollout.sampler import Rollout  # noqa: E402
from jax_ppo.runs import ppo as run  # noqa: E402
from jax_ppo.runs import ppo_config as run_config
from jax_ppo.runs.common import PPORunFolder
from tests.tiny_hf_run import make_checkpoint, make_reward_checkpoint, write_data  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  root = tmp_path_factory.mktemp("remat")
  return {"policy": make_checkpoint(root), "reward": make_reward_checkpoint(root),
          "prompts": write_data(root)["prompts"], "root": root}


def _config(folders, **kwargs):
  ppo = PPOConfig(batch_size=4, num_minibatches=1, ppo_epochs=1,
                  sampling=PPOSampling(max_new_tokens=4), total_updates=2,
                  optimizer=PPOOptimizer(learning_rate=1e-3))
  return run_config.RunConfig(
      policy_path=folders["policy"], reward_model_path=folders["reward"],
      prompts_path=folders["prompts"], run_dir=str(folders["root"] / "run"),
      run=PPORunFolder(progress=False, tensorboard=False), ppo=ppo, **kwargs,
  )


def _batch(trainer):
  """A random `Batch` of the run's shapes (4 rows, 5 prompt and 4 response slots)."""
  b, s, t = 4, 5, 4
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  vocab = trainer.policy_model().config.vocab_size
  mask = jnp.ones((b, t), bool).at[0, 3].set(False)
  rollout = Rollout(
      prompt_ids=jax.random.randint(k[0], (b, s), 3, vocab),
      prompt_mask=jnp.ones((b, s), jnp.int32),
      response_ids=jax.random.randint(k[1], (b, t), 3, vocab), response_mask=mask,
      logprobs=jnp.full((b, t), -2.0), positions=jnp.tile(jnp.arange(s + t), (b, 1)),
      has_stop=jnp.ones((b,), bool),
  )
  view = batch_view(rollout)
  return view.replace(advantages=jax.random.normal(k[2], (b, t)),
                      returns=jnp.ones((b, t)), old_values=jnp.zeros((b, t)))


def _loss_grad_args(trainer):
  steps = trainer.steps
  coefs = coefficients(trainer.config, trainer.state)
  fn = jax.value_and_grad(steps.micro_loss, has_aux=True)
  return fn, (trainer.state.params, trainer.frozen, _batch(trainer), 1.0, coefs)


def _loss_grad(trainer):
  fn, args = _loss_grad_args(trainer)
  return str(jax.make_jaxpr(fn)(*args)), jax.jit(fn)(*args)


@pytest.mark.slow
def test_remat_reaches_policy_and_critic_with_equal_gradients(folders):
  base = run.build_trainer(_config(folders, remat="none"), open_run=False)
  remat = run.build_trainer(_config(folders, remat="dots_saveable"), open_run=False)
  assert remat.steps.value_graphdef is not None  # the critic copied from the reward model
  decoders = [m for _, m in nnx.iter_modules(remat.policy_model()) if isinstance(m, Decoder)]
  assert decoders and all(d.remat == "dots_saveable" for d in decoders)
  jaxpr_base, ((loss0, _), grads0) = _loss_grad(base)
  jaxpr_remat, ((loss1, _), grads1) = _loss_grad(remat)
  assert "remat" not in jaxpr_base
  # Policy and critic forward passes are both checkpointed with the configured policy.
  tag = f"policy={jax.checkpoint_policies.dots_saveable!r}"
  assert jaxpr_remat.count(tag) >= 2, (tag, jaxpr_remat[:2000])
  np.testing.assert_allclose(float(loss1), float(loss0), rtol=1e-6)
  for g1, g0 in zip(jax.tree.leaves(grads1), jax.tree.leaves(grads0), strict=True):
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g0), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_the_default_dots_reaches_policy_and_critic(folders):
  assert DEFAULT_REMAT == "dots" and run_config.RunConfig.remat == DEFAULT_REMAT
  default = run.build_trainer(_config(folders), open_run=False)
  critic = nnx.merge(default.steps.value_graphdef, default.state.params["value"],
                     default.frozen.value_rest)
  decoders = [m for model in (default.policy_model(), critic)
              for _, m in nnx.iter_modules(model) if isinstance(m, Decoder)]
  assert len(decoders) == 2 and all(d.remat == "dots" for d in decoders)
  jaxpr, _ = _loss_grad(default)
  tag = f"policy={jax.checkpoint_policies.dots_with_no_batch_dims_saveable!r}"
  assert jaxpr.count(tag) >= 2, (tag, jaxpr[:2000])


def test_remat_names(folders):
  with pytest.raises(ValueError, match=r"RunConfig.remat='sometimes' is invalid: choose one of"):
    _config(folders, remat="sometimes")
  assert {"none", "full", "dots", "dots_saveable", "nothing_saveable"} <= set(REMAT_POLICIES)
  with pytest.raises(ValueError, match="remat must be one of"):
    set_remat(None, "sometimes")
