"""PNG plots of training metrics: the one drawing code of run folders and the quickstart.

`write_plots(run_dir)` reads `run_dir/metrics.jsonl` (one `{"step", <metric>: value}` object per
line, as `MetricsLogger` writes it), recognises the stage that wrote it from its metric names
(`detect_stage`: PPO, SFT, reward model or DPO) and writes into `run_dir/plots/` one PNG per
panel of `PANELS[stage]` with data, plus `overview.png` with all of them in one grid.

Every panel has a title, an x label ("update" for PPO, "step" for the other stages) and a y
label with the unit (nats per token, nats per response, tokens, fraction of pairs, ...).
Per-token and per-response quantities never share an axis: PPO's entropy per token
(`policy/entropy_avg`) and per response (`objective/entropy`, the summed `-log pi` of the
sampled tokens) get two panels, as do its KL per response (`objective/kl`) and per token
(`objective/kl / rollout/response_length`, the mean KL over all response tokens).

How a series is drawn:

* Training series with at least `MIN_POINTS_TO_SMOOTH` points: the raw values as faint dots and
  an exponential moving average (`ema`, weight `EMA_WEIGHT`) as the line. Evaluation series
  (`eval/...`, `gold/...`: each point already averages a held-out set), short series and the
  panels of exact schedules (`Panel.smooth=False`: the learning rate): their points joined by a
  line, unsmoothed.
* The y axis is logarithmic when the panel asks for it (`Panel.scale="log"`: perplexity, which
  is `e^loss`) or, with `scale="auto"`, when every value on the panel is positive and the largest
  is more than `LOG_SPAN` times the smallest (`use_log_scale`); on a log axis the EMA averages
  `log10` of the values.

`Panel`, `Series`, `panel_series`, `draw_panel`, `make_figure` and `write_figure` are the
building blocks: the quickstart (`jax_ppo.quickstart.report`) only says which series of its
output folder each of its figures shows, and draws them with these.

matplotlib is imported lazily and used without pyplot (a bare `Figure`: no display, no global
state); without it `write_plots` and `write_figure` raise `ImportError` naming the package.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

PLOTS_DIR = "plots"
"""Sub-folder of a run folder that receives the PNG files."""

OVERVIEW_FILE = "overview.png"
"""File name of the grid with every panel of a run."""

EMA_WEIGHT = 0.8
"""Weight `w` of the exponential moving average drawn over training series: each point moves
the line by `1 - w` of its distance, so it averages over about `1 / (1 - w) = 5` points (its
half-life is `ln 2 / -ln w`, about 3 points). TensorBoard's smoothing slider with value 0.8."""

MIN_POINTS_TO_SMOOTH = 8
"""Series with fewer points are drawn unsmoothed (points joined by a line)."""

LOG_SPAN = 30.0
"""With `scale="auto"`, a panel whose values are all positive and span more than this factor
(`max / min > LOG_SPAN`, about one and a half decades) gets a logarithmic y axis."""

MARKERS_BELOW = 40
"""An unsmoothed series with fewer points marks each point; a longer one is a plain line."""

UNSMOOTHED_PREFIXES = ("eval/", "gold/")
"""Metric-name prefixes of evaluation series, drawn unsmoothed: each point already averages a
held-out set."""

