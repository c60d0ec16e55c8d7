"""Plots and the before/after table of the quickstart, read from its output folder.

The figures say which series of which file to draw (`PLOTS`, `REWARD_KL`); the drawing (labels,
units, EMA, log scale, the shaded reward-hacking gap) is `jax_ppo.logging.plots`'.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

from jax_ppo.logging.plots import (
    OVERVIEW_FILE,
    PLOTS_DIR,
    Panel,
    Series,
    panel_series,
    read_metrics,
    write_figure,
)
from jax_ppo.quickstart.stages import read_jsonl

SOURCES = ("sft", "reward_model", "ppo")
"""Where a quickstart figure reads its metrics: the run folder `out/<source>/metrics.jsonl`;
for "ppo" also the evaluation records of `out/metrics.jsonl` (`eval/...`, `gold/...`)."""

PLOTS = (
    ("sft_loss.png", "sft", Panel(
        title="SFT cross-entropy loss", ylabel="nats per token",
        metrics=("train/loss", "eval/loss"),
        labels=(("train/loss", "train batches"), ("eval/loss", "held-out reviews")))),
    ("rm_accuracy.png", "reward_model", Panel(
        title="Reward-model preference accuracy", ylabel="fraction of pairs ranked right",
        metrics=("train/accuracy", "eval/accuracy"), scale="linear",
        labels=(("train/accuracy", "train batches"), ("eval/accuracy", "held-out pairs")))),
    ("ppo_reward.png", "ppo", Panel(
        title="PPO reward", ylabel="score (unitless)", xlabel="update",
        metrics=("objective/scores", "eval/score_mean", "gold/gold_score"),
        labels=(("objective/scores", "reward model (rollouts)"),
                ("eval/score_mean", "reward model (evaluation)"),
                ("gold/gold_score", "gold score (evaluation)")))),
    ("ppo_kl.png", "ppo", Panel(
        title="KL to the SFT model, per response", ylabel="nats per response", xlabel="update",
        metrics=("objective/kl", "eval/kl"),
        labels=(("objective/kl", "rollouts"), ("eval/kl", "evaluation samples")))),
    ("ppo_entropy.png", "ppo", Panel(
        title="Policy entropy, per token", ylabel="nats per token", xlabel="update",
        metrics=("policy/entropy_avg", "eval/entropy"),
        labels=(("policy/entropy_avg", "rollout tokens"),
                ("eval/entropy", "evaluation (-log-prob of the samples)")))),
    ("ppo_response_length.png", "ppo", Panel(
        title="Response length", ylabel="tokens", xlabel="update",
        metrics=("rollout/response_length", "eval/response_length"),
        labels=(("rollout/response_length", "rollouts"),
                ("eval/response_length", "evaluation samples")))),
)
"""(file name, source, panel) of the quickstart's one-panel figures in `out/plots/`."""

REWARD_KL_FILE = "ppo_reward_kl.png"
REWARD_KL = (
    Panel(title="Gold score and reward-model score of the evaluation samples",
          ylabel="score (unitless)", xlabel="update",
          metrics=("eval/score_mean", "gold/gold_score"), scale="linear",
          labels=(("eval/score_mean", "reward-model score (normalised on SFT samples)"),
                  ("gold/gold_score", "gold score (never seen in training)")),
          gap=("eval/score_mean", "gold/gold_score", "reward-hacking gap (RM - gold)")),
    Panel(title="KL to the SFT model of the evaluation samples", ylabel="nats per response",
          xlabel="update", metrics=("eval/kl",), scale="linear",
          labels=(("eval/kl", "KL to the SFT model"),)),
)
"""The two stacked panels of `ppo_reward_kl.png`, the quickstart's headline figure: the gold
and reward-model scores with the reward-hacking gap (reward-model score minus gold score)
shaded, above the KL to the SFT model that buys them."""


TABLE_ROWS = (
    ("gold score", "gold/gold_score", "+.3f"),
    ("reward-model score", "eval/score_mean", "+.3f"),
    ("KL to SFT (nats)", "eval/kl", ".3f"),
    ("distinct-2", "gold/distinct_2", ".3f"),
    ("repetition rate", "gold/repetition_rate", ".3f"),
    ("mean length (words)", "gold/length_words", ".1f"),
    ("mean length (tokens)", "eval/response_length", ".1f"),
)


def quickstart_metrics(out: str | pathlib.Path) -> dict[str, dict[str, tuple[list, list]]]:
  """Source (`SOURCES`) -> metric -> (steps, values) of the quickstart folder `out`; a source
  whose file is missing (its stage has not run) is empty."""
  out = pathlib.Path(out)

  def read(path: pathlib.Path, stage: str | None = None):
    return read_metrics(path, stage=stage) if path.is_file() else {}

  metrics = {source: read(out / source / "metrics.jsonl") for source in SOURCES}
  metrics["ppo"] = {**metrics["ppo"], **read(out / "metrics.jsonl", stage="ppo")}
  return metrics


