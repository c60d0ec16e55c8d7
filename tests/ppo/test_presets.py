"""Tests of jax_ppo.ppo.presets: scenario presets, the hyperparameter guide and its checks."""

from __future__ import annotations

import dataclasses

import pytest

from jax_ppo.config_io import config_from_dict
from jax_ppo.ppo.config import PPOConfig, PPOSampling
from jax_ppo.ppo.presets import (
  HYPERPARAMETER_GUIDE,
  PRESETS,
  GuideEntry,
  check_against_guide,
  format_guide,
  format_presets,
  nest,
  preset_overrides,
)

PRESET_FIELDS = {"clip_eps", "optimizer", "batch_size", "entropy_coef"}


def test_presets_match_the_articles():
  assert preset_overrides("dialogue") == {
      "clip_eps": 0.15,
      "optimizer": {"learning_rate": 3e-6},
      "batch_size": 64,
      "entropy_coef": 0.03,
  }
  assert preset_overrides("knowledge_qa") == {
      "clip_eps": 0.2,
      "optimizer": {"learning_rate": 1e-6},
      "batch_size": 32,
      "entropy_coef": 0.01,
  }
  assert preset_overrides("creative") == {
      "clip_eps": 0.1,
      "optimizer": {"learning_rate": 5e-6},
      "batch_size": 128,
      "entropy_coef": 0.05,
  }
  assert set(PRESETS) == {"dialogue", "knowledge_qa", "creative"}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_within_the_guide(name):
  overrides = preset_overrides(name)
  assert set(overrides) == PRESET_FIELDS
  assert isinstance(overrides["batch_size"], int)
  assert check_against_guide(overrides) == []


def test_preset_overrides_returns_a_copy_and_presets_are_read_only():
  overrides = preset_overrides("dialogue")
  overrides["clip_eps"] = 0.9
  assert PRESETS["dialogue"]["clip_eps"] == 0.15
  with pytest.raises(TypeError):
    PRESETS["dialogue"]["clip_eps"] = 0.9  # type: ignore[index]
  with pytest.raises(TypeError):
    PRESETS["new"] = {}  # type: ignore[index]


def test_unknown_preset_lists_the_available_ones():
  with pytest.raises(ValueError, match="'chat'.*creative, dialogue, knowledge_qa"):
    preset_overrides("chat")


def test_guide_covers_the_required_fields():
  required = {
      "optimizer.learning_rate",
      "clip_eps",
      "kl_coef",
      "entropy_coef",
      "gamma",
      "lam",
      "vf_coef",
      "ppo_epochs",
      "batch_size",
      "num_minibatches",
      "sampling.temperature",
      "optimizer.max_grad_norm",
      "target_kl",
      "kl_target",
  }
  assert required <= set(HYPERPARAMETER_GUIDE)
  for field, entry in HYPERPARAMETER_GUIDE.items():
    assert isinstance(entry, GuideEntry)
    assert entry.default is None or entry.low <= entry.default <= entry.high, field
    assert entry.advice and "\n" not in entry.advice and "|" not in entry.advice, field
  assert HYPERPARAMETER_GUIDE["optimizer.learning_rate"][:2] == (1e-6, 5e-6)
  assert HYPERPARAMETER_GUIDE["clip_eps"][:2] == (0.1, 0.3)
  assert HYPERPARAMETER_GUIDE["kl_coef"][:2] == (0.01, 0.2)
  assert HYPERPARAMETER_GUIDE["gamma"][:3] == (1.0, 1.0, 1.0)
  assert HYPERPARAMETER_GUIDE["sampling.temperature"][:2] == (0.7, 1.0)


def test_defaults_pass_the_check():
  assert check_against_guide({k: e.default for k, e in HYPERPARAMETER_GUIDE.items()}) == []


def test_nan_is_out_of_range():
  assert check_against_guide({"clip_eps": float("nan")})[0].startswith("clip_eps=nan is outside")


