"""Fixtures of the run tests: refusals that must come before any weights load."""

import pytest


@pytest.fixture
def no_weights(monkeypatch):
  """Loading any weights in a run (SFT, reward model, DPO, PPO) fails the test: the refusals
  under test come before."""
  from jax_ppo.runs import dpo, ppo, reward, sft

  def refuse(*args, **kwargs):
    raise AssertionError("weights were loaded before the refusal")

  for module in (sft, reward, dpo, ppo):
    for name in ("from_pretrained", "load_scalar_model"):
      if hasattr(module, name):
        monkeypatch.setattr(module, name, refuse)
