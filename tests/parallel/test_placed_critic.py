"""The critic on a sub-mesh of its own (`PlacementConfig.critic`, `jax_ppo.ppo.placed_critic`).

On 8 fake CPU devices (subprocesses through `multidevice.run_on_devices`; the pytest process
has one device): policy on devices 0-3, critic on 4-5, reference and reward model on 6-7 give
the same update as every role on the policy's devices (gradient clipping off, or on with both
norms under it), with the same minibatches and early stop; each array lives where the
docstrings say; the split state checkpoints and restores (into a shared run's layout too); and
`jax-ppo train` with such a placement in its config file trains, resumes and evaluates (the
reference's evaluation log-probs on its own mesh). Bad configurations raise one clear error.
"""

import jax
import numpy as np
import pytest
from flax import nnx
from multidevice import run_on_devices

from jax_ppo.models.config import ModelConfig
from jax_ppo.models.heads import ScalarModel
from jax_ppo.parallel import MeshConfig, make_mesh
from jax_ppo.parallel.placement import Placement, PlacementConfig, RoleMesh
from jax_ppo.ppo import PPOConfig, PPOOptimizer, PPOSampling
from jax_ppo.ppo.placed_critic import CriticBatch, CriticPrograms, join, split_state
from jax_ppo.ppo.placed_steps import PlacedSteps, place_frozen
from jax_ppo.ppo.state import FrozenParams, init_train_state
from jax_ppo.ppo.steps import PPOSteps
from jax_ppo.runs.ppo_config import RunConfig, load_run_config
from jax_ppo.training.optim import make_optimizer

TOL = 1e-5
POLICY, CRITIC, FROZEN = [0, 1, 2, 3], [4, 5], [6, 7]
LAYOUT = {"policy": POLICY, "policy_moments": POLICY, "value": CRITIC, "value_moments": CRITIC,
          "counters": POLICY}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  return run_on_devices("placed_critic.py", "gae,fused", str(tmp_path_factory.mktemp("ckpt")))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["gae", "fused"])
def test_split_critic_gives_the_shared_update(results, mode):
  r = results[mode]
  assert r["split_is_placed"] and r["split_has_critic"]
  assert r["max_values_diff"] < TOL and r["values_size"] > 1e-2 and r["max_batch_diff"] < TOL
  assert r["max_policy_diff"] < TOL and r["max_value_diff"] < TOL and r["max_opt_diff"] < TOL
  for name, (shared, split) in r["metrics"].items():
    assert abs(shared - split) < TOL, name
  assert r["value_moved"] > 1e-3  # the critic did train
  assert r["steps"][0] == r["steps"][1] > 0
  policy_norm, critic_norm = r["grad_norms"]
  assert policy_norm > 0 and critic_norm > 0
  if mode == "fused":
    # The policy's approximate KL stopped the epochs after the second of three; the critic
    # ran the same two (else its parameters would differ), with clipping on (1e4) under the
    # norms.
    assert r["metrics"]["policy/early_stopped"] == [1.0, 1.0]
    assert r["metrics"]["policy/epochs_run"] == [2.0, 2.0]
    assert r["steps"] == [2, 2]
  else:
    assert r["replay_param_diff"] < TOL
    assert abs(r["replay_loss"][0] - r["replay_loss"][1]) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["gae", "fused"])
def test_critic_arrays_live_on_its_devices(results, mode):
  r = results[mode]
  assert r["initial_layout"] == LAYOUT and r["layout"] == LAYOUT
  assert r["ref_devices"] == FROZEN and r["reward_devices"] == FROZEN
  # The values program runs on the critic's devices; its values come back to the policy's.
  assert r["values_program_devices"] == CRITIC
  assert r["values_transferred_devices"] == POLICY and r["batch_devices"] == POLICY
  if mode == "gae":
    assert r["replay_layout"] == LAYOUT