SCALES = ("auto", "linear", "log")
"""The values of `Panel.scale`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Panel:
  """One axes: which metrics it draws and how it is labelled.

  Metric names are those of `metrics.jsonl`; a series' legend label is its metric name unless
  `labels` names another.
  """

  title: str
  """Axes title: what the quantity is."""
  ylabel: str
  """Y label with the unit ("nats per token", "tokens", "fraction of pairs", ...)."""
  xlabel: str = "step"
  """X label: "update" (PPO updates) or "step" (optimizer steps)."""
  metrics: tuple[str, ...] = ()
  """Metrics drawn as they are, in this order (those present)."""
  prefixes: tuple[str, ...] = ()
  """Metrics whose name starts with one of these are drawn too (sorted; never `..._std`)."""
  ratios: tuple[tuple[str, str], ...] = ()
  """`(numerator, denominator)` metric pairs drawn as their quotient at the steps where both
  are logged (the denominator positive), labelled "numerator / denominator"."""
  scale: str = "auto"
  """Y scale: "auto" (log when the values span decades, `use_log_scale`), "linear" or "log"
  (log whenever every value is positive)."""
  labels: tuple[tuple[str, str], ...] = ()
  """`(metric, legend label)` pairs for series not labelled by their metric name."""
  smooth: bool = True
  """False: no series of the panel is smoothed (a schedule such as the learning rate is exact;
  an EMA would only make it lag)."""
  gap: tuple[str, str, str] | None = None
  """`(upper metric, lower metric, label)`: the region between the two series is shaded, at
  the steps where both are logged, and its legend entry gives the last difference
  `upper - lower` (the quickstart's reward-hacking gap)."""

  def __post_init__(self):
    for name in ("title", "ylabel", "xlabel"):
      if not isinstance(getattr(self, name), str) or not getattr(self, name):
        raise ValueError(f"Panel.{name}={getattr(self, name)!r} is invalid: give a non-empty "
                         "string (every panel is labelled).")
    if self.scale not in SCALES:
      raise ValueError(f"Panel.scale={self.scale!r} is invalid: use one of {SCALES}.")
    if not (self.metrics or self.prefixes or self.ratios):
      raise ValueError(f"Panel {self.title!r} draws nothing: give metrics, prefixes or ratios.")
    if self.gap is not None:
      if len(self.gap) != 3 or not set(self.gap[:2]) <= set(self.metrics):
        raise ValueError(f"Panel.gap={self.gap!r} is invalid: give (upper, lower, label) with "
                         f"both metrics among Panel.metrics={self.metrics!r}.")

  def label(self, name: str) -> str:
    """The legend label of metric (or ratio) `name`."""
    return dict(self.labels).get(name, name)


class Series(NamedTuple):
  """One line of a panel: `steps` and `values` are `[N]` float64 arrays, sorted by step."""

  name: str
  """Metric name ("a / b" for a ratio)."""
  label: str
  """Legend label."""
  steps: np.ndarray
  values: np.ndarray
  smooth: bool
  """Drawn as faint raw dots plus the EMA line (True) or as points joined by a line (False)."""


def _grad_norm(xlabel: str, *names: str) -> Panel:
  return Panel(title="Gradient norm (before clipping)", ylabel="global L2 norm", xlabel=xlabel,
               metrics=names)


def _learning_rate(xlabel: str, *names: str) -> Panel:
  return Panel(title="Learning rate", ylabel="learning rate", xlabel=xlabel, metrics=names,
               scale="linear", smooth=False)


PANELS: Mapping[str, Mapping[str, Panel]] = {
    "ppo": {
        "reward": Panel(title="Reward", ylabel="score (reward units)", xlabel="update",
                        metrics=("objective/scores", "objective/rlhf_reward", "eval/score_mean"),
                        prefixes=("reward/",)),
        "kl_per_response": Panel(
            title="KL to the reference, per response", ylabel="nats per response",
            xlabel="update", metrics=("objective/kl", "eval/kl")),
        "kl_per_token": Panel(
            title="KL to the reference, per token", ylabel="nats per token", xlabel="update",
            ratios=(("objective/kl", "rollout/response_length"),
                    ("eval/kl", "eval/response_length"))),
        "entropy_per_token": Panel(
            title="Policy entropy, per token", ylabel="nats per token", xlabel="update",
            metrics=("policy/entropy_avg", "eval/entropy")),
        "entropy_per_response": Panel(
            title="Entropy of the sampled responses (sum of -log pi), per response",
            ylabel="nats per response", xlabel="update", metrics=("objective/entropy",)),
        "response_length": Panel(
            title="Response length", ylabel="tokens", xlabel="update",
            metrics=("rollout/response_length", "eval/response_length")),
        "policy_loss": Panel(title="Policy loss", ylabel="loss (advantage units)",
                             xlabel="update", metrics=("loss/policy_avg",)),
        "kl_loss": Panel(title="KL loss term (per token, before the coefficient)",
                         ylabel="nats per token", xlabel="update", metrics=("loss/kl_avg",)),
        "value_loss": Panel(title="Value loss", ylabel="squared error (reward units^2)",
                            xlabel="update", metrics=("loss/value_avg",)),
        "clip_fraction": Panel(title="Clipped fraction", ylabel="fraction of tokens",
                               xlabel="update", metrics=("policy/clipfrac_avg", "val/clipfrac_avg"),
                               scale="linear"),
        "approx_kl": Panel(title="Update size: approximate KL of the old to the new policy",
                           ylabel="nats per token", xlabel="update",
                           metrics=("policy/approxkl_avg",)),
        "explained_variance": Panel(title="Critic: explained variance of the returns",
                                    ylabel="fraction of variance (1 = perfect)", xlabel="update",
                                    metrics=("val/explained_variance",), scale="linear"),
        "grad_norm": _grad_norm("update", "policy/grad_norm", "critic/grad_norm"),
        "learning_rate": _learning_rate("update", "lr", "lr/critic"),
    },
    "sft": {
        "loss": Panel(title="Cross-entropy loss", ylabel="nats per token",
                      metrics=("train/loss", "eval/loss")),
        "perplexity": Panel(title="Perplexity (e^loss)", ylabel="perplexity (per token)",
                            metrics=("train/perplexity", "eval/perplexity"), scale="log"),
        "grad_norm": _grad_norm("step", "train/grad_norm"),
        "learning_rate": _learning_rate("step", "lr"),
    },
    "reward_model": {
        "loss": Panel(title="Bradley-Terry loss", ylabel="nats per pair",
                      metrics=("train/loss", "eval/loss")),
        "accuracy": Panel(title="Preference accuracy", ylabel="fraction of pairs ranked right",
                          metrics=("train/accuracy", "eval/accuracy"), scale="linear"),
        "scores": Panel(title="Reward of the chosen and rejected responses",
                        ylabel="score (reward units)", metrics=("train/chosen", "train/rejected")),
        "margin": Panel(title="Reward margin (chosen - rejected)", ylabel="score (reward units)",
                        metrics=("train/margin",)),
        "grad_norm": _grad_norm("step", "train/grad_norm"),
        "learning_rate": _learning_rate("step", "lr"),
    },
    "dpo": {
        "loss": Panel(title="DPO loss", ylabel="nats per pair",
                      metrics=("train/loss", "eval/loss")),
        "accuracy": Panel(title="Implicit-reward accuracy", ylabel="fraction of pairs ranked right",
                          metrics=("rewards/accuracies", "eval/rewards/accuracies"),
                          scale="linear"),
        "rewards": Panel(title="Implicit rewards beta * log(pi / pi_ref)",
                         ylabel="beta x nats per response",
                         metrics=("rewards/chosen", "rewards/rejected", "eval/rewards/chosen",
                                  "eval/rewards/rejected")),
        "margin": Panel(title="Implicit-reward margin (chosen - rejected)",
                        ylabel="beta x nats per response",
                        metrics=("rewards/margins", "eval/rewards/margins")),
        "logps": Panel(title="Log-probability of the responses", ylabel="nats per response",
                       metrics=("logps/chosen", "logps/rejected", "eval/logps/chosen",
                                "eval/logps/rejected")),
        "grad_norm": _grad_norm("step", "train/grad_norm"),
        "learning_rate": _learning_rate("step", "lr"),
    },
}
"""Stage -> file stem -> panel. `write_plots` writes the panels with data of the stage
`detect_stage` recognises."""


def detect_stage(names: Sequence[str]) -> str | None:
  """The stage (a key of `PANELS`) whose metrics `names` are, or None.

  DPO logs `rewards/...` and `logps/...`; PPO `objective/...`, `policy/...`, `rollout/...`; SFT
  a perplexity; the reward model an accuracy (and no perplexity).
  """
  def has(*prefixes: str) -> bool:
    return any(n.startswith(prefixes) for n in names)

  if has("rewards/", "logps/", "eval/rewards/", "eval/logps/"):
    return "dpo"
  if has("objective/", "policy/", "rollout/", "loss/", "val/"):
    return "ppo"
  if has("train/perplexity", "eval/perplexity"):
    return "sft"
  if has("train/accuracy", "eval/accuracy", "train/margin"):
    return "reward_model"
  return None


def read_metrics(path: str | os.PathLike, *, stage: str | None = None
                 ) -> dict[str, tuple[list[int], list[float]]]:
  """Metric name -> (steps, values) of a `metrics.jsonl` file, finite numbers only, by step.

  Args:
    path: a JSONL file of `{"step": int, <metric>: number, ...}` records.
    stage: keep only records whose "stage" field equals this (the quickstart's combined file);
      None keeps every record.

  Lines that are not JSON objects with an integer-valued "step" (a line cut short by a crash)
  are skipped. A step logged twice (a resumed run redoes the steps after its last checkpoint)
  keeps its last value.
  """
  by_step: dict[str, dict[int, float]] = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue
      if not isinstance(record, dict) or (stage is not None and record.get("stage") != stage):
        continue
      step = record.get("step")
      if isinstance(step, bool) or not isinstance(step, int | float) or not math.isfinite(step):
        continue
      for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
          continue
        if math.isfinite(value):
          by_step.setdefault(key, {})[int(step)] = float(value)
  return {k: (sorted(v), [v[s] for s in sorted(v)]) for k, v in by_step.items()}


def panel_metrics(names: Sequence[str], panel: Panel) -> list[str]:
  """The plain metrics of `names` (not the ratios) that `panel` draws, in drawing order."""
  chosen = [n for n in panel.metrics if n in names]
  chosen += sorted(n for n in names if n not in chosen and not n.endswith("_std")
                   and any(n.startswith(p) for p in panel.prefixes))
  return chosen


def _smooth(panel: Panel, name: str, n: int) -> bool:
  return panel.smooth and not name.startswith(UNSMOOTHED_PREFIXES) and n >= MIN_POINTS_TO_SMOOTH


def panel_series(series: Mapping[str, tuple[Sequence[float], Sequence[float]]], panel: Panel
                 ) -> list[Series]:
  """The `Series` of `panel` found in `series` (as `read_metrics` returns it); empty when the
  panel has no data."""
  out = []
  for name in panel_metrics(list(series), panel):
    steps, values = (np.asarray(a, np.float64) for a in series[name])
    out.append(Series(name, panel.label(name), steps, values, _smooth(panel, name, len(steps))))
  for num, den in panel.ratios:
    if num not in series or den not in series:
      continue
    denominators = dict(zip(*series[den], strict=True))
    pairs = [(s, v / denominators[s]) for s, v in zip(*series[num], strict=True)
             if denominators.get(s, 0.0) > 0]
    if pairs:
      steps, values = np.asarray(pairs, np.float64).T
      name = f"{num} / {den}"
      out.append(Series(name, panel.label(name), steps, values, _smooth(panel, num, len(steps))))
  return out


def ema(values: Any, weight: float = EMA_WEIGHT, *, log: bool = False) -> np.ndarray:
  r"""Zero-debiased exponential moving average of `values` (`[N]`), as TensorBoard smooths.

  .. math::
      m_t = w\,m_{t-1} + (1 - w)\,x_t,\quad m_{-1} = 0,\qquad s_t = m_t / (1 - w^{t+1})

  so `s_0 = x_0` and every `s_t` is a weighted mean of `x_0..x_t`. With `log=True` the average
  is taken of `log10(x)` (a geometric mean, for a log axis; `values` must be positive).

  Args:
    values: `[N]` numbers.
    weight: `w` in [0, 1); 0 returns the values.
    log: average the logarithms.

  Returns:
    `[N]` float64.
  """
  if not 0.0 <= weight < 1.0:
    raise ValueError(f"ema: weight={weight!r} is invalid: use 0 <= weight < 1.")
  x = np.asarray(values, np.float64)
  if x.ndim != 1:
    raise ValueError(f"ema: values of shape {x.shape} are invalid: give a 1-D sequence.")
  if log:
    if np.any(x <= 0):
      raise ValueError("ema: log=True needs positive values.")
    return 10.0 ** ema(np.log10(x), weight)
  out = np.empty_like(x)
  m = 0.0
  for t, v in enumerate(x):
    m = weight * m + (1.0 - weight) * v
    out[t] = m / (1.0 - weight ** (t + 1))
  return out


def use_log_scale(values: Sequence[Any], scale: str = "auto") -> bool:
  """Whether a panel with these `values` (arrays, one per series) gets a log y axis.

  "linear": never; "log": when every value is positive; "auto": when every value is positive and
  `max / min > LOG_SPAN`.
  """
  if scale not in SCALES:
    raise ValueError(f"scale={scale!r} is invalid: use one of {SCALES}.")
  flat = np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in values] or [np.zeros(0)])
  if scale == "linear" or flat.size == 0 or np.any(flat <= 0):
    return False
  return scale == "log" or flat.max() / flat.min() > LOG_SPAN


