"""Wall time of PPO on CartPole-v1: jax_ppo's `make_train` against PureJaxRL's, side by side.

Times compile + run (`jax.jit(...).lower(...).compile()`, then one call, `block_until_ready`)
for 1 seed and for S vmapped seeds, with PureJaxRL's CartPole settings for both. PureJaxRL is
optional: pass `--purejaxrl PATH` to a local clone (the folder holding `purejaxrl/ppo.py`); it
is imported from there at run time, and nothing of it lives in this repository. The small
compatibility shims it needs with current libraries are applied here, in this process only:

- gymnax >= 1.0 returns `(obs, state, reward, terminated, truncated, info)` from `step`;
  PureJaxRL expects the older `(obs, state, reward, done, info)`, so its environment is wrapped
  to return `done = terminated | truncated` (which is what the old gymnax's `done` was);
- `purejaxrl/wrappers.py` imports brax and navix for unrelated wrappers: empty stand-in modules
  are registered when they are not installed;
- if distrax is not importable, a stand-in `distrax.Categorical` (sample, log_prob, entropy,
  computed the way distrax does) is registered, and the JSON records `"distrax": "stand-in"`.

Usage:
  python experiments/benchmarks/cartpole.py --purejaxrl /tmp/purejaxrl \
      --json results/cartpole/bench.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from jax_ppo.control import ControlPPOConfig, final_return, make_train

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host import host_line, host_record  # noqa: E402
from rss import peak_rss_mib  # noqa: E402

PUREJAXRL_CARTPOLE = {
    "LR": 2.5e-4,
    "NUM_ENVS": 4,
    "NUM_STEPS": 128,
    "TOTAL_TIMESTEPS": 5e5,
    "UPDATE_EPOCHS": 4,
    "NUM_MINIBATCHES": 4,
    "GAMMA": 0.99,
    "GAE_LAMBDA": 0.95,
    "CLIP_EPS": 0.2,
    "ENT_COEF": 0.01,
    "VF_COEF": 0.5,
    "MAX_GRAD_NORM": 0.5,
    "ACTIVATION": "tanh",
    "ENV_NAME": "CartPole-v1",
    "ANNEAL_LR": True,
    "DEBUG": False,
}


# ----------------------------------------------------------------------------------------------
# PureJaxRL loading and shims (runtime only).


class _DistraxCategorical:
  """Stand-in for `distrax.Categorical(logits=...)`, used only if distrax is not installed."""

  def __init__(self, logits):
    self.logits = logits

  def sample(self, *, seed):
    return jax.random.categorical(seed, self.logits)

  def log_prob(self, value):
    logp = jax.nn.log_softmax(self.logits)
    return jnp.sum(jax.nn.one_hot(value, logp.shape[-1]) * logp, axis=-1)

  def entropy(self):
    logp = jax.nn.log_softmax(self.logits)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


class _OldGymnaxStep:
  """Makes a gymnax >= 1.0 environment's `step` return the 5-tuple PureJaxRL unpacks."""

  def __init__(self, env):
    self._env = env

  def __getattr__(self, name):
    return getattr(self._env, name)

  def step(self, key, state, action, params=None):
    out = self._env.step(key, state, action, params)
    if len(out) == 6:
      obs, state, reward, terminated, truncated, info = out
      return obs, state, reward, jnp.logical_or(terminated, truncated), info
    return out


def _register_stand_ins() -> str:
  """Registers empty brax/navix modules and, if needed, a distrax stand-in; returns distrax's
  provenance ("distrax X.Y.Z" or "stand-in")."""
  if importlib.util.find_spec("brax") is None:
    names = ["brax", "brax.envs", "brax.envs.wrappers", "brax.envs.wrappers.training"]
    for name in names:
      sys.modules.setdefault(name, types.ModuleType(name))
    for parent, child in zip(names[:-1], names[1:], strict=True):
      setattr(sys.modules[parent], child.rsplit(".", 1)[1], sys.modules[child])
    training = sys.modules["brax.envs.wrappers.training"]
    training.EpisodeWrapper = training.AutoResetWrapper = None
  if importlib.util.find_spec("navix") is None:
    sys.modules.setdefault("navix", types.ModuleType("navix"))
  try:
    import distrax

    return f"distrax {distrax.__version__}"
  except ImportError:
    stand_in = types.ModuleType("distrax")
    stand_in.Categorical = _DistraxCategorical
    sys.modules["distrax"] = stand_in
    return "stand-in"