@pytest.mark.slow
def test_split_critic_checkpoint_restores(results):
  r = results["gae"]
  assert r["restored_diff"] == 0.0 and r["restored_same_shardings"]
  assert r["restored_layout"] == LAYOUT
  # The same tree as a shared run's state: it restores onto the policy's devices alone too.
  assert r["into_shared_diff"] == 0.0 and r["into_shared_devices"] == POLICY


@pytest.mark.slow
def test_train_with_a_split_critic_from_a_config_file(tmp_path):
  r = run_on_devices("placed_critic_run.py", str(tmp_path))
  assert r["steps"] == [1, 2] and r["finite"] and r["critic_metrics"]
  assert r["placement_critic"] == {"devices": [4, 6], "mesh": {"data": 1, "fsdp": 2, "tensor": 1}}
  assert r["restored_step"] == 2 and r["shared_restored_step"] == 2
  assert r["policy_devices"] == POLICY and r["value_devices"] == CRITIC
  assert r["ref_devices"] == FROZEN
  # Evaluation: the reference's log-probs by its own program on its devices, the policy's on
  # the policy's; the same metrics as with every role on the policy's devices.
  assert r["eval_placed"]
  assert r["eval_programs"] == {"reference": 1, "policy": 1, "shared": 0}
  for name, value in r["shared_eval"].items():
    assert abs(value - r["split_eval"][name]) < TOL, name


# -- configuration errors (one device) ----------------------------------------------------------

CRITIC_MESH = RoleMesh(devices=(4, 6))


def run_config(**kw) -> RunConfig:
  base = dict(policy_path="p", prompts_path="x.txt", run_dir="r", reward_model_path="rm",
              mesh=MeshConfig(), placement=PlacementConfig(critic=CRITIC_MESH))
  return RunConfig(**{**base, **kw})


def test_critic_placement_from_the_command_line():
  config = load_run_config(["policy_path=p", "prompts_path=x.txt", "run_dir=r",
                            "reward_model_path=rm", "mesh.data=-1",
                            "placement.critic.devices=[4, 6]",
                            "placement.critic.mesh.fsdp=2", "placement.critic.mesh.data=1"])
  assert config.placement.critic == RoleMesh(devices=(4, 6), mesh=MeshConfig(data=1, fsdp=2))
  assert config.placement.split_roles == ("critic",)
  assert run_config(reward_model_path=None, reward_function="length",
                    value_model_path="v").placement.critic == CRITIC_MESH


@pytest.mark.parametrize("kw, why", [
    (dict(ppo=PPOConfig(batch_size=8, sampling=PPOSampling(max_new_tokens=4),
                              advantage_mode="grpo", n_samples=2)),
     "ppo.advantage_mode='grpo' has no critic"),
    (dict(reward_model_path=None, reward_function="length"),
     "without value_model_path or a reward model to start it from, the critic is a value head"),
])
def test_a_split_critic_needs_a_critic_model(kw, why):
  with pytest.raises(ValueError, match=rf"RunConfig.placement.critic gives the critic its own "
                                       rf"devices, but the run has no separate critic model "
                                       rf"\({why}.*remove placement.critic"):
    run_config(**kw)


def test_critic_slice_validation():
  with pytest.raises(ValueError, match=r"placement.reward.devices=\[4, 8\] and "
                                       r"placement.critic.devices=\[4, 6\] overlap"):
    PlacementConfig(reward=RoleMesh(devices=(4, 8)), critic=CRITIC_MESH)
  with pytest.raises(ValueError, match=r"placement.critic.devices=\[4, 6\] overlap "
                                       r"placement.policy_devices=\[0, 5\]"):
    PlacementConfig(policy_devices=(0, 5), critic=CRITIC_MESH)
  with pytest.raises(ValueError, match=r"placement.critic=.* is invalid"):
    PlacementConfig(critic={"devices": [4, 6]})
  # The critic may share the frozen roles' sub-mesh.
  both = RoleMesh(devices=(4, 8))
  assert PlacementConfig(reward=both, critic=both).split_roles == ("reward", "critic")


