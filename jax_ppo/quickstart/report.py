"""Plots and the before/after table of the quickstart, read from its output folder."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

from jax_ppo.quickstart.stages import read_jsonl

# (file name, title, [(run sub-folder or "" for out/metrics.jsonl, stage filter, metric, label)])
PLOTS = (
    ("sft_loss.png", "SFT loss", [("sft", None, "train/loss", "train"),
                                  ("sft", None, "eval/loss", "held-out")]),
    ("rm_accuracy.png", "Reward-model accuracy", [
        ("reward_model", None, "train/accuracy", "train"),
        ("reward_model", None, "eval/accuracy", "held-out")]),
    ("ppo_reward.png", "PPO reward", [
        ("ppo", None, "objective/scores", "reward model (rollouts)"),
        ("", "ppo", "eval/score_mean", "reward model (eval)"),
        ("", "ppo", "gold/gold_score", "gold score (eval)")]),
    ("ppo_kl.png", "KL to the SFT model (nats per response)", [
        ("ppo", None, "objective/kl", "rollouts"), ("", "ppo", "eval/kl", "eval")]),
    ("ppo_entropy.png", "Policy entropy (nats per token)", [
        ("ppo", None, "policy/entropy_avg", "updates"),
        ("", "ppo", "eval/entropy", "eval (-log-prob of samples)")]),
    ("ppo_response_length.png", "Response length", [
        ("ppo", None, "response_length/mean", "tokens (rollouts)"),
        ("", "ppo", "gold/length_words", "words (eval)")]),
)

TABLE_ROWS = (
    ("gold score", "gold/gold_score", "+.3f"),
    ("reward-model score", "eval/score_mean", "+.3f"),
    ("KL to SFT (nats)", "eval/kl", ".3f"),
    ("distinct-2", "gold/distinct_2", ".3f"),
    ("repetition rate", "gold/repetition_rate", ".3f"),
    ("mean length (words)", "gold/length_words", ".1f"),
    ("mean length (tokens)", "eval/response_length", ".1f"),
)


def _series(out: pathlib.Path, folder: str, stage: str | None, metric: str):
  path = out / folder / "metrics.jsonl" if folder else out / "metrics.jsonl"
  points = [(r["step"], r[metric]) for r in read_jsonl(path)
            if metric in r and (stage is None or r.get("stage") == stage)]
  return [p[0] for p in points], [p[1] for p in points]


def write_plots(out: str | pathlib.Path) -> list[pathlib.Path]:
  """One PNG per entry of `PLOTS` in `out/plots/`, `overview.png` with every panel and
  `ppo_reward_kl.png`; returns the files written (a plot without data is skipped)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  out = pathlib.Path(out)
  (out / "plots").mkdir(parents=True, exist_ok=True)
  written = []
  fig_all, axes = plt.subplots(2, 3, figsize=(15, 8))
  for (name, title, lines), ax_all in zip(PLOTS, axes.flat, strict=True):
    fig, ax = plt.subplots(figsize=(5, 3.5))
    drawn = False
    for folder, stage, metric, label in lines:
      x, y = _series(out, folder, stage, metric)
      if not x:
        continue
      style = "o-" if folder == "" or len(x) < 20 else "-"
      for a in (ax, ax_all):
        a.plot(x, y, style, label=label, markersize=3)
      drawn = True
    for a in (ax, ax_all):
      a.set_title(title)
      a.set_xlabel("step")
      a.grid(alpha=0.3)
      if drawn:
        a.legend(fontsize=8)
    if drawn:
      fig.tight_layout()
      fig.savefig(out / "plots" / name, dpi=100)
      written.append(out / "plots" / name)
    plt.close(fig)
  fig_all.tight_layout()
  fig_all.savefig(out / "plots" / "overview.png", dpi=80)
  plt.close(fig_all)
  written.append(out / "plots" / "overview.png")
  path = _reward_kl_plot(out, plt)
  if path is not None:
    written.append(path)
  return written


def _reward_kl_plot(out: pathlib.Path, plt) -> pathlib.Path | None:
  """`plots/ppo_reward_kl.png`: gold and reward-model scores of the evaluations (left axis) and
  the KL to the SFT model (right axis), against PPO updates."""
  x, gold = _series(out, "", "ppo", "gold/gold_score")
  if not x:
    return None
  _, reward = _series(out, "", "ppo", "eval/score_mean")
  _, kl = _series(out, "", "ppo", "eval/kl")
  fig, ax = plt.subplots(figsize=(6, 3.8))
  ax.plot(x, gold, "o-", color="tab:green", label="gold score (not seen in training)")
  ax.plot(x, reward, "s-", color="tab:blue", label="reward model (normalised)")
  ax.set_xlabel("PPO update")
  ax.set_ylabel("score")
  ax.grid(alpha=0.3)
  ax2 = ax.twinx()
  ax2.plot(x, kl, "^--", color="tab:red", label="KL to SFT (nats)")
  ax2.set_ylabel("KL to SFT (nats per response)")
  handles = ax.get_legend_handles_labels()
  handles2 = ax2.get_legend_handles_labels()
  ax.legend(handles[0] + handles2[0], handles[1] + handles2[1], fontsize=8, loc="center right")
  ax.set_title("Quickstart PPO: evaluation samples")
  fig.tight_layout()
  path = out / "plots" / "ppo_reward_kl.png"
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


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
