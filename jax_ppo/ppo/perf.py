"""Throughput accounting: the job's matmul peak and model-FLOP estimates for MFU.

`mfu = model FLOPs of an update / its wall time / job_peak_flops(...)`: on accelerators the
peak is the datasheet's per-chip rate for the compute dtype (`jax_ppo.parallel.chips`) times
the number of chips in the job, since the update's FLOPs are the whole job's; on a CPU (no
datasheet) it is a measured matmul rate of each host times the number of hosts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jax_ppo.parallel.chips import chip_for

logger = logging.getLogger(__name__)


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


def job_peak_flops(dtype=jnp.float32, devices: Sequence[jax.Device] | None = None) -> float:
  """Peak matmul FLOP/s of the whole job, the denominator of MFU.

  Args:
    dtype: the compute dtype (bfloat16 / float16 pick the chips' bf16 rate, else fp32).
    devices: the job's devices (default: `jax.devices()`, every process's).

  Returns:
    `chip.peak_flops(dtype) * len(devices)` when the devices are a chip of
    `jax_ppo.parallel.chips.CHIPS`; otherwise (a CPU, an unknown chip) this host's measured
    `measure_matmul_peak(dtype=dtype)` times the number of processes: fake CPU devices of one
    host share its cores, so they are not counted one by one.
  """
  devices = list(jax.devices() if devices is None else devices)
  chip = chip_for(devices[0].device_kind)
  if chip is not None:
    return chip.peak_flops(jnp.dtype(dtype).name) * len(devices)
  if devices[0].platform != "cpu":
    logger.warning("No datasheet peak for device kind %r (jax_ppo.parallel.chips.CHIPS); the "
                   "mfu metric uses a measured matmul rate instead.", devices[0].device_kind)
  hosts = len({d.process_index for d in devices})
  return measure_matmul_peak(dtype=dtype) * hosts


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
