"""PPO on gymnax CartPole-v1 with jax_ppo's core functions, one agent per seed (vmapped).

This file is intentionally kept short: the training code is `jax_ppo.control.ppo`. It compiles
one `train(rng)` for all seeds, prints progress and a final table, and writes a learning-curve
PNG and a JSON of the results to `--out` (default `results/cartpole/`).

Usage:
  python experiments/cartpole_ppo.py                      # 8 seeds, 5e5 steps each
  python experiments/cartpole_ppo.py --seeds 2 --total-timesteps 50000 --log-every 20
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import numpy as np

from jax_ppo.control import ControlPPOConfig, final_return, make_train, return_curve

SOLVED = 475.0  # CartPole-v1's reward threshold (episodes are capped at 500 steps).


def parse_args() -> argparse.Namespace:
  defaults = ControlPPOConfig()
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--seeds", type=int, default=8, help="agents trained in parallel (vmapped)")
  p.add_argument("--seed", type=int, default=0, help="base PRNG seed")
  p.add_argument("--total-timesteps", type=int, default=defaults.total_timesteps)
  p.add_argument("--lr", type=float, default=defaults.lr)
  p.add_argument("--num-envs", type=int, default=defaults.num_envs)
  p.add_argument("--num-steps", type=int, default=defaults.num_steps)
  p.add_argument("--last-updates", type=int, default=10,
                 help="final return = mean over episodes completed in the last N updates")
  p.add_argument("--log-every", type=int, default=0,
                 help="print live progress every N updates from inside the compiled run "
                 "(one line per seed); 0 prints the progress table after the run")
  p.add_argument("--out", default="results/cartpole", help="folder for the PNG and JSON")
  return p.parse_args()


def main() -> None:
  args = parse_args()
  config = ControlPPOConfig(
      total_timesteps=args.total_timesteps,
      lr=args.lr,
      num_envs=args.num_envs,
      num_steps=args.num_steps,
      log_every=args.log_every,
  )
  print(f"PPO on {config.env_name}: {args.seeds} seeds x {config.num_updates} updates of "
        f"{config.batch_size} steps ({jax.default_backend()})", flush=True)
  keys = jax.random.split(jax.random.key(args.seed), args.seeds)
  t0 = time.perf_counter()
  compiled = jax.jit(jax.vmap(make_train(config))).lower(keys).compile()
  t1 = time.perf_counter()
  _, metrics = jax.block_until_ready(compiled(keys))
  t2 = time.perf_counter()
  metrics = jax.device_get(metrics)
  print(f"compile {t1 - t0:.1f} s, run {t2 - t1:.1f} s", flush=True)

  curve = return_curve(metrics, window=args.last_updates)  # [S, U]
  steps = np.asarray(metrics["timestep"][0])
  print("\nprogress (mean return over seeds of episodes in the trailing "
        f"{args.last_updates} updates)")
  print(f"{'step':>9}  {'mean':>7}  {'min':>7}  {'max':>7}")
  for u in np.linspace(args.last_updates - 1, config.num_updates - 1, 11).astype(int):
    col = curve[:, u]
    print(f"{steps[u]:9d}  {np.nanmean(col):7.1f}  {np.nanmin(col):7.1f}  {np.nanmax(col):7.1f}")

  finals = final_return(metrics, last_updates=args.last_updates)
  episodes = np.asarray(metrics["episodes"])[:, -args.last_updates:].sum(-1)
  print(f"\nfinal return (episodes completed in the last {args.last_updates} updates)")
  print(f"{'seed':>4}  {'return':>7}  {'episodes':>8}")
  for s, (r, n) in enumerate(zip(finals, episodes, strict=True)):
    print(f"{s:4d}  {r:7.1f}  {n:8d}")
  mean = float(np.mean(finals))
  print(f"mean  {mean:7.1f}  (std {np.std(finals):.1f}; solved >= {SOLVED:g}: "
        f"{'yes' if mean >= SOLVED else 'no'})")

  os.makedirs(args.out, exist_ok=True)
  png = os.path.join(args.out, "cartpole_ppo.png")
  plot(steps, curve, png, title=f"jax_ppo PPO on {config.env_name}, {args.seeds} seeds")
  result = {
      "env_name": config.env_name,
      "config": dataclasses.asdict(config),
      "seeds": args.seeds,
      "base_seed": args.seed,
      "last_updates": args.last_updates,
      "final_return_per_seed": finals.tolist(),
      "final_return_mean": mean,
      "solved_threshold": SOLVED,
      "compile_s": t1 - t0,
      "run_s": t2 - t1,
      "jax_version": jax.__version__,
      "backend": jax.default_backend(),
      "curve_timestep": steps.tolist(),
      "curve_return_per_seed": np.where(np.isnan(curve), None, curve).tolist(),
  }
  path = os.path.join(args.out, "cartpole_ppo.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  print(f"wrote {png} and {path}")


def plot(steps: np.ndarray, curve: np.ndarray, path: str, *, title: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.5))
  for s, row in enumerate(curve):
    ax.plot(steps, row, lw=0.7, alpha=0.5, label="per seed" if s == 0 else None)
  ax.plot(steps, np.nanmean(curve, axis=0), color="k", lw=2, label="mean over seeds")
  ax.axhline(SOLVED, color="r", ls="--", lw=1, label=f"solved ({SOLVED:g})")
  ax.set(xlabel="environment steps (per seed)", ylabel="episode return", title=title)
  ax.grid(alpha=0.3)
  ax.legend(loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  main()
