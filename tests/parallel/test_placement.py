"""`PlacementConfig` / `RunConfig.placement`: every bad placement raises one error naming the
field and the fix; the default shares every role with the policy's mesh (the programs of a run
without placement). The 8-device runs are in `test_placed_update.py`."""

import jax
import pytest

from jax_ppo.config_io import config_to_dict, load_config
from jax_ppo.models import LoRAConfig
from jax_ppo.parallel import MeshConfig
from jax_ppo.parallel.placement import (
  Placement,
  PlacementConfig,
  RoleMesh,
  make_placement,
  transfer,
)
from jax_ppo.ppo.placed_steps import placed_steps, resolve_placement
from jax_ppo.runs.ppo_config import OPERATIONAL_FIELDS, RunConfig, load_run_config

HALF = RoleMesh(devices=(4, 8))


def run_config(**kw) -> RunConfig:
  base = dict(policy_path="p", prompts_path="x.txt", run_dir="r", reward_model_path="rm",
              mesh=MeshConfig())
  return RunConfig(**{**base, **kw})


@pytest.mark.parametrize("kw, message", [
    (dict(reference=RoleMesh(devices=(2, 6)), reward=HALF),
     r"placement.reference.devices=\[2, 6\] and placement.reward.devices=\[4, 8\] overlap"),
    (dict(policy_devices=(0, 5), reward=HALF),
     r"placement.reward.devices=\[4, 8\] overlap placement.policy_devices=\[0, 5\]"),
    (dict(reference=HALF, reward=RoleMesh(devices=(4, 8), mesh=MeshConfig(fsdp=-1, data=1))),
     "share devices \\[4, 8\\] but give different meshes"),
    (dict(reward=RoleMesh(devices=(4, 8), mesh=MeshConfig(data=3))),
     r"placement.reward.mesh: MeshConfig\(data=3, fsdp=1, tensor=1\) needs 3 devices but 4"),
    (dict(policy_devices=(4, 2)), r"placement.policy_devices=\(4, 2\) is invalid"),
    (dict(reference={"devices": [4, 8]}), "placement.reference=.* is invalid"),
])
def test_bad_placement_configs(kw, message):
  with pytest.raises(ValueError, match=message):
    PlacementConfig(**kw)


@pytest.mark.parametrize("devices", [(4, 4), (-1, 2), (0, 2.0), (True, 3), (1, 2, 3)])
def test_bad_role_slice(devices):
  with pytest.raises(ValueError, match=r"RoleMesh.devices=.* is invalid: give \[start, stop\)"):
    RoleMesh(devices=devices)


def test_too_many_devices():
  n = len(jax.devices())
  with pytest.raises(ValueError, match=rf"placement.reward.devices=\[4, 8\] needs 8 devices but "
                                       rf"{n} are available"):
    make_placement(PlacementConfig(reward=HALF), MeshConfig())
  with pytest.raises(ValueError, match=r"none is left for the policy"):
    make_placement(PlacementConfig(reward=RoleMesh(devices=(0, n))), MeshConfig())


def test_unknown_role():
  placement = make_placement(None, MeshConfig())
  for fn in (placement.mesh, placement.is_split, PlacementConfig().role):
    with pytest.raises(ValueError, match=r"Unknown role 'value'; the roles are \('policy', "
                                         r"'reference', 'reward', 'critic'\)"):
      fn("value")
  with pytest.raises(ValueError, match=r"placement.value"):
    load_run_config(["policy_path=p", "prompts_path=x.txt", "run_dir=r", "reward_model_path=rm",
                     "mesh.data=-1", "placement.value.devices=[4, 8]"])


@pytest.mark.parametrize("kw, message", [
    (dict(mesh=None, placement=PlacementConfig(reward=HALF)),
     "RunConfig.placement.reward gives the reward its own devices, but RunConfig.mesh is null"),
    (dict(lora=LoRAConfig(rank=4), placement=PlacementConfig(reference=HALF)),
     "RunConfig.placement.reference must be null with lora"),
    (dict(reward_model_path=None, reward_function="length", placement=PlacementConfig(
        reward=HALF)), "RunConfig.placement.reward .* the run has no reward model"),
    (dict(placement={"reward": None}), "RunConfig.placement=.* is invalid"),
])
def test_bad_run_config_placement(kw, message):
  with pytest.raises(ValueError, match=message):
    run_config(**kw)


def test_run_config_placement_from_yaml(tmp_path):
  path = tmp_path / "run.yaml"
  path.write_text(
      "policy_path: p\nprompts_path: x.txt\nrun_dir: r\nreward_model_path: rm\n"
      "mesh: {data: 1, fsdp: 4}\n"
      "placement:\n  policy_devices: [0, 4]\n"
      "  reference: {devices: [4, 8], mesh: {data: 1, fsdp: 4}}\n"
      "  reward: {devices: [4, 8], mesh: {data: 1, fsdp: 4}}\n")
  config = load_run_config([str(path)])
  quarter = RoleMesh(devices=(4, 8), mesh=MeshConfig(data=1, fsdp=4))
  assert config.placement == PlacementConfig(policy_devices=(0, 4), reference=quarter,
                                             reward=quarter)
  assert config.placement.split_roles == ("reference", "reward")
  saved = tmp_path / "saved.yaml"
  import yaml

  saved.write_text(yaml.safe_dump(config_to_dict(config)))
  assert load_config(RunConfig, saved) == config
  assert "placement" in OPERATIONAL_FIELDS  # a run may resume with another placement


def test_default_shares_every_role():
  config = run_config()
  assert config.placement == PlacementConfig() and config.placement.split_roles == ()
  placement = make_placement(config.placement, config.mesh)
  assert placement.policy is placement.reference is placement.reward
  assert not placement.any_split and not placement.is_split("reward")
  assert resolve_placement(None, None) is None
  assert resolve_placement(placement.policy, None) == Placement.shared(placement.policy)
  sentinel = object()
  assert placed_steps(sentinel, placement) is sentinel  # the PPOSteps programs, unchanged
  with pytest.raises(ValueError, match="both `mesh` and `placement`"):
    other = jax.make_mesh((1,), ("x",))
    resolve_placement(other, placement)
  with pytest.raises(ValueError, match="unknown kind 'rows'"):
    transfer({}, placement.policy, kind="rows")
