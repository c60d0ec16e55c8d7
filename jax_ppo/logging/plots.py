"""PNG plots of a run folder's `metrics.jsonl`: reward, KL, entropy, response length, losses.

`write_plots(run_dir)` reads `run_dir/metrics.jsonl` (one `{"step", <metric>: value}` object per
line, as `MetricsLogger` writes it) and writes one PNG per panel of `PANELS` whose metrics are
present, into `run_dir/plots/`: PPO's reward (and each reward source's `reward/<name>`), KL to
the reference, entropy and response length; SFT's and the reward model's loss, accuracy and
perplexity. Panels with none of their metrics are skipped, so one function serves every stage.
`null` values (non-finite numbers) and unreadable lines are skipped.

matplotlib is imported lazily and used without pyplot (a bare `Figure`: no display, no global
state); without it `write_plots` raises `ImportError` naming the package to install.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Mapping, Sequence

PLOTS_DIR = "plots"
"""Sub-folder of a run folder that receives the PNG files."""

PANELS: Mapping[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "reward": ("Reward", ("objective/scores", "objective/rlhf_reward", "eval/score_mean"),
               ("reward/",)),
    "kl": ("KL to the reference", ("objective/kl", "eval/kl"), ()),
    "entropy": ("Entropy", ("objective/entropy", "policy/entropy_avg", "eval/entropy"), ()),
    "response_length": ("Response length (tokens)",
                        ("rollout/response_length", "eval/response_length"), ()),
    "loss": ("Loss", ("train/loss", "eval/loss"), ()),
    "accuracy": ("Accuracy", ("train/accuracy", "eval/accuracy"), ()),
    "perplexity": ("Perplexity", ("train/perplexity", "eval/perplexity"), ()),
}
"""File stem -> (title, metric names, metric-name prefixes) drawn as lines against the step.
Names ending in `_std` are never drawn from a prefix."""


def read_metrics(path: str | os.PathLike) -> dict[str, tuple[list[int], list[float]]]:
  """Metric name -> (steps, values) of a `metrics.jsonl` file, finite numbers only.

  Lines that are not JSON objects with an integer-valued "step" (a line cut short by a crash)
  are skipped.
  """
  series: dict[str, tuple[list[int], list[float]]] = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue
      if not isinstance(record, dict):
        continue
      step = record.get("step")
      if isinstance(step, bool) or not isinstance(step, int | float) or not math.isfinite(step):
        continue
      for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
          continue
        if not math.isfinite(value):
          continue
        steps, values = series.setdefault(key, ([], []))
        steps.append(int(step))
        values.append(float(value))
  return series


def panel_metrics(names: Sequence[str], panel: str) -> list[str]:
  """The metrics of `names` that panel `panel` of `PANELS` draws, in drawing order."""
  _, exact, prefixes = PANELS[panel]
  chosen = [n for n in exact if n in names]
  chosen += sorted(n for n in names if n not in chosen and not n.endswith("_std")
                   and any(n.startswith(p) for p in prefixes))
  return chosen


def write_plots(run_dir: str | os.PathLike, *, out_dir: str | os.PathLike | None = None
                ) -> list[pathlib.Path]:
  """Writes one PNG per panel with data from `run_dir/metrics.jsonl`; returns their paths.

  Args:
    run_dir: a run folder holding `metrics.jsonl`.
    out_dir: where the PNGs go (default `run_dir/plots`); created if missing.

  Raises:
    FileNotFoundError: `run_dir` has no `metrics.jsonl`.
    ImportError: matplotlib is not installed.
  """
  path = pathlib.Path(run_dir) / "metrics.jsonl"
  if not path.is_file():
    raise FileNotFoundError(f"{str(run_dir)!r} has no metrics.jsonl; pass a run folder written by "
                            "a training run (jax-ppo train, sft or reward).")
  try:
    from matplotlib.figure import Figure
  except ImportError as e:
    raise ImportError("Plots need matplotlib: pip install matplotlib.") from e
  series = read_metrics(path)
  out = pathlib.Path(out_dir) if out_dir is not None else pathlib.Path(run_dir) / PLOTS_DIR
  written = []
  for stem, (title, _, _) in PANELS.items():
    names = panel_metrics(list(series), stem)
    if not names:
      continue
    out.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(6.4, 4.0), dpi=100)  # no pyplot: no global state, thread-safe
    ax = fig.add_subplot()
    for name in names:
      steps, values = series[name]
      marker = "o" if len(steps) < 20 else None
      ax.plot(steps, values, label=name, marker=marker, markersize=3)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    target = out / f"{stem}.png"
    fig.savefig(target, format="png")
    written.append(target)
  return written


__all__ = ["PANELS", "PLOTS_DIR", "panel_metrics", "read_metrics", "write_plots"]
