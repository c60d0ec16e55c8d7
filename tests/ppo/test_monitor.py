"""Tests of jax_ppo.ppo.monitor: each check fires on a stream that should trigger it and stays
silent on healthy streams; collapse detection and rollback; rate-limited logging; state round
trip through JSON."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random

import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from hypothesis import given

from jax_ppo.ppo.monitor import (
    COLLAPSE_KINDS,
    WARNING_KINDS,
    MonitorConfig,
    StabilityMonitor,
    StabilityWarning,
)


def healthy_stream(n: int = 200, seed: int = 0, *, reward_noise: float = 0.05):
  """Metrics of a run that learns: rising reward, small KL and clip fraction, falling value loss."""
  rng = random.Random(seed)
  for t in range(n):
    yield {
        "objective/scores": 1.0 + 0.01 * t + rng.gauss(0.0, reward_noise),
        "objective/kl": 1.5 + 0.5 * rng.random(),  # summed over ~48 tokens
        "response_length/mean": 48.0 + rng.gauss(0.0, 2.0),
        "policy/clipfrac_avg": 0.1 + 0.05 * rng.random(),
        "loss/value_avg": 2.0 * 0.97**t + 0.01 * rng.random(),
        "loss/policy_avg": rng.gauss(0.0, 0.1),
        "lr": 3e-6,
    }


def run(monitor: StabilityMonitor, stream, start: int = 0) -> list[StabilityWarning]:
  out = []
  for step, metrics in enumerate(stream, start=start):
    out.extend(monitor.update(step, metrics))
  return out


def kinds(warnings) -> set[str]:
  return {w.kind for w in warnings}


# ---- healthy streams -----------------------------------------------------------------------------


def test_healthy_stream_is_silent():
  monitor = StabilityMonitor()
  assert run(monitor, healthy_stream()) == []
  assert not monitor.collapsed


@given(seed=st.integers(0, 2**16), noise=st.floats(0.01, 2.0), level=st.floats(-5.0, 5.0))
def test_stationary_noisy_reward_never_collapses(seed, noise, level):
  """A reward that only fluctuates around a constant level is no collapse, whatever its scale."""
  rng = random.Random(seed)
  monitor = StabilityMonitor()
  for step in range(150):
    monitor.update(step, {"objective/scores": level + rng.gauss(0.0, noise)})
  assert not monitor.collapsed, monitor.collapse_reason


def test_missing_metrics_skip_their_checks():
  monitor = StabilityMonitor()
  for step in range(30):
    assert monitor.update(step, {"lr": 1e-6, "note": "nan", "hist": np.ones(3)}) == []


# ---- each warning fires --------------------------------------------------------------------------


def test_reward_volatility():
  monitor = StabilityMonitor()
  rewards = [0.0, 2.0] * 10  # mean 1, std 1 > 0.5 * |mean|
  got = [monitor.update(step, {"objective/scores": r}) for step, r in enumerate(rewards)]
  assert all(w == [] for w in got[:9])  # the window is not full yet
  assert [w.kind for w in got[9]] == ["reward_volatility"]
  assert got[9][0].value == pytest.approx(1.0)
  assert "learning_rate" in got[9][0].message and "reward model" in got[9][0].message


def test_reward_volatility_uses_rlhf_reward_when_scores_are_absent():
  monitor = StabilityMonitor()
  warnings = run(monitor, ({"objective/rlhf_reward": r} for r in [0.0, 2.0] * 5))
  assert kinds(warnings) == {"reward_volatility"}


def test_kl_consecutive_rule():
  monitor = StabilityMonitor(MonitorConfig(kl_threshold=0.1, kl_window=5))
  kls = [0.2, 0.2, 0.2, 0.2, 0.05, 0.2, 0.2, 0.2, 0.2]
  assert run(monitor, ({"objective/kl": k} for k in kls)) == []
  warnings = monitor.update(9, {"objective/kl": 0.3})
  assert [w.kind for w in warnings] == ["kl_high"]
  assert warnings[0].value == pytest.approx(0.3)
  assert "kl_coef" in warnings[0].message


def test_kl_mean_rule():
  kls = [0.3, 0.0, 0.0, 0.0, 0.3]  # mean 0.12 > 0.1, but only two values above the threshold
  consecutive = StabilityMonitor(MonitorConfig(kl_rule="consecutive"))
  mean = StabilityMonitor(MonitorConfig(kl_rule="mean"))
  assert run(consecutive, ({"objective/kl": k} for k in kls)) == []
  warnings = run(mean, ({"objective/kl": k} for k in kls))
  assert [w.kind for w in warnings] == ["kl_high"]
  assert warnings[0].value == pytest.approx(0.12)


def test_kl_is_per_token_when_the_response_length_is_logged():
  """TRL's objective/kl sums over the response; dividing by the mean length gives per-token KL."""
  monitor = StabilityMonitor()
  healthy = {"objective/kl": 4.0, "response_length/mean": 48.0}  # 0.083 per token
  assert run(monitor, [healthy] * 10) == []
  drifting = {"objective/kl": 9.6, "response_length/mean": 48.0}  # 0.2 per token
  warnings = run(monitor, [drifting] * 5, start=10)
  assert [w.kind for w in warnings] == ["kl_high"]
  assert warnings[0].value == pytest.approx(0.2) and "KL per token" in warnings[0].message
  assert not monitor.collapsed  # 0.2 < 10 x 0.1
  raw = StabilityMonitor(MonitorConfig(kl_length_key=None))
  assert "kl_blowup" in kinds(raw.update(0, healthy))  # 4.0 nats compared as logged
  assert "KL per token" not in raw.collapse_reason.message