def draw_panel(ax: Any, panel: Panel, series: Sequence[Series]) -> None:
  """Draws `series` on the matplotlib Axes `ax` with `panel`'s title, labels, scale and gap."""
  from matplotlib.ticker import MaxNLocator

  log = use_log_scale([s.values for s in series], panel.scale)
  colors = [f"C{i % 10}" for i in range(len(series))]
  smoothed = False
  for s, color in zip(series, colors, strict=True):
    if s.smooth:
      smoothed = True
      ax.plot(s.steps, s.values, "o", color=color, alpha=0.25, markersize=2.5)
      ax.plot(s.steps, ema(s.values, log=log), "-", color=color, linewidth=1.8, label=s.label)
    else:  # markers only where they can be told apart
      marker = "o" if len(s.steps) < MARKERS_BELOW else None
      ax.plot(s.steps, s.values, "-", marker=marker, color=color, markersize=3.5, linewidth=1.5,
              label=s.label)
  if panel.gap is not None:
    _draw_gap(ax, panel.gap, {s.name: s for s in series})
  if log:
    ax.set_yscale("log")
  ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))  # whole steps
  ax.set_title(panel.title, fontsize=10)
  ax.set_xlabel(panel.xlabel)
  ax.set_ylabel(panel.ylabel + (", log scale" if log else ""))
  ax.grid(alpha=0.3, which="both" if log else "major")
  if series:
    title = f"lines: EMA (weight {EMA_WEIGHT}), dots: raw" if smoothed else None
    ax.legend(fontsize=7, title=title, title_fontsize=7)