def test_out_of_range_values_get_advice():
  advice = check_against_guide(
      {"optimizer": {"learning_rate": 1e-4}, "clip_eps": 0.05, "gamma": 0.99, "ppo_epochs": 8,
       "seed": 3}
  )
  assert len(advice) == 4
  lr, clip, gamma, epochs = advice
  assert lr.startswith("optimizer.learning_rate=0.0001 is above the recommended 1e-6..5e-6")
  assert "LoRA" in lr
  assert clip.startswith("clip_eps=0.05 is below the recommended 0.1..0.3")
  assert gamma.startswith("gamma=0.99 is below the recommended 1.0:")
  assert epochs.startswith("ppo_epochs=8 is above the recommended 1..4")


def test_lora_widens_the_learning_rate_range():
  assert check_against_guide({"optimizer.learning_rate": 3e-5}, lora=True) == []
  assert check_against_guide({"optimizer.learning_rate": 3e-5}) != []
  assert "(LoRA)" in check_against_guide({"optimizer.learning_rate": 1e-3}, lora=True)[0]


def test_none_and_non_numeric_values_are_ignored():
  assert check_against_guide({"target_kl": None, "sampling.temperature": "hot",
                              "clip_eps": True}) == []


def test_minibatches_must_divide_batch():
  advice = check_against_guide({"batch_size": 64, "num_minibatches": 3})
  assert advice == [
      "num_minibatches=3 does not divide batch_size=64: choose a divisor so every rollout is "
      "used exactly once per epoch."
  ]
  assert check_against_guide({"batch_size": 64, "num_minibatches": 4}) == []


def test_accepts_a_config_dataclass():
  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Optimizer:
    learning_rate: float = 1e-2

  @dataclasses.dataclass(frozen=True, kw_only=True)
  class Config:
    optimizer: Optimizer = dataclasses.field(default_factory=Optimizer)
    clip_eps: float = 0.2
    name: str = "x"

  assert [a.split("=")[0] for a in check_against_guide(Config())] == ["optimizer.learning_rate"]
  cold = check_against_guide(PPOConfig(sampling=PPOSampling(temperature=0.3)))
  assert "sampling.temperature=0.3" in [a.split(" is ")[0] for a in cold]
  with pytest.raises(TypeError):
    check_against_guide([("optimizer.learning_rate", 1.0)])


def test_format_guide_is_a_markdown_table_with_a_row_per_field():
  table = format_guide()
  lines = table.strip().splitlines()
  assert lines[0] == "| Field | Recommended range | Default | Advice |"
  assert lines[1] == "| --- | --- | --- | --- |"
  assert len(lines) == 2 + len(HYPERPARAMETER_GUIDE)
  assert all(line.startswith("| `") and line.count("|") == 5 for line in lines[2:])
  assert "| `optimizer.learning_rate` | 1e-6 to 5e-6 | 3e-6 |" in table
  assert "| `gamma` | 1.0 | 1.0 |" in table
  assert "| `ppo_epochs` | 1 to 4 | 4 |" in table
  assert "| `target_kl` | 0.01 to 0.1 | None (off) |" in table


def test_presets_and_guide_use_trainer_config_fields():
  """Preset overrides build a valid PPOConfig and every guide row names one of its (dotted)
  fields."""
  def get(config, dotted):
    for part in dotted.split("."):
      config = getattr(config, part)
    return config

  for name in PRESETS:
    config = config_from_dict(PPOConfig, preset_overrides(name))
    assert all(get(config, k) == v for k, v in PRESETS[name].items())
  defaults = {k: e.default for k, e in HYPERPARAMETER_GUIDE.items()}
  config = config_from_dict(PPOConfig, nest(defaults))
  assert {k: get(config, k) for k in HYPERPARAMETER_GUIDE} == defaults
  assert check_against_guide(config) == []


def test_format_presets():
  table = format_presets()
  assert table.splitlines()[0] == "| Field | `dialogue` | `knowledge_qa` | `creative` |"
  assert "| `optimizer.learning_rate` | 3e-6 | 1e-6 | 5e-6 |" in table