def test_clipfrac():
  monitor = StabilityMonitor()
  assert monitor.update(0, {"policy/clipfrac_avg": 0.8}) == []
  warnings = monitor.update(1, {"policy/clipfrac_avg": 0.85})
  assert [w.kind for w in warnings] == ["clipfrac_high"]
  assert "learning_rate" in warnings[0].message and "ppo_epochs" in warnings[0].message


@pytest.mark.parametrize("bad", [math.nan, math.inf, np.float32("-inf"), jnp.float32(jnp.nan)])
def test_non_finite_any_metric(bad):
  monitor = StabilityMonitor()
  warnings = monitor.update(3, {"objective/scores": 1.0, "loss/policy_avg": bad})
  assert [w.kind for w in warnings] == ["non_finite"]
  assert "loss/policy_avg" in warnings[0].message
  assert math.isnan(warnings[0].value)
  assert monitor.collapsed and monitor.collapse_reason.kind == "non_finite"


def test_non_finite_collapse_is_configurable():
  monitor = StabilityMonitor(MonitorConfig(collapse_on_nonfinite=False))
  assert kinds(monitor.update(0, {"objective/kl": math.nan})) == {"non_finite"}
  assert not monitor.collapsed


def test_non_finite_values_do_not_enter_the_windows():
  monitor = StabilityMonitor(MonitorConfig(collapse_on_nonfinite=False))
  run(monitor, ({"objective/scores": 1.0} for _ in range(5)))
  monitor.update(5, {"objective/scores": math.nan})
  assert all(math.isfinite(v) for _, v in monitor.state_dict()["rewards"])


def test_value_loss_plateau():
  monitor = StabilityMonitor(MonitorConfig(value_loss_window=10))
  flat = [1.0 + 0.01 * (t % 3) for t in range(19)]
  assert run(monitor, ({"loss/value_avg": v} for v in flat)) == []  # fewer than 2 windows
  warnings = monitor.update(19, {"loss/value_avg": 1.0})
  assert [w.kind for w in warnings] == ["value_loss_plateau"]
  assert "vf_coef" in warnings[0].message


def test_value_loss_decreasing_is_silent_and_min_decrease_is_respected():
  losses = [1.0 - 0.01 * t for t in range(40)]  # about 10% lower per window
  assert run(StabilityMonitor(), ({"loss/value_avg": v} for v in losses)) == []
  strict = StabilityMonitor(MonitorConfig(value_loss_min_decrease=0.5))
  assert kinds(run(strict, ({"loss/value_avg": v} for v in losses))) == {"value_loss_plateau"}


# ---- collapse ------------------------------------------------------------------------------------


def collapsing_stream(seed: int = 0):
  """Rising reward for 60 updates, then it falls to a third of its level."""
  rng = random.Random(seed)
  for t in range(80):
    level = 1.0 + 0.02 * t if t < 60 else 0.7
    yield {"objective/scores": level + rng.gauss(0.0, 0.05), "objective/kl": 0.05}


def test_reward_collapse_sets_the_flag():
  monitor = StabilityMonitor()
  first = None
  for step, metrics in enumerate(collapsing_stream()):
    warnings = monitor.update(step, metrics)
    if first is None and "reward_collapse" in kinds(warnings):
      first = step
  assert first is not None and 60 <= first <= 63  # detected within a few updates
  assert monitor.collapsed and monitor.collapse_reason.kind == "reward_collapse"
  assert monitor.collapse_reason.step == first
  assert "Roll back" in monitor.collapse_reason.message


def test_small_relative_dip_is_not_a_collapse():
  """A dip of a few noise stds that is small next to the reward level does not trigger."""
  monitor = StabilityMonitor()
  rewards = [10.0] * 40 + [9.5] * 10  # 5% below: a low-noise stream, but under the 20% fraction
  run(monitor, ({"objective/scores": r} for r in rewards))
  assert not monitor.collapsed


