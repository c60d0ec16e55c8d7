"""GAE speed: `jax_ppo.gae` (one reverse `lax.scan`, jitted) against the Python loops of the
practitioners' articles, and against the machine's copy bandwidth.

Three implementations of the same masked GAE (docs/core_api.md: the value after the last valid
token is 0; advantages and returns are 0 on padding):

- `jax_ppo.gae` under `jax.jit`;
- a Python `for t in reversed(range(T))` loop over jnp arrays, run eagerly, the way PPO
  tutorials and RLHF trainers write it (one column slice, a few ops and a list append per step,
  then `jnp.stack`); every op is a separate dispatch, so only a few repetitions are timed;
- the same loop over NumPy arrays.

The achieved bandwidth counts the bytes GAE must touch once: rewards, values and mask read,
advantages and returns written. It is compared with the copy bandwidth measured in the same run:
a NumPy `copyto` and a jitted elementwise `x + 1` (read + write), on a large array (main memory)
and on an array the size of GAE's working set (cache), the better of the two each time.

Usage:
  python experiments/benchmarks/gae.py --json results/gae.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_ppo import gae

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host import host_line, host_record  # noqa: E402
from rss import peak_rss_mib  # noqa: E402


def gae_python_loop(rewards, values, mask, *, gamma: float, lam: float):
  """The tutorial loop over jnp arrays, eager; `[B, T]` in, `(advantages, returns)` out."""
  mask = jnp.asarray(mask, jnp.float32)
  rewards = rewards * mask
  values = values * mask
  num_steps = rewards.shape[1]
  last_gae = jnp.zeros(rewards.shape[0], jnp.float32)
  reversed_advantages = []
  for t in reversed(range(num_steps)):
    if t < num_steps - 1:
      next_values, next_mask = values[:, t + 1], mask[:, t + 1]
    else:
      next_values, next_mask = 0.0, 0.0
    delta = rewards[:, t] + gamma * next_values * next_mask - values[:, t]
    last_gae = delta + gamma * lam * next_mask * last_gae
    reversed_advantages.append(last_gae)
  advantages = jnp.stack(reversed_advantages[::-1], axis=1) * mask
  return advantages, (advantages + values) * mask


def gae_numpy_loop(rewards, values, mask, *, gamma: float, lam: float):
  """The same loop over NumPy float32 arrays."""
  mask = np.asarray(mask, np.float32)
  rewards = rewards * mask
  values = values * mask
  num_steps = rewards.shape[1]
  advantages = np.zeros_like(rewards)
  last_gae = np.zeros(rewards.shape[0], np.float32)
  for t in reversed(range(num_steps)):
    if t < num_steps - 1:
      next_values, next_mask = values[:, t + 1], mask[:, t + 1]
    else:
      next_values, next_mask = np.float32(0.0), np.float32(0.0)
    delta = rewards[:, t] + np.float32(gamma) * next_values * next_mask - values[:, t]
    last_gae = delta + np.float32(gamma * lam) * next_mask * last_gae
    advantages[:, t] = last_gae
  advantages *= mask
  return advantages, (advantages + values) * mask


def make_inputs(batch: int, steps: int, mask_dtype: str, seed: int = 0):
  """Random rewards and values; each row's mask is a prefix of random length (1 to T)."""
  rng = np.random.default_rng(seed)
  rewards = rng.standard_normal((batch, steps), np.float32)
  values = rng.standard_normal((batch, steps), np.float32)
  lengths = rng.integers(1, steps + 1, size=batch)
  mask = (np.arange(steps)[None, :] < lengths[:, None]).astype(mask_dtype)
  return rewards, values, mask


def time_reps(fn, reps: int) -> list[float]:
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return times


