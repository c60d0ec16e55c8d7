"""`jax_ppo.diagnostics.advice`: the search for the change that makes a run fit, over a model of
the peak bytes (no libtpu; the re-planned search on a real slice is in test_plan.py), and its
changes read back through the run config as a user would paste them."""

import dataclasses

import pytest

from jax_ppo.diagnostics import advice
from jax_ppo.diagnostics.ppo_plan import RunShape
from jax_ppo.models import LoRAConfig, ModelConfig
from jax_ppo.parallel.mesh import MeshConfig
from jax_ppo.ppo.config import PPOConfig
from jax_ppo.runs.ppo_config import load_run_config

MODEL = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=8, model_type="qwen3",
                    max_position_embeddings=64)


def shape(**kw) -> RunShape:
  return RunShape(model=MODEL, ppo=PPOConfig(batch_size=32, num_minibatches=2), **kw)


def peaks(s: RunShape) -> dict[str, int]:
  """Parameters split over fsdp (LoRA: a tenth of them), activations over the accumulation
  steps, full remat halving them: `{"update": bytes}`."""
  params = (10 if s.lora is not None else 100) // (s.mesh.fsdp if s.mesh else 1)
  acts = 64 // s.ppo.gradient_accumulation_steps // (2 if s.remat == "full" else 1)
  return {"generate": params, "update": params + acts}


def test_fsdp_first_and_its_smallest_size():
  found = advice.advise(shape(mesh=MeshConfig(data=8)), chips=8, hbm_bytes=100,
                        peaks_of=peaks)
  # 100 + 64 at fsdp 1; 50 + 64 at 2; 25 + 64 = 89 at 4 fits
  assert [a.change for a in found] == [("mesh.data=2", "mesh.fsdp=4", "mesh.tensor=1")]
  assert found[0].fits and found[0].peak_bytes_per_chip == 89


def test_accumulation_when_fsdp_is_spent_then_everything_together():
  s = shape(mesh=MeshConfig(data=1, fsdp=8))  # 12 + 64
  found = advice.advise(s, chips=8, hbm_bytes=30, peaks_of=peaks)
  # minibatch of 16 rows over 8 chips: accumulation 2 only (8 rows, one per chip); 12 + 32 > 30,
  # then full remat 12 + 32 = 44 > 30, LoRA 1 + 64 > 30: none alone; together 1 + 16 = 17
  assert len(found) == 1 and not found[0].why.startswith("FSDP")
  assert found[0].change == ("ppo.gradient_accumulation_steps=2", "remat=full", "lora.rank=16")
  assert found[0].fits and found[0].peak_bytes_per_chip == 17
  assert advice.advise(s, chips=8, hbm_bytes=10, peaks_of=peaks)[0].fits is False


def test_nothing_to_change():
  s = shape(mesh=MeshConfig(data=1, fsdp=8), remat="full",
            lora=LoRAConfig(rank=4))
  s = dataclasses.replace(s, ppo=dataclasses.replace(s.ppo, gradient_accumulation_steps=2))
  assert advice.advise(s, chips=8, hbm_bytes=1, peaks_of=peaks) == []


@pytest.mark.parametrize("kind", range(4))
def test_every_change_is_a_config_override_that_means_what_it_says(tmp_path, kind):
  import transformers

  transformers.Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=8).save_pretrained(tmp_path / "policy")
  base = [f"policy_path={tmp_path / 'policy'}", "prompts_path=p.txt", f"run_dir={tmp_path}/r",
          "reward_function=length", "mesh.data=8", "ppo.batch_size=32",
          "ppo.num_minibatches=2"]
  config = load_run_config(base)
  s = dataclasses.replace(shape(), mesh=config.mesh, ppo=config.ppo, remat=config.remat)
  why, steps = list(advice.single_changes(s, 8))[kind]
  assert steps, why
  for change, fields in steps:
    changed = load_run_config([*base, *change])
    for field, value in fields.items():
      assert getattr(changed, field) == value, (change, field)


def stage(kind: str, **kw):
  """An SFT or reward-model run's shape, batch 16 (rows or pairs)."""
  from jax_ppo.diagnostics.stage_plan import StageShape
  from jax_ppo.reward_model.config import RewardModelConfig
  from jax_ppo.sft.config import SFTConfig

  config = SFTConfig(batch_size=16) if kind == "sft" else RewardModelConfig(batch_size=16)
  return StageShape(model=MODEL, config=config, **kw)


def stage_peaks(s) -> dict[str, int]:
  """`peaks` for a stage: activations over its own accumulation steps."""
  params = (10 if s.lora is not None else 100) // (s.mesh.fsdp if s.mesh else 1)
  return {"train_step": params + 64 // s.config.gradient_accumulation_steps}


@pytest.mark.parametrize("kind", ["sft", "reward"])
def test_stage_runs_get_their_own_accumulation_and_no_remat(tmp_path, kind):
  """An SFT or reward-model run accumulates under its own section, is never told `remat=full`
  (its run config has no such field), and each change reads back through its run config."""
  from jax_ppo.runs.stages import load_stage_run_config

  s = stage(kind, mesh=MeshConfig(data=1, fsdp=8))  # 12 + 64
  found = advice.advise(s, chips=8, hbm_bytes=30, peaks_of=stage_peaks)
  # 16 rows over 8 chips: accumulation 2 only; 12 + 32 > 30, LoRA 1 + 64 > 30; together 1 + 32
  assert found[0].change == (f"{kind}.gradient_accumulation_steps=2", "lora.rank=16")
  assert not found[0].fits and found[0].peak_bytes_per_chip == 33
  assert [why for why, steps in advice.single_changes(s, 8) if steps and "remat" in
          " ".join(c for change, _ in steps for c in change)] == []
  s = stage(kind, mesh=MeshConfig(data=8))
  base = [f"model_path={tmp_path}/model", "train_path=data.jsonl", f"run_dir={tmp_path}/r",
          "mesh.data=8", f"{kind}.batch_size=16"]
  for why, steps in advice.single_changes(s, 8):
    for change, fields in steps:
      changed = load_stage_run_config(kind, [*base, *change])
      for field, value in fields.items():
        got = changed.mesh if field == "mesh" else (
            changed.lora if field == "lora" else getattr(changed, kind))
        assert got == value, (why, change)