def _two_meshes() -> Placement:
  """A placement whose critic has a mesh of its own: on one device, a stand-in object (JAX
  interns meshes; the errors are raised before any program uses it)."""
  policy = make_mesh(MeshConfig(), devices=jax.devices())
  return Placement(policy, policy, policy, critic=object())


def test_a_value_head_cannot_be_split():
  placement = _two_meshes()
  assert placement.is_split("critic") and not placement.is_split("reward")
  frozen = FrozenParams(policy_rest={}, ref={}, value_rest=None, reward=None)
  with pytest.raises(ValueError, match="placement.critic gives the critic its own devices, but "
                                       "this run has no separate critic model"):
    place_frozen(frozen, placement)
  config = PPOConfig(batch_size=8, sampling=PPOSampling(max_new_tokens=4))
  optimizer, schedule = make_optimizer(config.optimizer, config.total_optimizer_steps)
  apart = PPOSteps(config, policy_graphdef=None, value_graphdef=None, shared_value_head=True,
                   lora=False, optimizer=optimizer, schedule=schedule, critic_apart=True)
  with pytest.raises(ValueError, match="needs a separate critic model .*not a value head"):
    CriticPrograms(apart, placement.policy)
  steps = PPOSteps(config, policy_graphdef=None, value_graphdef=None, shared_value_head=True,
                   lora=False, optimizer=optimizer, schedule=schedule, mesh=placement.policy)
  with pytest.raises(ValueError, match=r"critic_apart=True\) exactly when placement.critic"):
    PlacedSteps(steps, placement)


def test_split_state_round_trip():
  """`split_state` / `join` give back the same tree, each half of the optimizer state being
  the optimizer state of its model alone."""
  model = ModelConfig(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=16,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
                      max_position_embeddings=16)
  config = PPOConfig(batch_size=8, sampling=PPOSampling(max_new_tokens=4))
  optimizer, _ = make_optimizer(config.optimizer, config.total_optimizer_steps)
  policy = {"w": jax.numpy.ones((3,))}
  value = nnx.split(ScalarModel(model, rngs=nnx.Rngs(0)), nnx.Param, ...)[1]
  state = init_train_state(config, optimizer, policy=policy, value=value,
                           rng=jax.random.PRNGKey(0))
  policy_state, value_opt, layout = split_state(state)
  assert policy_state.value is None
  assert (jax.tree.structure(policy_state.opt_state)
          == jax.tree.structure(optimizer.init({"policy": policy, "value": None})))
  assert jax.tree.structure(value_opt) == jax.tree.structure(optimizer.init(value))
  back = join(policy_state, state.value, value_opt, layout)
  assert jax.tree.structure(back) == jax.tree.structure(state)
  assert all(a is b for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True))


# -- the critic's update program (one device) ----------------------------------------------------

def _critic_programs(critic_learning_rate=None, **ppo):
  """`CriticPrograms` of a tiny critic on a one-device mesh, its state and a batch of 8 rows
  (4 prompt and 4 response slots)."""
  model = ModelConfig(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=16,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
                      max_position_embeddings=16)
  config = PPOConfig(batch_size=8, sampling=PPOSampling(max_new_tokens=4), num_minibatches=2,
                     ppo_epochs=2,
                     optimizer=PPOOptimizer(learning_rate=1e-2,
                                            critic_learning_rate=critic_learning_rate), **ppo)
  optimizer, schedule = make_optimizer(config.optimizer, config.total_optimizer_steps)
  graphdef, value, rest = nnx.split(ScalarModel(model, rngs=nnx.Rngs(0)), nnx.Param, ...)
  steps = PPOSteps(config, policy_graphdef=None, value_graphdef=graphdef,
                   shared_value_head=False, lora=False, optimizer=optimizer, schedule=schedule,
                   critic_apart=True)
  programs = CriticPrograms(steps, make_mesh(MeshConfig(), devices=jax.devices()))
  rows = jax.random.split(jax.random.PRNGKey(1), 3)
  batch = CriticBatch(
      input_ids=jax.random.randint(rows[0], (8, 8), 3, 16),
      attention_mask=jax.numpy.ones((8, 8), jax.numpy.int32),
      positions=jax.numpy.broadcast_to(jax.numpy.arange(8), (8, 8)),
      response_ids=jax.numpy.zeros((8, 4), jax.numpy.int32),
      response_mask=jax.numpy.ones((8, 4), bool).at[:, 3].set(False),
      old_values=jax.random.normal(rows[1], (8, 4)),
      returns=jax.random.normal(rows[2], (8, 4)))
  return programs, value, rest, optimizer.init(value), batch