def load_purejaxrl(path: str):
  """Imports `PATH/purejaxrl/ppo.py` as a module; returns `(module, distrax provenance)`."""
  src = os.path.join(os.path.abspath(path), "purejaxrl")
  if not os.path.isfile(os.path.join(src, "ppo.py")):
    raise FileNotFoundError(f"--purejaxrl: no purejaxrl/ppo.py under {path!r}.")
  provenance = _register_stand_ins()
  sys.path.insert(0, src)
  spec = importlib.util.spec_from_file_location("purejaxrl_ppo", os.path.join(src, "ppo.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module, provenance


@contextlib.contextmanager
def _old_gymnax_step():
  import gymnax

  make = gymnax.make

  def patched(*args, **kwargs):
    env, params = make(*args, **kwargs)
    return _OldGymnaxStep(env), params

  gymnax.make = patched
  try:
    yield
  finally:
    gymnax.make = make


def purejaxrl_final_return(metrics, last_updates: int) -> np.ndarray:
  """The same figure as `jax_ppo.control.final_return`, from PureJaxRL's per-step info."""
  ret = np.asarray(metrics["returned_episode_returns"])  # [..., U, T, N]
  done = np.asarray(metrics["returned_episode"])
  axes = (-3, -2, -1)
  total = np.where(done, ret, 0.0)[..., -last_updates:, :, :].sum(axes)
  return total / done[..., -last_updates:, :, :].sum(axes)


# ----------------------------------------------------------------------------------------------
# Timing.


def time_compile_run(train_fn, num_seeds: int, seed: int = 0) -> dict[str, float]:
  """Compiles and runs `train_fn` once (vmapped over keys when `num_seeds > 1`)."""
  keys = jax.random.split(jax.random.PRNGKey(seed), num_seeds)
  fn, arg = (jax.vmap(train_fn), keys) if num_seeds > 1 else (train_fn, keys[0])
  c0, t0 = time.process_time(), time.perf_counter()
  compiled = jax.jit(fn).lower(arg).compile()
  c1, t1 = time.process_time(), time.perf_counter()
  out = jax.block_until_ready(compiled(arg))
  c2, t2 = time.process_time(), time.perf_counter()
  # Wall times are the benchmark; process CPU times (all threads) are less sensitive to other
  # processes sharing the machine and help to read noisy runs.
  return {
      "compile_s": t1 - t0,
      "run_s": t2 - t1,
      "total_s": t2 - t0,
      "compile_cpu_s": c1 - c0,
      "run_cpu_s": c2 - c1,
      "total_cpu_s": c2 - c0,
      "out": out,
  }


def bench_jax_ppo(config: ControlPPOConfig, num_seeds: int, last_updates: int) -> dict:
  r = time_compile_run(make_train(config), num_seeds)
  _, metrics = r.pop("out")
  r["final_return"] = np.atleast_1d(final_return(metrics, last_updates=last_updates)).tolist()
  return r


def bench_purejaxrl(module, config: dict, num_seeds: int, last_updates: int) -> dict:
  with _old_gymnax_step():
    train = module.make_train(dict(config))
  r = time_compile_run(train, num_seeds)
  out = r.pop("out")
  r["final_return"] = np.atleast_1d(
      purejaxrl_final_return(out["metrics"], last_updates)
  ).tolist()
  return r


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seeds", type=int, nargs="+", default=[1, 8],
                      help="numbers of vmapped seeds to time (1 = plain jit, no vmap)")
  parser.add_argument("--total-timesteps", type=int, default=500_000)
  parser.add_argument("--repeats", type=int, default=1,
                      help="repetitions of the whole set (interleaved), to see the noise")
  parser.add_argument("--last-updates", type=int, default=10,
                      help="final return = mean over episodes completed in the last N updates")
  parser.add_argument("--purejaxrl", metavar="PATH", default=None,
                      help="local clone of PureJaxRL to time side by side")
  parser.add_argument("--json", metavar="PATH", default=None, help="write the results here")
  args = parser.parse_args()

  config = ControlPPOConfig(total_timesteps=args.total_timesteps)
  pjrl_config = dict(PUREJAXRL_CARTPOLE, TOTAL_TIMESTEPS=float(args.total_timesteps))
  pjrl, provenance = (None, None)
  if args.purejaxrl:
    pjrl, provenance = load_purejaxrl(args.purejaxrl)

  # Warm-up, untimed: one tiny run of each starts the backend and fills JAX's tracing caches,
  # so that neither implementation pays those one-off costs for the other.
  tiny = config.batch_size
  bench_jax_ppo(dataclasses.replace(config, total_timesteps=tiny), 1, 1)
  if pjrl is not None:
    bench_purejaxrl(pjrl, dict(pjrl_config, TOTAL_TIMESTEPS=float(tiny)), 1, 1)

  runs = []
  for rep in range(args.repeats):
    for n in args.seeds:
      impls = [("jax_ppo", lambda n=n: bench_jax_ppo(config, n, args.last_updates))]
      if pjrl is not None:
        impls.append(
            ("purejaxrl", lambda n=n: bench_purejaxrl(pjrl, pjrl_config, n, args.last_updates))
        )
      if rep % 2:
        impls.reverse()  # Alternate the order between repeats.
      for name, fn in impls:
        r = fn()
        r.update(impl=name, seeds=n, repeat=rep)
        runs.append(r)
        print(
            f"[{rep}] {name:9s} seeds={n}: compile {r['compile_s']:6.2f} s  run "
            f"{r['run_s']:6.2f} s  total {r['total_s']:6.2f} s (cpu {r['total_cpu_s']:6.2f} s)"
            f"  final return "
            f"{np.mean(r['final_return']):6.1f}",
            flush=True,
        )

  summary = []
  for n in args.seeds:
    row = {"seeds": n}
    for name in ("jax_ppo", "purejaxrl"):
      mine = [r for r in runs if r["impl"] == name and r["seeds"] == n]
      if mine:
        totals = [r["total_s"] for r in mine]
        cpu = [r["total_cpu_s"] for r in mine]
        row[name] = {
            "min_total_s": min(totals),
            "median_total_s": statistics.median(totals),
            "min_total_cpu_s": min(cpu),
            "final_return_mean": float(np.mean([np.mean(r["final_return"]) for r in mine])),
        }
    if "purejaxrl" in row:
      row["ratio_min"] = row["jax_ppo"]["min_total_s"] / row["purejaxrl"]["min_total_s"]
      row["ratio_median"] = row["jax_ppo"]["median_total_s"] / row["purejaxrl"]["median_total_s"]
      row["ratio_cpu_min"] = (
          row["jax_ppo"]["min_total_cpu_s"] / row["purejaxrl"]["min_total_cpu_s"]
      )
    summary.append(row)

  print("\ncompile + run wall seconds, min / median over repeats (CPU seconds: min); "
        "ratio = jax_ppo / PureJaxRL")
  print(f"{'seeds':>5}  {'jax_ppo':>15} {'(cpu)':>7}  {'PureJaxRL':>15} {'(cpu)':>7}  "
        f"{'wall ratio':>13} {'cpu ratio':>9}")
  for row in summary:
    jp = row["jax_ppo"]
    pj = row.get("purejaxrl")
    pj_s = (f"{pj['min_total_s']:6.2f} /{pj['median_total_s']:6.2f} {pj['min_total_cpu_s']:7.2f}"
            if pj else f"{'-':>15} {'-':>7}")
    ratio = (f"{row['ratio_min']:5.2f} /{row['ratio_median']:5.2f} {row['ratio_cpu_min']:9.2f}"
             if pj else f"{'-':>13} {'-':>9}")
    print(f"{row['seeds']:>5}  {jp['min_total_s']:6.2f} /{jp['median_total_s']:6.2f} "
          f"{jp['min_total_cpu_s']:7.2f}  {pj_s}  {ratio}")
  print(f"peak RSS of this process (both implementations): {peak_rss_mib() / 1024:.2f} GiB")
  print(host_line())

  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    result = {
        "benchmark": "cartpole_ppo_compile_plus_run",
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "host": host_record(),
        "platform": platform.platform(),
        "jax_ppo_config": dataclasses.asdict(config),
        "purejaxrl_config": pjrl_config if pjrl is not None else None,
        "purejaxrl_path": args.purejaxrl,
        "distrax": provenance,
        "runs": runs,
        "summary": summary,
        "peak_rss_mib": peak_rss_mib(),
    }
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
