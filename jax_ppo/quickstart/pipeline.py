"""`run_quickstart`: the five stages in order, resumable, timed, with plots and a closing table."""

from __future__ import annotations

import json
import os
import pathlib
import time
from collections.abc import Callable
from typing import Any

from jax_ppo.compile_cache import AUTO as AUTO_CACHE
from jax_ppo.compile_cache import enable_compilation_cache
from jax_ppo.config_io import with_defaults
from jax_ppo.quickstart import report, stages
from jax_ppo.quickstart.config import QuickstartConfig


def _check_config(cfg: QuickstartConfig, out: pathlib.Path) -> None:
  """Writes `out/config.json`, or refuses to resume a folder made with another configuration."""
  path = out / "config.json"
  record = stages.config_record(cfg)
  if path.exists():
    old = with_defaults(QuickstartConfig, json.loads(path.read_text()))  # fields added since
    diff = sorted(k for k in set(old) | set(record) if old.get(k) != record.get(k))
    if diff:
      details = ", ".join(f"{k}: {old.get(k)!r} -> {record.get(k)!r}" for k in diff)
      raise ValueError(
          f"{path} was written by a run with another configuration ({details}); resume with the "
          "same flags, or pass another --out (or delete the folder) to start afresh."
      )
    return
  out.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(record, indent=2) + "\n")


def run_quickstart(
    cfg: QuickstartConfig,
    out: str | os.PathLike,
    *,
    progress: bool = True,
    log: Callable[[str], Any] = print,
    compilation_cache_dir: str | os.PathLike | None = AUTO_CACHE,
) -> dict[str, Any]:
  """Runs the stages that are not done yet in `out` and reports.

  Returns a summary: `before` and `after` (the PPO evaluation records at step 0 and at the last
  step: gold score, reward-model score, KL, distinct-2, repetition rate, lengths), `table` (the
  printed before/after table), `timings` (wall seconds per stage in this invocation; stages
  already done only load their results, and are listed in `skipped`), `cpu_s` (CPU seconds
  of this process per stage) and `plots` (PNG paths).

  `compilation_cache_dir` is the folder of JAX's persistent compilation cache, so that a rerun
  loads its compiled programs: "auto" (the default, `~/.cache/jax_ppo/xla`), a path, or None or
  "off" (`jax_ppo.compile_cache`).
  """
  out = pathlib.Path(out)
  _check_config(cfg, out)
  enable_compilation_cache(compilation_cache_dir)  # before anything compiles
  timings: dict[str, float] = {}
  cpu: dict[str, float] = {}  # CPU seconds of this process (all threads) per stage
  skipped: list[str] = []

  def timed(name: str, fn, *args, **kwargs):
    log(f"== stage {name}")
    t0, c0 = time.perf_counter(), time.process_time()
    result = fn(*args, **kwargs)
    timings[name] = round(time.perf_counter() - t0, 1)
    cpu[name] = round(time.process_time() - c0, 1)
    return result

  tok, train, held, done = timed("data", stages.stage_data, cfg, out)
  if done:
    skipped.append("data")
  log(f"   {len(train)} train / {len(held)} held-out reviews, BPE vocabulary {len(tok)}")
  sft_hf, sft_metrics = timed("sft", stages.stage_sft, cfg, out, tok, train, held,
                              progress=progress)
  if sft_metrics is None:
    skipped.append("sft")
  else:
    log(f"   SFT held-out loss {sft_metrics['eval/loss']:.3f} (perplexity "
        f"{sft_metrics['eval/perplexity']:.2f})")
  pairs_train, pairs_eval, sft_samples, done = timed("pairs", stages.stage_pairs, cfg, out, tok,
                                                     sft_hf, progress=progress)
  if done:
    skipped.append("pairs")
  log(f"   {len(pairs_train)} train / {len(pairs_eval)} held-out preference pairs")
  rm_hf, rm_metrics = timed("reward_model", stages.stage_reward, cfg, out, tok, sft_hf,
                            pairs_train, pairs_eval, sft_samples, progress=progress)
  if rm_metrics is None:
    skipped.append("reward_model")
  else:
    log(f"   reward model held-out accuracy {rm_metrics['eval/accuracy']:.3f}; normalisation "
        f"gain {rm_metrics['normalisation/gain']:.3f} bias {rm_metrics['normalisation/bias']:+.3f}")
    probes = {k.split("/")[1]: v for k, v in rm_metrics.items() if k.startswith("hack_probe/")}
    if probes:
      log("   share of positive SFT samples whose degenerate rewrite the reward model prefers: "
          + ", ".join(f"{k} {v:.2f}" for k, v in probes.items()))
  if (out / "ppo" / "hf" / "config.json").exists():
    skipped.append("ppo")
  policy_hf = timed("ppo", stages.stage_ppo, cfg, out, tok, sft_hf, rm_hf, progress=progress,
                    log=log)
  t0 = time.perf_counter()
  try:
    plots = report.write_plots(out)
  except ImportError as e:  # matplotlib is an optional dependency (the "experiments" extra)
    plots = []
    log(f"No plots: {e}. Install matplotlib (pip install 'jax_ppo[experiments]') and run the "
        "same command again to write them.")
  timings["plots"] = round(time.perf_counter() - t0, 1)
  with (out / "timings.json").open("a") as f:
    f.write(json.dumps({"timings_s": timings, "cpu_s": cpu, "skipped": skipped}) + "\n")

  evals = report.ppo_evaluations(out)
  before, after = evals[0], evals[-1]
  table = report.before_after_table(before, after)
  summary = {
      "before": before, "after": after, "table": table, "timings": timings, "cpu_s": cpu,
      "skipped": skipped, "plots": [str(p) for p in plots], "policy": str(policy_hf),
      "reward_model": str(rm_hf), "sft_policy": str(sft_hf),
  }
  (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  log("")
  log("Example generations (same prompts and sampling keys before and after PPO):")
  log(report.example_generations(out, before["step"], after["step"]))
  log("")
  log(f"Before/after PPO, {cfg.eval_samples} sampled responses each, measured by this run:")
  log(table)
  for line in report.verdict(before, after):
    log(f"  {line}")
  log("")
  log("Stage times (s): " + ", ".join(f"{k} {v}" for k, v in timings.items())
      + (f" (skipped, already done: {', '.join(skipped)})" if skipped else ""))
  log("CPU seconds (all threads): " + ", ".join(f"{k} {v}" for k, v in cpu.items()))
  log(f"Policy: {policy_hf}   plots: {out / 'plots'}")
  return summary