def figures(out: str | pathlib.Path) -> dict[str, list[tuple[Panel, list[Series]]]]:
  """File name -> the `(panel, series)` of each quickstart figure with data in `out`: the
  entries of `PLOTS`, `ppo_reward_kl.png` (`REWARD_KL`, once PPO has evaluated) and
  `overview.png` with every panel of the others."""
  metrics = quickstart_metrics(out)
  found: dict[str, list[tuple[Panel, list[Series]]]] = {}
  for name, source, panel in PLOTS:
    series = panel_series(metrics[source], panel)
    if series:
      found[name] = [(panel, series)]
  headline = [(panel, panel_series(metrics["ppo"], panel)) for panel in REWARD_KL]
  if all(series for _, series in headline):
    found[REWARD_KL_FILE] = headline
  if found:
    found[OVERVIEW_FILE] = [drawn for panels in found.values() for drawn in panels]
  return found


def write_plots(out: str | pathlib.Path) -> list[pathlib.Path]:
  """Writes `figures(out)` as PNGs into `out/plots/`; returns the files written.

  Raises:
    ImportError: matplotlib is not installed.
  """
  layout = {REWARD_KL_FILE: {"panel_size": (7.0, 3.6)},
            OVERVIEW_FILE: {"ncols": 4, "panel_size": (5.0, 3.6), "dpi": 80}}
  return [write_figure(pathlib.Path(out) / PLOTS_DIR / name, panels, **layout.get(name, {}))
          for name, panels in figures(out).items()]


def ppo_evaluations(out: str | pathlib.Path) -> list[dict[str, Any]]:
  """The PPO evaluation records of `out/metrics.jsonl`, by step."""
  records = [r for r in read_jsonl(pathlib.Path(out) / "metrics.jsonl") if r.get("stage") == "ppo"]
  return sorted(records, key=lambda r: r["step"])


def before_after_table(before: dict[str, Any], after: dict[str, Any]) -> str:
  """A text table of the measured metrics before (step 0, the SFT policy) and after PPO."""
  header = (f"{'metric':<22} {'SFT (step ' + str(before['step']) + ')':>16} "
            f"{'PPO (step ' + str(after['step']) + ')':>16} {'change':>9}")
  lines = [header, "-" * len(header)]
  for label, key, fmt in TABLE_ROWS:
    b, a = before.get(key), after.get(key)
    if b is None or a is None:
      continue
    lines.append(f"{label:<22} {format(b, fmt):>16} {format(a, fmt):>16} "
                 f"{format(a - b, '+.3f'):>9}")
  return "\n".join(lines)


def example_generations(out: str | pathlib.Path, before_step: int, after_step: int, *,
                        n: int = 4, width: int = 100) -> str:
  """The first `n` evaluation prompts with their responses before and after, and gold scores."""
  samples = [r for r in read_jsonl(pathlib.Path(out) / "samples.jsonl") if r["stage"] == "ppo"]
  before = [r for r in samples if r["step"] == before_step][:n]
  after = [r for r in samples if r["step"] == after_step][:n]
  lines = []
  for b, a in zip(before, after, strict=False):
    lines.append(f"{b['prompt']}")
    for tag, r in (("SFT", b), ("PPO", a)):
      text = r["response"].strip().replace("\n", " ")
      text = text if len(text) <= width else text[:width - 3] + "..."
      lines.append(f"  {tag} (gold {r['gold']:+.2f}): {text}")
  return "\n".join(lines)


def verdict(before: dict[str, Any], after: dict[str, Any]) -> Sequence[str]:
  """Plain statements of what the measured numbers show (no thresholds are hidden: each line
  says the comparison it makes)."""
  gain = after["gold/gold_score"] - before["gold/gold_score"]
  spread = before.get("gold/score_std", 0.0) / max(before.get("eval/samples", 64), 1) ** 0.5
  lines = [
      f"gold score {before['gold/gold_score']:+.3f} -> {after['gold/gold_score']:+.3f} "
      f"({gain:+.3f}; {gain / spread if spread else float('inf'):.1f} standard errors of the "
      "SFT mean)",
      f"KL to the SFT model {after['eval/kl']:.2f} nats per response",
      f"distinct-2 {before['gold/distinct_2']:.3f} -> {after['gold/distinct_2']:.3f}, "
      f"repetition rate {before['gold/repetition_rate']:.3f} -> "
      f"{after['gold/repetition_rate']:.3f}, length {before['gold/length_words']:.1f} -> "
      f"{after['gold/length_words']:.1f} words",
  ]
  return lines