def _draw_gap(ax: Any, gap: tuple[str, str, str], by_name: Mapping[str, Series]) -> None:
  upper_name, lower_name, label = gap
  if upper_name not in by_name or lower_name not in by_name:
    return
  upper, lower = by_name[upper_name], by_name[lower_name]
  lows = dict(zip(lower.steps, lower.values, strict=True))
  steps = [s for s in upper.steps if s in lows]
  if not steps:
    return
  highs = dict(zip(upper.steps, upper.values, strict=True))
  hi = np.asarray([highs[s] for s in steps])
  lo = np.asarray([lows[s] for s in steps])
  ax.fill_between(steps, lo, hi, color="tab:red", alpha=0.15, linewidth=0,
                  label=f"{label}: {hi[-1] - lo[-1]:+.2f} at {steps[-1]:g}")


def make_figure(panels: Sequence[tuple[Panel, Sequence[Series]]], *, ncols: int = 1,
                panel_size: tuple[float, float] = (6.4, 4.0), dpi: int = 100) -> Any:
  """A matplotlib `Figure` (no pyplot) with each `(panel, series)` drawn on its own Axes, in a
  grid of `ncols` columns, row by row; Axes left over in the last row are hidden.

  Raises:
    ImportError: matplotlib is not installed.
    ValueError: `panels` is empty.
  """
  try:
    from matplotlib.figure import Figure
  except ImportError as e:
    raise ImportError("Plots need matplotlib: pip install matplotlib.") from e
  if not panels:
    raise ValueError("make_figure: no panels to draw.")
  ncols = min(ncols, len(panels))
  nrows = -(-len(panels) // ncols)
  fig = Figure(figsize=(panel_size[0] * ncols, panel_size[1] * nrows), dpi=dpi)
  axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
  for (panel, series), ax in zip(panels, axes, strict=False):
    draw_panel(ax, panel, series)
  for ax in axes[len(panels):]:
    ax.set_visible(False)
  fig.tight_layout()
  return fig


def write_figure(path: str | os.PathLike, panels: Sequence[tuple[Panel, Sequence[Series]]], *,
                 ncols: int = 1, panel_size: tuple[float, float] = (6.4, 4.0), dpi: int = 100
                 ) -> pathlib.Path:
  """Saves `make_figure(panels, ...)` as a PNG at `path` (its folder created); returns the path.

  Raises:
    ImportError: matplotlib is not installed.
  """
  fig = make_figure(panels, ncols=ncols, panel_size=panel_size, dpi=dpi)
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, format="png")
  return path