def copy_bandwidth(nbytes: int, reps: int) -> dict[str, float]:
  """Best read+write bandwidth (bytes/s) of a NumPy copy and of a jitted `x + 1`."""
  n = max(nbytes // 4, 1)
  src = np.ones(n, np.float32)
  dst = np.empty_like(src)
  np.copyto(dst, src)
  numpy_s = min(time_reps(lambda: np.copyto(dst, src), reps))
  x = jnp.asarray(src)
  add_one = jax.jit(lambda a: a + 1.0)
  add_one(x).block_until_ready()
  jax_s = min(time_reps(lambda: add_one(x).block_until_ready(), reps))
  moved = 2 * n * 4
  return {"bytes": n * 4, "numpy_copy_Bps": moved / numpy_s, "jax_add_one_Bps": moved / jax_s,
          "best_Bps": max(moved / numpy_s, moved / jax_s)}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--steps", type=int, default=1024)
  p.add_argument("--gamma", type=float, default=1.0)
  p.add_argument("--lam", type=float, default=0.95)
  p.add_argument("--mask-dtype", choices=("bool", "float32"), default="bool")
  p.add_argument("--reps", type=int, default=50, help="repetitions of the jitted and NumPy cases")
  p.add_argument("--loop-reps", type=int, default=3, help="repetitions of the eager jnp loop")
  p.add_argument("--copy-mib", type=int, default=256, help="size of the large copy, MiB")
  p.add_argument("--json", metavar="PATH", default=None, help="write the results here")
  args = p.parse_args()

  rewards, values, mask = make_inputs(args.batch, args.steps, args.mask_dtype)
  kw = dict(gamma=args.gamma, lam=args.lam)
  elems = args.batch * args.steps
  # Read rewards, values (float32) and the mask; write advantages and returns (float32).
  gae_bytes = elems * (4 + 4 + mask.itemsize + 4 + 4)

  jr, jv, jm = (jnp.asarray(a) for a in (rewards, values, mask))
  jitted = jax.jit(functools.partial(gae, **kw))
  t0 = time.perf_counter()
  ref = jax.block_until_ready(jitted(jr, jv, jm))
  compile_s = time.perf_counter() - t0
  cases = {
      "jax_ppo.gae (jit, lax.scan)": (
          lambda: jax.block_until_ready(jitted(jr, jv, jm)), args.reps),
      "NumPy loop": (lambda: gae_numpy_loop(rewards, values, mask, **kw), args.reps),
      "Python loop over jnp (eager)": (
          lambda: jax.block_until_ready(gae_python_loop(jr, jv, jm, **kw)), args.loop_reps),
  }

  # All three agree (float32, different summation orders).
  outputs = {
      "NumPy loop": gae_numpy_loop(rewards, values, mask, **kw),
      "Python loop over jnp (eager)": gae_python_loop(jr, jv, jm, **kw),
  }
  agreement = {}
  for name, (adv, ret) in outputs.items():
    err = max(float(np.max(np.abs(np.asarray(adv) - np.asarray(ref[0])))),
              float(np.max(np.abs(np.asarray(ret) - np.asarray(ref[1])))))
    np.testing.assert_allclose(np.asarray(adv), np.asarray(ref[0]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ret), np.asarray(ref[1]), rtol=1e-4, atol=1e-4)
    agreement[name] = err
  print("agreement with jax_ppo.gae: max |diff| " + ", ".join(
      f"{k}: {v:.2e}" for k, v in agreement.items()))

  results = {}
  for name, (fn, reps) in cases.items():
    fn()  # Warm-up (the eager loop also fills JAX's per-op caches).
    times = time_reps(fn, reps)
    results[name] = {"reps": reps, "min_s": min(times), "median_s": statistics.median(times),
                     "bytes_per_s": gae_bytes / min(times)}

  bw_large = copy_bandwidth(args.copy_mib * 2**20, reps=5)
  bw_small = copy_bandwidth(gae_bytes, reps=args.reps)

  base = results["jax_ppo.gae (jit, lax.scan)"]["min_s"]
  print(f"\nGAE on [B={args.batch}, T={args.steps}] float32, mask {args.mask_dtype}, "
        f"gamma={args.gamma}, lam={args.lam}; {gae_bytes / 1e6:.2f} MB read+written; "
        f"jit compile {compile_s * 1e3:.0f} ms")
  print(f"{'implementation':32s} {'reps':>4} {'min ms':>10} {'median ms':>10} {'speed-up':>9} "
        f"{'GB/s':>7} {'% copy(RAM)':>11} {'% copy(cache)':>13}")
  for name, r in results.items():
    r["jax_ppo_speedup"] = r["min_s"] / base
    r["fraction_of_copy_bandwidth_ram"] = r["bytes_per_s"] / bw_large["best_Bps"]
    r["fraction_of_copy_bandwidth_cache"] = r["bytes_per_s"] / bw_small["best_Bps"]
    print(f"{name:32s} {r['reps']:4d} {r['min_s'] * 1e3:10.3f} {r['median_s'] * 1e3:10.3f} "
          f"{r['jax_ppo_speedup']:8.1f}x {r['bytes_per_s'] / 1e9:7.2f} "
          f"{100 * r['fraction_of_copy_bandwidth_ram']:10.1f}% "
          f"{100 * r['fraction_of_copy_bandwidth_cache']:12.1f}%")
  print("(speed-up = that implementation's time / jax_ppo.gae's time)")
  for label, bw in (("large", bw_large), ("GAE-sized", bw_small)):
    print(f"copy bandwidth, {label} ({bw['bytes'] / 2**20:.1f} MiB): NumPy copy "
          f"{bw['numpy_copy_Bps'] / 1e9:.2f} GB/s, jitted x+1 {bw['jax_add_one_Bps'] / 1e9:.2f} "
          f"GB/s (read+write)")
  print(f"peak RSS of this process: {peak_rss_mib():.0f} MiB")
  print(host_line())

  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    out = {
        "benchmark": "gae",
        "shape": [args.batch, args.steps],
        "gamma": args.gamma,
        "lam": args.lam,
        "mask_dtype": args.mask_dtype,
        "gae_bytes": gae_bytes,
        "jit_compile_s": compile_s,
        "results": results,
        "agreement_max_abs_diff": agreement,
        "copy_bandwidth_large": bw_large,
        "copy_bandwidth_gae_sized": bw_small,
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "host": host_record(),
        "platform": platform.platform(),
        "peak_rss_mib": peak_rss_mib(),
    }
    with open(args.json, "w") as f:
      json.dump(out, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