def _plan(ran, stepped=None):
  ran = jax.numpy.asarray(ran)
  order = jax.numpy.arange(8, dtype=jax.numpy.int32)[::-1].reshape(1, 2, 4)
  return {"order": jax.numpy.broadcast_to(order, (ran.shape[0], 2, 4)), "ran": ran,
          "stepped": ran if stepped is None else jax.numpy.asarray(stepped)}


def _run(programs, value, rest, opt_state, batch, plan):
  copy = jax.tree.map(jax.numpy.copy, (value, opt_state))  # the update donates them
  return programs.update(*copy, rest, batch, plan, jax.numpy.ones((), jax.numpy.float32))


def _same(a, b) -> bool:
  return all(bool((x == y).all()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b),
                                                  strict=True))


def test_critic_update_follows_the_policys_plan():
  programs, value, rest, opt_state, batch = _critic_programs()
  # The minibatches after the policy's early stop are not run: epoch 2 stopped equals 1 epoch.
  stopped = _run(programs, value, rest, opt_state, batch, _plan([[True, True], [False, False]]))
  one_epoch = _run(programs, value, rest, opt_state, batch, _plan([[True, True]]))
  assert _same(stopped[:2], one_epoch[:2]) and not _same(stopped[0], value)
  assert float(stopped[2]["loss/value_avg"]) == pytest.approx(
      float(one_epoch[2]["loss/value_avg"]))
  # Where the policy's step was skipped (non-finite), the critic's is too, uncounted.
  held = _run(programs, value, rest, opt_state, batch,
              _plan([[True, True], [True, True]], stepped=[[False, False], [False, False]]))
  assert _same(held[:2], (value, opt_state)) and float(held[2]["skipped_updates"]) == 0


def test_a_non_finite_critic_step_is_skipped_and_counted():
  programs, value, rest, opt_state, batch = _critic_programs()
  nan = batch.replace(returns=batch.returns.at[0, 0].set(jax.numpy.nan))
  out = _run(programs, value, rest, opt_state, nan, _plan([[True, True], [True, False]]))
  # Row 0 is in the second minibatch (the order is reversed), which runs in epoch 1 only: that
  # step is skipped, the first minibatch's two steps are not.
  assert float(out[2]["skipped_updates"]) == 1.0 and not _same(out[0], value)
  all_nan = batch.replace(returns=jax.numpy.full_like(batch.returns, jax.numpy.nan))
  out = _run(programs, value, rest, opt_state, all_nan, _plan([[True, True], [True, False]]))
  assert _same(out[:2], (value, opt_state)) and float(out[2]["skipped_updates"]) == 3.0


def test_the_critics_own_learning_rate_on_its_mesh():
  """`critic_learning_rate` scales the critic program's updates: 0 leaves the critic as it was,
  twice the policy's rate moves it twice as far in one step as the policy's rate does."""
  plan = _plan([[True, False]])
  programs, value, rest, opt_state, batch = _critic_programs(critic_learning_rate=0.0)
  frozen = _run(programs, value, rest, opt_state, batch, plan)
  assert _same(frozen[0], value) and not _same(frozen[1], opt_state)
  same = _run(*_critic_programs(), plan)[0]
  double = _run(*_critic_programs(critic_learning_rate=2e-2), plan)[0]
  assert not _same(same, value)
  for a, b, c in zip(jax.tree.leaves(value), jax.tree.leaves(same), jax.tree.leaves(double),
                     strict=True):
    np.testing.assert_allclose(c - a, 2 * (b - a), rtol=1e-3, atol=1e-7)
