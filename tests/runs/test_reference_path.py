"""`RunConfig.reference_path`: the KL's reference policy from a checkpoint of its own
(jax_ppo/runs/ppo.py `build_trainer`, `PPOTrainer(reference=...)`), on tiny random Hugging Face
checkpoints built locally."""

import jax
import numpy as np
import pytest

pytest.importorskip("torch", reason="torch builds the tiny Hugging Face models")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from jax_ppo.models import LoRAConfig  # noqa: E402
from jax_ppo.ppo import PPOConfig, PPOSampling  # noqa: E402
from jax_ppo.runs.ppo import build_trainer  # noqa: E402
from jax_ppo.runs.ppo_config import RunConfig  # noqa: E402
from tests.tiny_hf_run import make_checkpoint, write_data  # noqa: E402

pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")

PPO = PPOConfig(batch_size=4, sampling=PPOSampling(max_new_tokens=4, temperature=1.0),
                total_updates=1)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
  root = tmp_path_factory.mktemp("reference")
  return {"policy": make_checkpoint(root / "policy", seed=0),
          "other": make_checkpoint(root / "other", seed=7),
          "qwen3": make_checkpoint(root / "qwen3", "qwen3", seed=7),
          **write_data(root)}


def _config(assets, tmp_path, **kwargs) -> RunConfig:
  fields = dict(policy_path=assets["policy"], prompts_path=assets["prompts"],
                reward_function="length", run_dir=str(tmp_path / "run"), dtype="float32", ppo=PPO)
  return RunConfig(**{**fields, **kwargs})


def test_reference_log_probs_are_the_reference_checkpoints(assets, tmp_path):
  """With reference_path, the reference log-probs of a rollout are that checkpoint's own
  log-probs (those of a run whose policy it is) and differ from the policy's; the policy still
  starts from policy_path."""
  trainer = build_trainer(_config(assets, tmp_path, reference_path=assets["other"]),
                          open_run=False)
  as_policy = build_trainer(_config(assets, tmp_path, policy_path=assets["other"]),
                            open_run=False)
  plain = build_trainer(_config(assets, tmp_path), open_run=False)
  prompts = [trainer.tokenizer(p)["input_ids"] for p in ("the movie was", "the actor is")] * 2
  rollout = trainer.sampler(prompts, jax.random.PRNGKey(0), state=trainer.policy_state())
  mask = np.asarray(rollout.response_mask).astype(bool)
  logprobs, ref = (np.asarray(x) for x in trainer.eval_logprobs(trainer.state.policy,
                                                                trainer.frozen, rollout))
  other, _ = (np.asarray(x) for x in as_policy.eval_logprobs(as_policy.state.policy,
                                                             as_policy.frozen, rollout))
  start, plain_ref = (np.asarray(x) for x in plain.eval_logprobs(plain.state.policy,
                                                                 plain.frozen, rollout))
  assert mask.sum() > 0
  np.testing.assert_allclose(ref[mask], other[mask], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(logprobs[mask], start[mask], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(plain_ref[mask], start[mask], rtol=1e-5, atol=1e-5)  # default
  assert np.max(np.abs(ref[mask] - logprobs[mask])) > 1e-3
  m = trainer.step()  # trains against it: the KL of the policy's start is not 0
  assert np.isfinite(m["objective/kl"]) and abs(m["objective/kl"]) > 1e-4
  for t in (trainer, as_policy, plain):
    t.close()


def test_reference_path_errors_name_the_field(assets, tmp_path):
  with pytest.raises(ValueError, match=r"^RunConfig.reference_path=.* is invalid: with lora the "
                                       "reference is the policy's base weights"):
    _config(assets, tmp_path, reference_path=assets["other"], lora=LoRAConfig(rank=2, alpha=4))
  with pytest.raises(ValueError, match=r"^RunConfig.reference_path='' is invalid: give a "):
    _config(assets, tmp_path, reference_path="")
  with pytest.raises(FileNotFoundError, match=r"^RunConfig.reference_path=.*no Hugging Face "
                                              "model folder"):
    build_trainer(_config(assets, tmp_path, reference_path=str(tmp_path)), open_run=False)
  with pytest.raises(ValueError, match=r"^RunConfig.reference_path: the reference policy .*"
                                       "parameter .*give a checkpoint of the policy's "
                                       "architecture"):
    build_trainer(_config(assets, tmp_path, reference_path=assets["qwen3"]), open_run=False)


@pytest.mark.slow
def test_reference_path_on_a_mesh_is_placed_like_the_default_reference(tmp_path):
  """On 4 fake devices: the loaded reference has the default reference's shardings, on the
  shared mesh and on a sub-mesh of its own, and its log-probs are its checkpoint's."""
  from tests.parallel.multidevice import run_on_devices

  out = run_on_devices("reference_path_mesh.py", str(tmp_path), devices=4)
  assert out["shared"]["ref_devices"] == [0, 1, 2, 3]
  assert out["split"]["ref_devices"] == [2, 3]
  for mode in ("shared", "split"):
    assert out[mode]["same_sharding"], mode
    assert out[mode]["tokens"] > 0 and out[mode]["max_ref_diff"] < 1e-4, out[mode]
