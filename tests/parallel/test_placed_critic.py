"""The critic on a sub-mesh of its own (`PlacementConfig.critic`, `jax_ppo.trainer.critic`).

On 8 fake CPU devices (subprocesses through `multidevice.run_on_devices`; the pytest process
has one device): policy on devices 0-3, critic on 4-5, reference and reward model on 6-7 give
the same update as every role on the policy's devices (gradient clipping off, or on with both
norms under it), with the same minibatches and early stop; each array lives where the
docstrings say; the split state checkpoints and restores (into a shared run's layout too); and
`jax-ppo train` with such a placement in its config file trains, resumes and evaluates (the
reference's evaluation log-probs on its own mesh). Bad configurations raise one clear error.
"""

import jax
import pytest
from flax import nnx
from multidevice import run_on_devices

from jax_ppo.models.config import ModelConfig
from jax_ppo.models.heads import ScalarModel
from jax_ppo.parallel import MeshConfig, make_mesh
from jax_ppo.parallel.placement import Placement, PlacementConfig, RoleMesh
from jax_ppo.trainer import PPOConfig
from jax_ppo.trainer.critic import CriticPrograms, join, split_state
from jax_ppo.trainer.optim import make_optimizer
from jax_ppo.trainer.roles import PlacedSteps, place_frozen
from jax_ppo.trainer.run_config import RunConfig, load_run_config
from jax_ppo.trainer.state import FrozenParams, init_train_state
from jax_ppo.trainer.step import PPOSteps

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
    (dict(ppo=PPOConfig(batch_size=8, max_new_tokens=4, advantage_mode="grpo", n_samples=2)),
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
  config = PPOConfig(batch_size=8, max_new_tokens=4)
  optimizer, schedule = make_optimizer(config)
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
  config = PPOConfig(batch_size=8, max_new_tokens=4)
  optimizer, _ = make_optimizer(config)
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
