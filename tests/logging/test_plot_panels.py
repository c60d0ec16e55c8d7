"""The drawing rules of `jax_ppo.logging.plots`: which panel draws which metric (per-token and
per-response quantities apart), the EMA against a NumPy reference, the log-scale rule, and the
labels, smoothing and gap on the matplotlib Axes themselves (no pixels)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jax_ppo.logging.plots import (
    EMA_WEIGHT,
    LOG_SPAN,
    MARKERS_BELOW,
    MIN_POINTS_TO_SMOOTH,
    PANELS,
    Panel,
    detect_stage,
    ema,
    make_figure,
    panel_metrics,
    panel_series,
    use_log_scale,
)

pytest.importorskip("matplotlib")

PER_TOKEN = {"policy/entropy_avg", "eval/entropy", "policy/approxkl_avg", "loss/kl_avg",
             "objective/kl / rollout/response_length", "eval/kl / eval/response_length",
             "train/perplexity", "eval/perplexity"}
PER_RESPONSE = {"objective/entropy", "objective/kl", "eval/kl", "logps/chosen", "logps/rejected"}


def _ema_reference(x, w):
  """s_t = sum_i w^(t-i) (1-w) x_i / (1 - w^(t+1)), as one matrix product."""
  x = np.asarray(x, np.float64)
  t = np.arange(len(x))
  lag = t[:, None] - t[None, :]
  weights = np.where(lag >= 0, w ** np.maximum(lag, 0), 0.0) * (1 - w)
  return weights @ x / (1 - w ** (t + 1))


def _series(steps, values):
  return np.asarray(steps, np.float64), np.asarray(values, np.float64)


def test_per_token_and_per_response_quantities_never_share_a_panel():
  ppo = PANELS["ppo"]
  names = ["policy/entropy_avg", "eval/entropy", "objective/entropy", "objective/kl", "eval/kl",
           "rollout/response_length", "eval/response_length"]
  assert panel_metrics(names, ppo["entropy_per_token"]) == ["policy/entropy_avg", "eval/entropy"]
  assert panel_metrics(names, ppo["entropy_per_response"]) == ["objective/entropy"]
  assert panel_metrics(names, ppo["kl_per_response"]) == ["objective/kl", "eval/kl"]
  assert panel_metrics(names, ppo["kl_per_token"]) == []  # ratios only
  for stage, panels in PANELS.items():
    for stem, panel in panels.items():
      drawn = {*panel.metrics, *(f"{a} / {b}" for a, b in panel.ratios)}
      assert not (drawn & PER_TOKEN and drawn & PER_RESPONSE), (stage, stem)
      if drawn & PER_TOKEN:
        assert "per token" in panel.ylabel, (stage, stem)
      if drawn & PER_RESPONSE:
        assert "per response" in panel.ylabel, (stage, stem)


def test_kl_per_token_is_the_summed_kl_over_the_response_length_at_matching_steps():
  series = {"objective/kl": _series([1, 2, 3], [4.0, 6.0, 9.0]),
            "rollout/response_length": _series([1, 3, 4], [8.0, 0.0, 5.0]),
            "eval/kl": _series([0, 2], [1.0, 3.0]),
            "eval/response_length": _series([0, 2], [10.0, 12.0])}
  lines = panel_series(series, PANELS["ppo"]["kl_per_token"])
  assert [s.name for s in lines] == ["objective/kl / rollout/response_length",
                                     "eval/kl / eval/response_length"]
  np.testing.assert_allclose(lines[0].steps, [1])  # step 3 has length 0, steps 2 and 4 one half
  np.testing.assert_allclose(lines[0].values, [0.5])
  np.testing.assert_allclose(lines[1].values, [0.1, 0.25])
  assert not lines[1].smooth  # evaluation rows are drawn unsmoothed


@pytest.mark.parametrize(("names", "stage"), [
    (["objective/kl", "lr"], "ppo"),
    (["train/loss", "train/perplexity", "train/grad_norm"], "sft"),
    (["train/loss", "train/accuracy", "train/margin"], "reward_model"),
    (["train/loss", "rewards/accuracies", "logps/chosen"], "dpo"),
    (["train/loss", "eval/rewards/margins"], "dpo"),
    (["time/total_s", "lr"], None),
])
def test_detect_stage(names, stage):
  assert detect_stage(names) == stage


@given(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=40), st.floats(0.0, 0.99))
def test_ema_matches_numpy_reference(values, weight):
  np.testing.assert_allclose(ema(values, weight), _ema_reference(values, weight), rtol=1e-9,
                             atol=1e-9)


def test_ema_properties_and_log_mode():
  x = np.array([100.0, 10.0, 1.0, 0.1, 0.01, 0.001])
  np.testing.assert_allclose(ema(x, 0.0), x)
  np.testing.assert_allclose(ema(np.full(7, 3.5)), 3.5)
  assert ema(x)[0] == x[0]
  np.testing.assert_allclose(ema(x, 0.5, log=True), 10.0 ** _ema_reference(np.log10(x), 0.5))
  assert EMA_WEIGHT == 0.8
  for bad in (1.0, -0.1):
    with pytest.raises(ValueError, match=f"weight={bad} is invalid"):
      ema(x, bad)
  with pytest.raises(ValueError, match="log=True needs positive values"):
    ema([1.0, 0.0], log=True)


def test_log_scale_only_when_values_span_decades():
  assert use_log_scale([[1000.0, 100.0, 10.0, 1.0]])
  assert use_log_scale([[2.0, 1.0], [LOG_SPAN * 1.01]])  # the span of the whole panel counts
  assert not use_log_scale([[2.0, LOG_SPAN * 1.99]])
  assert not use_log_scale([[0.5, 0.6, 0.7]])
  assert not use_log_scale([[1000.0, -1.0, 0.01]])  # a non-positive value: linear
  assert not use_log_scale([[1000.0, 0.0]])
  assert use_log_scale([[20.0, 18.0]], "log")  # perplexity's panel asks for it
  assert not use_log_scale([[1000.0, 0.001]], "linear")
  assert not use_log_scale([], "log")
  with pytest.raises(ValueError, match="scale='symlog' is invalid"):
    use_log_scale([[1.0]], "symlog")


def test_axes_are_labelled_smoothed_and_scaled_from_the_data():
  steps = np.arange(1, 31)
  falling = 50.0 * np.exp(-0.25 * steps)  # spans three decades
  series = {"train/loss": (steps, falling), "eval/loss": ([10, 20, 30], [0.5, 0.1, 0.02]),
            "train/perplexity": (steps, np.exp(falling)), "train/accuracy": (steps, steps / 31)}
  sft = PANELS["sft"]
  accuracy = PANELS["reward_model"]["accuracy"]
  drawn = [(sft["loss"], panel_series(series, sft["loss"])),
           (sft["perplexity"], panel_series(series, sft["perplexity"])),
           (accuracy, panel_series(series, accuracy))]
  fig = make_figure(drawn, ncols=2)
  loss_ax, ppl_ax, acc_ax, spare = fig.axes
  assert not spare.get_visible()
  for ax, title, unit in ((loss_ax, "Cross-entropy loss", "nats per token"),
                          (ppl_ax, "Perplexity (e^loss)", "perplexity (per token)"),
                          (acc_ax, "Preference accuracy", "fraction of pairs ranked right")):
    assert ax.get_title() == title and ax.get_xlabel() == "step"
    assert ax.get_ylabel().startswith(unit)
  assert loss_ax.get_yscale() == "log" and loss_ax.get_ylabel().endswith(", log scale")
  assert ppl_ax.get_yscale() == "log"
  assert acc_ax.get_yscale() == "linear" and "log" not in acc_ax.get_ylabel()
  legend = [t.get_text() for t in loss_ax.get_legend().get_texts()]
  assert legend == ["train/loss", "eval/loss"]
  legend_title = loss_ax.get_legend().get_title().get_text()
  assert legend_title == f"lines: EMA (weight {EMA_WEIGHT}), dots: raw"
  # train/loss: faint raw dots, then the EMA (of log10, on this log axis) as the line;
  # eval/loss: 3 points joined by a line, unsmoothed.
  raw, smooth, evaluation = loss_ax.get_lines()
  assert raw.get_linestyle() == "None" and raw.get_alpha() == 0.25
  np.testing.assert_allclose(raw.get_ydata(), falling)
  np.testing.assert_allclose(smooth.get_ydata(),
                             10.0 ** _ema_reference(np.log10(falling), EMA_WEIGHT))
  assert smooth.get_label() == "train/loss" and smooth.get_linestyle() == "-"
  np.testing.assert_allclose(evaluation.get_ydata(), [0.5, 0.1, 0.02])
  assert evaluation.get_marker() == "o" and evaluation.get_linestyle() == "-"
  acc_smooth = acc_ax.get_lines()[1]  # linear axis: the EMA of the values themselves
  np.testing.assert_allclose(acc_smooth.get_ydata(), _ema_reference(steps / 31, EMA_WEIGHT))


def test_short_series_and_schedules_are_not_smoothed():
  panel = Panel(title="t", ylabel="y", metrics=("a",))
  short = panel_series({"a": (range(MIN_POINTS_TO_SMOOTH - 1), [1.0] * 7)}, panel)
  long = panel_series({"a": (range(MIN_POINTS_TO_SMOOTH), [1.0] * 8)}, panel)
  assert not short[0].smooth and long[0].smooth
  ax = make_figure([(panel, short)]).axes[0]
  assert len(ax.get_lines()) == 1 and ax.get_legend().get_title().get_text() == ""
  assert ax.get_lines()[0].get_marker() == "o"
  schedule = np.linspace(1e-3, 0.0, MARKERS_BELOW)
  lr = panel_series({"lr": (range(MARKERS_BELOW), schedule)}, PANELS["sft"]["learning_rate"])
  assert not lr[0].smooth
  (line,) = make_figure([(PANELS["sft"]["learning_rate"], lr)]).axes[0].get_lines()
  np.testing.assert_allclose(line.get_ydata(), schedule)  # exact, no lag
  assert line.get_marker() == "None"  # too many points to mark each


def test_the_gap_between_two_series_is_shaded_and_its_last_value_given():
  from matplotlib.collections import PolyCollection

  panel = Panel(title="Scores", ylabel="score (unitless)", xlabel="update",
                metrics=("rm", "gold"), labels=(("rm", "reward model"), ("gold", "gold")),
                gap=("rm", "gold", "reward-hacking gap"))
  series = {"rm": ([0, 10, 20], [0.0, 1.2, 1.5]), "gold": ([0, 10, 20], [-0.2, 0.5, 0.6])}
  ax = make_figure([(panel, panel_series(series, panel))]).axes[0]
  fills = [c for c in ax.collections if isinstance(c, PolyCollection)]
  assert len(fills) == 1
  legend = [t.get_text() for t in ax.get_legend().get_texts()]
  assert legend == ["reward model", "gold", "reward-hacking gap: +0.90 at 20"]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"title": "", "ylabel": "y", "metrics": ("a",)}, "Panel.title='' is invalid"),
    ({"title": "t", "ylabel": "", "metrics": ("a",)}, "Panel.ylabel='' is invalid"),
    ({"title": "t", "ylabel": "y", "metrics": ("a",), "scale": "symlog"},
     "Panel.scale='symlog' is invalid"),
    ({"title": "t", "ylabel": "y"}, "draws nothing"),
    ({"title": "t", "ylabel": "y", "metrics": ("a",), "gap": ("a", "b", "g")},
     "Panel.gap=.* is invalid"),
])
def test_panel_errors_name_the_field(kwargs, match):
  with pytest.raises(ValueError, match=match):
    Panel(**kwargs)
