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


def compiled_update_model_flops(config, *, rows: int, prompt_len: int, response_len: int,
                                epochs: int, remat: str, fused_first_epoch: bool,
                                value_head: bool = True) -> dict[str, float]:
  r"""Model FLOPs of one PPO update of a policy with the architecture `config` (a
  `jax_ppo.models.ModelConfig`), counted as its compiled programs run it: the yardstick of
  `experiments/benchmarks/tpu_waste.py`.

  With `B = rows`, `S = prompt_len`, `T = response_len`, `L` layers, `H` query heads of width
  `Dh`, hidden `D`, vocabulary `V`, `m = 3` for a gated MLP (else 2):

  .. math::
     N_{body} &= L (2 D\,H D_h + 2 D\,K D_h + m D I),\quad N_{head} = D V + D [value head] \\
     F_{attn} &= 4 L H D_h B (S+T)^2 \\
     F_{fwd} &= 2 N_{body} B (S+T) + 2 N_{head} B T + F_{attn} \\
     F_{epoch} &= 3 F_{fwd} + R,\quad R = F_{attn} \text{ ("dots")}, F_{fwd} \text{ ("layer",
       "full")}, 0 \text{ ("none")}

  The trunk runs every slot, the LM head (tied or not) and the value head only the `T` positions
  that predict a response token (`jax_ppo.ppo.forward.response_hidden`); attention's `q k^T` and
  `p v` cover the full `(S+T)^2` square, as a dense masked attention computes them (PaLM's
  count; a causal kernel needs half). The remat policy "dots" keeps the weight matmuls' outputs
  and recomputes the batched (attention) matmuls in the backward pass. The experience runs the
  behaviour forward (old log-probs and values) and the reference forward; with
  `fused_first_epoch` the first epoch's forward gives the behaviour outputs
  (`PPOSteps.experience_update`), so only the reference runs.

  Returns:
    `{"n_body", "n_head", "forward", "attention_forward", "experience", "update", "total"}`,
    FLOPs of the whole job (all chips).
  """
  c = config
  s, t, b, d = prompt_len, response_len, rows, c.hidden_size
  mlp = 3 if c.gated_mlp else 2
  n_body = c.num_layers * (2 * d * c.q_size + 2 * d * c.kv_size + mlp * d * c.intermediate_size)
  n_head = d * c.vocab_size + (d if value_head else 0)
  attn = 4 * c.num_layers * c.num_heads * c.head_dim * b * (s + t) ** 2
  fwd = 2 * n_body * b * (s + t) + 2 * n_head * b * t + attn
  recompute = {"none": 0, "dots": attn, "layer": fwd, "full": fwd, "nothing_saveable": fwd}
  if remat not in recompute:
    raise ValueError(f"remat={remat!r}: counted for {sorted(recompute)} only.")
  update = epochs * (3 * fwd + recompute[remat])
  experience = (1 if fused_first_epoch else 2) * fwd
  return {"n_body": float(n_body), "n_head": float(n_head), "forward": float(fwd),
          "attention_forward": float(attn), "experience": float(experience),
          "update": float(update), "total": float(experience + update)}

