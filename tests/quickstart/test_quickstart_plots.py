"""The quickstart's figures (`jax_ppo.quickstart.report`), drawn by `jax_ppo.logging.plots` from
a quickstart folder laid out as `jax_ppo.quickstart.stages` writes it: the headline figure shows
the gold score, the reward-model score with the reward-hacking gap shaded, and the KL."""

from __future__ import annotations

import numpy as np
import pytest

from jax_ppo.logging.plots import make_figure
from jax_ppo.quickstart import report
from jax_ppo.quickstart.stages import write_jsonl

pytest.importorskip("matplotlib")

EVAL_STEPS = [0, 10, 20, 30]
GOLD = [-0.16, 0.57, 0.84, 0.83]
RM = [-0.24, 1.24, 1.32, 1.39]
KL = [0.0, 3.1, 3.8, 3.6]


def _quickstart_folder(root, *, ppo=True):
  for folder in ("sft", "reward_model", "ppo"):
    (root / folder).mkdir(parents=True)
  write_jsonl(root / "sft" / "metrics.jsonl",
              [{"step": s, "train/loss": 6.0 / s, "train/perplexity": 400.0 / s}
               for s in range(1, 21)] + [{"step": 20, "eval/loss": 0.8}])
  write_jsonl(root / "reward_model" / "metrics.jsonl",
              [{"step": s, "train/accuracy": 0.5 + 0.02 * s} for s in range(1, 11)])
  records = [{"stage": "sft", "step": 20, "eval/loss": 0.8}]
  if ppo:
    write_jsonl(root / "ppo" / "metrics.jsonl",
                [{"step": s, "objective/scores": 0.04 * s, "objective/kl": 0.1 * s,
                  "policy/entropy_avg": 0.7, "rollout/response_length": 20.0}
                 for s in range(1, 31)])
    records += [{"stage": "ppo", "step": s, "gold/gold_score": g, "eval/score_mean": r,
                 "eval/kl": k, "eval/entropy": 0.6, "eval/response_length": 18.0}
                for s, g, r, k in zip(EVAL_STEPS, GOLD, RM, KL, strict=True)]
  write_jsonl(root / "metrics.jsonl", records)


def test_headline_figure_shows_gold_reward_model_gap_and_kl(tmp_path):
  from matplotlib.collections import PolyCollection

  _quickstart_folder(tmp_path)
  figures = report.figures(tmp_path)
  scores_ax, kl_ax = make_figure(figures[report.REWARD_KL_FILE]).axes
  lines = {line.get_label().split()[0]: line for line in scores_ax.get_lines()}
  gold, rm = lines["gold"], lines["reward-model"]
  np.testing.assert_allclose(gold.get_ydata(), GOLD)
  np.testing.assert_allclose(rm.get_ydata(), RM)
  np.testing.assert_allclose(gold.get_xdata(), EVAL_STEPS)
  (gap,) = [c for c in scores_ax.collections if isinstance(c, PolyCollection)]
  legend = [t.get_text() for t in scores_ax.get_legend().get_texts()]
  assert f"reward-hacking gap (RM - gold): {RM[-1] - GOLD[-1]:+.2f} at 30" in legend
  np.testing.assert_allclose(kl_ax.get_lines()[0].get_ydata(), KL)
  assert kl_ax.get_ylabel() == "nats per response"
  for ax in (scores_ax, kl_ax):
    assert ax.get_title() and ax.get_xlabel() == "update" and ax.get_ylabel()


def test_write_plots_writes_every_figure_and_skips_those_without_data(tmp_path):
  _quickstart_folder(tmp_path / "done")
  paths = report.write_plots(tmp_path / "done")
  assert [p.name for p in paths] == [name for name, _, _ in report.PLOTS] + [
      report.REWARD_KL_FILE, "overview.png"]
  assert all(p.parent == tmp_path / "done" / "plots" and p.stat().st_size > 0 for p in paths)
  overview = report.figures(tmp_path / "done")["overview.png"]
  assert len(overview) == len(report.PLOTS) + len(report.REWARD_KL)
  # Before PPO has run: the SFT and reward-model figures only.
  _quickstart_folder(tmp_path / "early", ppo=False)
  names = [p.name for p in report.write_plots(tmp_path / "early")]
  assert names == ["sft_loss.png", "rm_accuracy.png", "overview.png"]


def test_ppo_figures_read_rollouts_from_the_run_folder_and_evaluations_from_the_summary(tmp_path):
  _quickstart_folder(tmp_path)
  ((panel, series),) = report.figures(tmp_path)["ppo_kl.png"]
  rollouts, evaluation = series
  assert (rollouts.name, rollouts.smooth, len(rollouts.steps)) == ("objective/kl", True, 30)
  assert (evaluation.name, evaluation.smooth) == ("eval/kl", False)
  np.testing.assert_allclose(evaluation.values, KL)
  assert panel.ylabel == "nats per response"
