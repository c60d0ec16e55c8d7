"""Throughput accounting: the machine's matmul peak and model-FLOP estimates for MFU."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def measure_matmul_peak(size: int = 1024, reps: int = 5, dtype=jnp.float32) -> float:
  """FLOP/s of a jitted `size x size` matmul on the default device (median of `reps`)."""
  a = jnp.ones((size, size), dtype)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    f(a).block_until_ready()
    times.append(time.perf_counter() - t0)
  times.sort()
  return 2.0 * size**3 / times[len(times) // 2]


def count_params(state) -> int:
  """Number of array elements in a pytree of parameters."""
  return int(sum(x.size for x in jax.tree.leaves(state) if hasattr(x, "size")))


def update_flops(
    *,
    policy_params: int,
    critic_params: int,
    reward_params: int,
    batch: int,
    prompt_len: int,
    response_len: int,
    epochs: int,
    fused_first_epoch: bool = False,
) -> float:
  """Model FLOPs of one PPO update: 2N per forward token, 6N per trained token.

  Rollout (prompt + generated tokens through the policy), the experience passes (policy, and
  reference, critic and reward model forward over prompt + response), and `epochs` training
  passes of policy and critic. With `fused_first_epoch` (`PPOSteps.fuses_first_epoch`) the
  first epoch's forward pass also gives the old log-probs and values, so the experience step
  runs only the reference and the reward model.
  """
  seq = prompt_len + response_len
  rollout = 2 * policy_params * batch * seq
  behaviour = 0 if fused_first_epoch else policy_params + critic_params
  experience = 2 * (policy_params + behaviour + reward_params) * batch * seq
  training = 6 * (policy_params + critic_params) * batch * seq * epochs
  return float(rollout + experience + training)