def write_plots(run_dir: str | os.PathLike, *, out_dir: str | os.PathLike | None = None,
                stage: str | None = None) -> list[pathlib.Path]:
  """Writes one PNG per panel with data from `run_dir/metrics.jsonl`, and `overview.png` with
  every such panel; returns their paths (none when no panel has data).

  Args:
    run_dir: a run folder holding `metrics.jsonl`.
    out_dir: where the PNGs go (default `run_dir/plots`); created if missing.
    stage: a key of `PANELS`; None recognises it from the metric names (`detect_stage`).

  Raises:
    FileNotFoundError: `run_dir` has no `metrics.jsonl`.
    ValueError: `stage` is not a key of `PANELS`.
    ImportError: matplotlib is not installed.
  """
  if stage is not None and stage not in PANELS:
    raise ValueError(f"stage={stage!r} is invalid: use one of {tuple(PANELS)} or None.")
  path = pathlib.Path(run_dir) / "metrics.jsonl"
  if not path.is_file():
    raise FileNotFoundError(f"{str(run_dir)!r} has no metrics.jsonl; pass a run folder written by "
                            "a training run (jax-ppo train, sft, reward or dpo).")
  try:
    import matplotlib  # noqa: F401 - fail before writing anything
  except ImportError as e:
    raise ImportError("Plots need matplotlib: pip install matplotlib.") from e
  series = read_metrics(path)
  stage = stage if stage is not None else detect_stage(list(series))
  if stage is None:
    return []
  out = pathlib.Path(out_dir) if out_dir is not None else pathlib.Path(run_dir) / PLOTS_DIR
  drawn = [(stem, panel, panel_series(series, panel)) for stem, panel in PANELS[stage].items()]
  drawn = [d for d in drawn if d[2]]
  written = [write_figure(out / f"{stem}.png", [(panel, lines)]) for stem, panel, lines in drawn]
  if written:
    written.append(write_figure(out / OVERVIEW_FILE, [(p, s) for _, p, s in drawn], ncols=3,
                                panel_size=(5.0, 3.6), dpi=80))
  return written


__all__ = [
    "EMA_WEIGHT",
    "LOG_SPAN",
    "MARKERS_BELOW",
    "MIN_POINTS_TO_SMOOTH",
    "OVERVIEW_FILE",
    "PANELS",
    "PLOTS_DIR",
    "SCALES",
    "UNSMOOTHED_PREFIXES",
    "Panel",
    "Series",
    "detect_stage",
    "draw_panel",
    "ema",
    "make_figure",
    "panel_metrics",
    "panel_series",
    "read_metrics",
    "use_log_scale",
    "write_figure",
    "write_plots",
]
