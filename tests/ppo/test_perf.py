"""Tests of jax_ppo.ppo.perf: the model-FLOP count of one update against a hand count, the
parameter count, and the matmul-peak measurement's arithmetic under a fake clock."""

import itertools
import math
import types

import jax.numpy as jnp
import numpy as np
import pytest

from jax_ppo.ppo import perf


def test_update_flops_matches_a_hand_count():
  # A policy of 1000 parameters, a critic of 500, a reward model of 300; 4 rows of 3 + 5 tokens.
  tokens = 4 * (3 + 5)
  forward_only = {"rollout (policy)": 1000, "old log-probs (policy)": 1000, "reference": 1000,
                  "critic values": 500, "reward model": 300}
  trained = {"policy": 1000, "critic": 500}  # forward + backward: 6 FLOPs per parameter
  epochs = 2
  hand = sum(2 * n * tokens for n in forward_only.values())
  hand += sum(6 * n * tokens * epochs for n in trained.values())
  assert hand == 2 * 3800 * 32 + 6 * 1500 * 32 * 2 == 819_200
  got = perf.update_flops(policy_params=1000, critic_params=500, reward_params=300, batch=4,
                          prompt_len=3, response_len=5, epochs=2)
  assert got == hand and isinstance(got, float)


def test_update_flops_of_the_fused_first_epoch_skips_the_behaviour_passes():
  # The first epoch's forward gives the old log-probs and values: of the experience passes only
  # the reference (policy-sized) and the reward model remain.
  tokens = 4 * (3 + 5)
  forward_only = {"rollout (policy)": 1000, "reference": 1000, "reward model": 300}
  hand = sum(2 * n * tokens for n in forward_only.values()) + 6 * 1500 * tokens * 2
  got = perf.update_flops(policy_params=1000, critic_params=500, reward_params=300, batch=4,
                          prompt_len=3, response_len=5, epochs=2, fused_first_epoch=True)
  assert got == hand == 2 * 2300 * 32 + 6 * 1500 * 32 * 2


@pytest.mark.parametrize("epochs", [1, 4])
def test_update_flops_without_critic_or_reward_model(epochs):
  # GRPO with a Python reward: rollout, old log-probs and reference forward passes only.
  tokens = 8 * (16 + 32)
  hand = 3 * 2 * 5000 * tokens + epochs * 6 * 5000 * tokens
  assert perf.update_flops(policy_params=5000, critic_params=0, reward_params=0, batch=8,
                           prompt_len=16, response_len=32, epochs=epochs) == hand


def test_count_params_counts_array_elements_only():
  tree = {"a": jnp.zeros((3, 4)), "b": [np.ones(5), jnp.ones(())], "c": None, "d": "name"}
  assert perf.count_params(tree) == 12 + 5 + 1
  assert perf.count_params({}) == 0


def test_measure_matmul_peak_is_flops_over_the_median_time(monkeypatch):
  # perf_counter is read before and after each timed call; the durations are 3, 1, 2, 5, 4 s
  # (median 3 s) and the 64 x 64 matmul does 2 * 64^3 FLOPs.
  durations = [3.0, 1.0, 2.0, 5.0, 4.0]
  stamps = itertools.chain.from_iterable((10.0 * i, 10.0 * i + d) for i, d in
                                         enumerate(durations))
  # Only perf's own clock is replaced (not the `time` module that JAX also reads).
  monkeypatch.setattr(perf, "time", types.SimpleNamespace(perf_counter=lambda: next(stamps)))
  assert perf.measure_matmul_peak(size=64, reps=5) == pytest.approx(2 * 64**3 / 3.0)


def test_measure_matmul_peak_on_this_device():
  peak = perf.measure_matmul_peak(size=128, reps=3)
  assert math.isfinite(peak) and peak > 1e6  # any CPU does more than a MFLOP/s


def _device(kind: str, platform: str = "gpu", process_index: int = 0):
  return types.SimpleNamespace(device_kind=kind, platform=platform, process_index=process_index)


def test_job_peak_is_the_datasheet_peak_per_chip_times_the_chips():
  # An update's FLOPs are the whole job's, so the peak is one chip's times the chips: 8 H100s in
  # bf16 and 4 v5e chips (bf16, and float32 at a third of it).
  h100 = [_device("NVIDIA H100 80GB HBM3")] * 8
  assert perf.job_peak_flops(jnp.bfloat16, h100) == pytest.approx(8 * 989e12)
  assert perf.job_peak_flops(jnp.float32, h100) == pytest.approx(8 * 494.7e12)
  v5e = [_device("TPU v5 lite", "tpu")] * 4
  assert perf.job_peak_flops(jnp.bfloat16, v5e) == pytest.approx(4 * 197e12)
  assert perf.job_peak_flops(jnp.float32, v5e) == pytest.approx(4 * 197e12 / 3)


def test_job_peak_on_cpu_is_the_measured_rate_per_host(monkeypatch):
  # 8 fake CPU devices of one host share its cores: one measured rate; two hosts: twice it.
  monkeypatch.setattr(perf, "measure_matmul_peak", lambda dtype=jnp.float32: 100e9)
  one_host = [_device("cpu", "cpu")] * 8
  assert perf.job_peak_flops(jnp.float32, one_host) == pytest.approx(100e9)
  two_hosts = [_device("cpu", "cpu", i // 4) for i in range(8)]
  assert perf.job_peak_flops(jnp.float32, two_hosts) == pytest.approx(200e9)


def test_compiled_update_model_flops_matches_a_hand_count():
  # One gated layer: D=4, 2 query heads and 1 key/value head of width 2, MLP 6, vocabulary 10.
  from jax_ppo.models.config import ModelConfig

  config = ModelConfig(model_type="qwen3", vocab_size=10, hidden_size=4, intermediate_size=6,
                       num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2,
                       max_position_embeddings=16, qk_norm=True, tie_word_embeddings=True)
  weights = {"q": 4 * 4, "k": 4 * 2, "v": 4 * 2, "o": 4 * 4, "gate": 4 * 6, "up": 4 * 6,
             "down": 6 * 4}
  head = 4 * 10 + 4  # tied LM head + value head, on the T = 2 response positions only
  rows, s, t = 2, 3, 2
  attention = 2 * (2 * rows * 2 * 2 * (s + t) ** 2)  # q k^T and p v, every head, full square
  forward = 2 * sum(weights.values()) * rows * (s + t) + 2 * head * rows * t + attention
  assert forward == 2400 + 352 + 800
  epoch = {"none": 3 * forward, "dots": 3 * forward + attention, "full": 4 * forward}
  for remat, per_epoch in epoch.items():
    for fused, forwards in ((False, 2), (True, 1)):
      got = perf.compiled_update_model_flops(config, rows=rows, prompt_len=s, response_len=t,
                                             epochs=2, remat=remat, fused_first_epoch=fused)
      assert got["total"] == forwards * forward + 2 * per_epoch, (remat, fused)
      assert got["forward"] == forward and got["attention_forward"] == attention
  with pytest.raises(ValueError, match="remat"):
    perf.compiled_update_model_flops(config, rows=1, prompt_len=1, response_len=1, epochs=1,
                                     remat="dots_all", fused_first_epoch=False)