def test_kl_blowup():
  monitor = StabilityMonitor(MonitorConfig(kl_threshold=0.1, collapse_kl_multiple=10.0))
  assert "kl_blowup" not in kinds(monitor.update(0, {"objective/kl": 0.9}))
  warnings = monitor.update(1, {"objective/kl": 1.5})
  assert "kl_blowup" in kinds(warnings)
  assert monitor.collapsed and monitor.collapse_reason.kind == "kl_blowup"
  assert set(COLLAPSE_KINDS) <= set(WARNING_KINDS)


def test_rollback_forgets_collapsed_updates():
  monitor = StabilityMonitor()
  stream = list(collapsing_stream())
  run(monitor, stream)
  assert monitor.collapsed
  monitor.rollback(55)
  assert not monitor.collapsed
  assert max(s for s, _ in monitor.state_dict()["rewards"]) == 55
  # Replaying healthy updates from the checkpoint does not collapse again.
  run(monitor, ({"objective/scores": 2.1 + 0.02 * i} for i in range(20)), start=56)
  assert not monitor.collapsed


def test_clear_collapse_keeps_history():
  monitor = StabilityMonitor()
  monitor.update(0, {"objective/kl": 5.0})
  assert monitor.collapsed
  monitor.clear_collapse()
  assert not monitor.collapsed
  assert monitor.state_dict()["kls"] == [[0, 5.0]]


# ---- logging -------------------------------------------------------------------------------------


def test_persistent_condition_is_logged_rate_limited(caplog):
  monitor = StabilityMonitor(MonitorConfig(log_interval=100))
  with caplog.at_level(logging.WARNING, logger="jax_ppo.monitor"):
    for step in range(250):
      assert kinds(monitor.update(step, {"policy/clipfrac_avg": 0.9})) == {"clipfrac_high"}
  records = [r for r in caplog.records if r.name == "jax_ppo.monitor"]
  assert [r.getMessage().split()[1] for r in records] == ["0", "100", "200"]
  assert all("clipfrac_high" in r.getMessage() for r in records)


def test_collapse_is_logged_as_error(caplog):
  monitor = StabilityMonitor()
  with caplog.at_level(logging.WARNING, logger="jax_ppo.monitor"):
    monitor.update(0, {"objective/kl": 5.0})
  assert [r.levelno for r in caplog.records] == [logging.ERROR]


# ---- state ---------------------------------------------------------------------------------------


def test_state_round_trip_continues_the_windows():
  stream = list(healthy_stream(60, seed=1, reward_noise=0.3))
  stream += [{"objective/kl": 0.5, "loss/value_avg": 5.0, "objective/scores": 0.0}] * 15
  a = StabilityMonitor()
  run(a, stream[:40])
  state = json.loads(json.dumps(a.state_dict()))  # plain JSON types only
  assert yaml.safe_load(yaml.safe_dump(state)) == state
  b = StabilityMonitor()
  b.load_state_dict(state)
  assert b.state_dict() == a.state_dict()
  wa, wb = run(a, stream[40:], start=40), run(b, stream[40:], start=40)
  assert wa == wb and {"kl_high", "value_loss_plateau"} <= kinds(wa)
  assert a.state_dict() == b.state_dict()
  # A fresh monitor without the history would not see the KL window already filled.
  c = StabilityMonitor()
  assert c.update(40, stream[40]) == []


def test_state_round_trip_keeps_collapse():
  a = StabilityMonitor()
  a.update(7, {"objective/kl": 9.0})
  b = StabilityMonitor()
  b.load_state_dict(json.loads(json.dumps(a.state_dict())))
  assert b.collapsed and b.collapse_reason == a.collapse_reason


# ---- config --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("reward_keys", ()),
        ("kl_key", ""),
        ("kl_length_key", ""),
        ("reward_window", 1),
        ("kl_window", 0),
        ("value_loss_window", 0),
        ("collapse_window", 19),
        ("collapse_min_history", 9),
        ("reward_volatility_ratio", 0.0),
        ("kl_threshold", -0.1),
        ("kl_rule", "median"),
        ("clipfrac_threshold", 1.5),
        ("value_loss_min_decrease", 1.0),
        ("collapse_reward_drop_std", 0.0),
        ("collapse_reward_drop_fraction", -0.1),
        ("collapse_kl_multiple", 1.0),
        ("log_interval", 0),
    ],
)
def test_config_errors_name_the_field(field, value):
  with pytest.raises(ValueError, match=rf"MonitorConfig\.{field}="):
    MonitorConfig(**{field: value})


def test_config_is_frozen_and_keyword_only():
  config = MonitorConfig()
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.kl_threshold = 1.0  # type: ignore[misc]
  with pytest.raises(TypeError):
    MonitorConfig(10)  # type: ignore[misc]
