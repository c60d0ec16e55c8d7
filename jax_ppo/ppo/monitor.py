"""Training-stability monitor: the practitioners' checks on PPO metric streams.

Host-side and plain Python: the trainer calls `StabilityMonitor.update(step, metrics)` once per
PPO update with the scalar metrics it already logs (TRL names, docs/rlhf_details.md), after they
have been fetched from the device. The monitor keeps short windows of the metrics it reads and
returns a `StabilityWarning` for every check that fails at this step:

* `reward_volatility`: the std of the last `reward_window` mean rewards exceeds
  `reward_volatility_ratio` times the magnitude of their mean.
* `kl_high`: the KL to the reference stays above `kl_threshold` for `kl_window` consecutive
  updates (or, with `kl_rule="mean"`, the mean over the window does). The KL is per token:
  `objective/kl` (a per-sequence sum) divided by `response_length/mean` when that is logged.
* `clipfrac_high`: the policy clip fraction exceeds `clipfrac_threshold`.
* `non_finite`: any metric is NaN or infinite.
* `value_loss_plateau`: the mean value loss of the last `value_loss_window` updates is not below
  the mean of the `value_loss_window` updates before them.

Two further checks mean the run has collapsed and should be rolled back to its last good
checkpoint; they set `StabilityMonitor.collapsed`:

* `reward_collapse`: the (smoothed) mean reward falls below the best smoothed level of the
  recent history by more than `collapse_reward_drop_std` noise standard deviations and more
  than `collapse_reward_drop_fraction` of that level's magnitude.
* `kl_blowup`: the KL exceeds `collapse_kl_multiple * kl_threshold`.
* `non_finite` also counts as a collapse when `collapse_on_nonfinite` (NaN losses usually mean
  NaN parameters).

Every warning is also logged through the `jax_ppo.monitor` logger, at most once per
`log_interval` updates while a condition persists. `state_dict()` / `load_state_dict()` carry the
windows (plain lists) through a checkpoint, so a resumed run continues where it stopped.

`PPOTrainer` installs the monitor as its hook on the run loop (`jax_ppo.training.hooks.LoopHook`:
`after_step` adds the `monitor/warnings` count to each update's metrics, `collapse()` reports a
collapse for `RunOptions.rollback`, the state is saved under the checkpoint's "monitor" key).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("jax_ppo.monitor")

KL_RULES = ("consecutive", "mean")

WARNING_KINDS = (
    "reward_volatility",
    "kl_high",
    "clipfrac_high",
    "non_finite",
    "value_loss_plateau",
    "reward_collapse",
    "kl_blowup",
)
"""Every `StabilityWarning.kind` the monitor emits."""

COLLAPSE_KINDS = ("reward_collapse", "kl_blowup")
"""Kinds that always set `StabilityMonitor.collapsed` (`non_finite` does when configured)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MonitorConfig:
  """Thresholds of the stability checks (defaults from practitioners' PPO-for-LLM guides).

  Window lengths count calls to `StabilityMonitor.update`, i.e. PPO updates, not optimizer steps.
  """

  reward_keys: tuple[str, ...] = ("objective/scores", "objective/rlhf_reward")
  """Metric names of the mean reward, in order of preference; the first one present is used."""
  kl_key: str = "objective/kl"
  """Metric name of the mean KL between policy and reference."""
  kl_length_key: str | None = "response_length/mean"
  """When this metric is present (and > 0), the KL is divided by it, so the KL thresholds are per
  token: TRL's `objective/kl` sums the KL over the response (several nats per sequence in a
  healthy run). None, or a missing metric, compares the KL metric as logged."""
  clipfrac_key: str = "policy/clipfrac_avg"
  """Metric name of the share of policy-ratio values that were clipped."""
  value_loss_key: str = "loss/value_avg"
  """Metric name of the value loss."""

  reward_window: int = 10
  """Number of recent mean rewards whose volatility is checked."""
  reward_volatility_ratio: float = 0.5
  """Warn when std(last rewards) > ratio * |mean(last rewards)|."""

  kl_threshold: float = 0.1
  """KL level (per token, see `kl_length_key`) above which the policy is drifting too far from
  the reference."""
  kl_window: int = 5
  """Number of recent updates the KL rule looks at."""
  kl_rule: str = "consecutive"
  """"consecutive": warn when each of the last `kl_window` KL values is above the threshold;
  "mean": warn when their mean is."""

  clipfrac_threshold: float = 0.8
  """Warn when the clip fraction exceeds this share."""

  value_loss_window: int = 10
  """Compare the mean value loss of the last this-many updates with the this-many before."""
  value_loss_min_decrease: float = 0.0
  """Relative decrease required: warn unless mean(last) < (1 - this) * mean(previous)."""

  collapse_window: int = 50
  """Number of recent mean rewards whose best level is the reference for collapse detection."""
  collapse_smoothing: int = 5
  """Rewards are averaged over this many updates before levels are compared (noise filter)."""
  collapse_min_history: int = 20
  """Mean rewards needed before collapse detection starts (the noise estimate needs them)."""
  collapse_reward_drop_std: float = 4.0
  """Collapse when the smoothed reward is more than this many stds of the per-update reward noise
  below the best level; the noise is estimated robustly to a trend (differences between updates,
  residuals of a fitted line)."""
  collapse_reward_drop_fraction: float = 0.2
  """...and more than this fraction of |best level| below it (0 disables this condition)."""
  collapse_kl_multiple: float = 10.0
  """Collapse when KL > this multiple of `kl_threshold`."""
  collapse_on_nonfinite: bool = True
  """Treat a non-finite metric as a collapse (NaN losses usually mean NaN parameters)."""

  log_interval: int = 100
  """A condition that persists is logged again at most once per this many updates."""

  def __post_init__(self):
    def bad(field: str, fix: str) -> None:
      raise ValueError(f"MonitorConfig.{field}={getattr(self, field)!r} is invalid: {fix}.")

    if not self.reward_keys or not all(isinstance(k, str) and k for k in self.reward_keys):
      bad("reward_keys", "give a non-empty tuple of metric names")
    for field in ("kl_key", "clipfrac_key", "value_loss_key"):
      if not isinstance(getattr(self, field), str) or not getattr(self, field):
        bad(field, "give a non-empty metric name")
    if self.kl_length_key is not None and not (
        isinstance(self.kl_length_key, str) and self.kl_length_key
    ):
      bad("kl_length_key", "give a metric name, or None to compare the KL as logged")
    for field, low in (
        ("reward_window", 2),
        ("kl_window", 1),
        ("value_loss_window", 1),
        ("collapse_smoothing", 1),
        ("log_interval", 1),
    ):
      value = getattr(self, field)
      if not isinstance(value, int) or isinstance(value, bool) or value < low:
        bad(field, f"use an int >= {low}")
    window, history = self.collapse_window, self.collapse_min_history
    if not isinstance(history, int) or history < 2 * self.collapse_smoothing + 2:
      bad("collapse_min_history", "use an int >= 2 * collapse_smoothing + 2")
    if not isinstance(window, int) or window < history:
      bad("collapse_window", "use an int >= collapse_min_history")
    if not self.reward_volatility_ratio > 0:
      bad("reward_volatility_ratio", "use a value > 0")
    if not self.kl_threshold > 0:
      bad("kl_threshold", "use a value > 0")
    if self.kl_rule not in KL_RULES:
      bad("kl_rule", f"use one of {KL_RULES}")
    if not 0 < self.clipfrac_threshold <= 1:
      bad("clipfrac_threshold", "use a share in (0, 1]")
    if not 0 <= self.value_loss_min_decrease < 1:
      bad("value_loss_min_decrease", "use a fraction in [0, 1)")
    if not self.collapse_reward_drop_std > 0:
      bad("collapse_reward_drop_std", "use a value > 0")
    if not self.collapse_reward_drop_fraction >= 0:
      bad("collapse_reward_drop_fraction", "use a fraction >= 0 (0 disables this condition)")
    if not self.collapse_kl_multiple > 1:
      bad("collapse_kl_multiple", "use a multiple > 1 of kl_threshold")

  @property
  def reward_history(self) -> int:
    """Number of mean rewards the monitor keeps."""
    return max(self.reward_window, self.collapse_window)


@dataclasses.dataclass(frozen=True)
class StabilityWarning:
  """One failed check at one update."""

  kind: str
  """One of `WARNING_KINDS`."""
  step: int
  """The step passed to `StabilityMonitor.update`."""
  message: str
  """What was seen, the likely cause and the usual fix."""
  value: float
  """The offending value (the KL, the clip fraction, the reward std...; NaN for `non_finite`)."""

  @property
  def is_collapse(self) -> bool:
    """Whether this warning asks for a rollback."""
    return self.kind in COLLAPSE_KINDS


def _mean(values) -> float:
  return sum(values) / len(values)


def _std(values) -> float:
  m = _mean(values)
  return math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def _reward_noise(values: list[float]) -> float:
  """Per-update noise std of a reward series that may trend.

  The larger of two trend-robust estimates: std of update-to-update differences / sqrt(2) and the
  std of the residuals of a least-squares line. Taking the larger keeps false collapses rare
  (calibrated on Gaussian noise: the smoothed drop of a stationary series stayed below about 3.2
  noise stds over 1e5 updates, so the default threshold of 4 leaves a margin).
  """
  n = len(values)
  diffs = [b - a for a, b in zip(values, values[1:], strict=False)]
  by_diffs = _std(diffs) / math.sqrt(2)
  x_mean, y_mean = (n - 1) / 2, _mean(values)
  slope = sum((x - x_mean) * (y - y_mean) for x, y in enumerate(values)) / sum(
      (x - x_mean) ** 2 for x in range(n)
  )
  by_fit = _std([y - y_mean - slope * (x - x_mean) for x, y in enumerate(values)])
  return max(by_diffs, by_fit)


def _as_float(value: Any) -> float | None:
  """A metric as a Python float, or None when it is not a number (strings, arrays of size > 1)."""
  if isinstance(value, str | bytes):
    return None
  if isinstance(value, bool):
    return float(value)
  try:
    return float(value)
  except (TypeError, ValueError):
    return None


class StabilityMonitor:
  """Runs the stability checks on each update's metrics and remembers their recent history.

  Usage in a training loop (host side, after the metrics were fetched)::

    monitor = StabilityMonitor(MonitorConfig())
    for step in ...:
      metrics = ...
      for w in monitor.update(step, metrics):
        ...  # already logged; add to the metrics, count, etc.
      if monitor.collapsed:
        state = restore(last_good_step)
        monitor.rollback(last_good_step)

  As `PPOTrainer`'s hook on the run loop (`LoopHook`), `RunLoop` calls `after_step`,
  `collapse`, `clear_collapse`, `rolled_back` and the state dicts instead.
  """

  name = "monitor"
  """The key of the monitor's state in a checkpoint's extra (`LoopHook.name`)."""

  def __init__(self, config: MonitorConfig | None = None):
    self.config = config if config is not None else MonitorConfig()
    c = self.config
    self._rewards: collections.deque = collections.deque(maxlen=c.reward_history)
    self._kls: collections.deque = collections.deque(maxlen=c.kl_window)
    self._value_losses: collections.deque = collections.deque(maxlen=2 * c.value_loss_window)
    self._last_logged: dict[str, int] = {}
    self._active: set[str] = set()
    self._collapse: StabilityWarning | None = None
    self._kl_label = "KL"

  # ---- public API ------------------------------------------------------------------------------

  @property
  def collapsed(self) -> bool:
    """True once a collapse check failed, until `rollback` or `clear_collapse` is called."""
    return self._collapse is not None

  @property
  def collapse_reason(self) -> StabilityWarning | None:
    """The first collapse warning since the flag was last cleared."""
    return self._collapse

  def clear_collapse(self) -> None:
    """Clears the `collapsed` flag without touching the metric history."""
    self._collapse = None

  def rollback(self, step: int) -> None:
    """Forgets everything recorded after `step` (the checkpoint restored) and clears `collapsed`.

    The windows then hold the history up to the restored checkpoint, so the collapsed updates
    neither trigger warnings again nor become the "best recent level".
    """
    for window in (self._rewards, self._kls, self._value_losses):
      kept = [(s, v) for s, v in window if s <= step]
      window.clear()
      window.extend(kept)
    self._active.clear()
    self._collapse = None

  # ---- the run loop's hook (`jax_ppo.training.hooks.LoopHook`) -------------------------------

  def after_step(self, step: int, metrics: dict[str, float]) -> None:
    """`update`, then the count of its warnings added as `metrics["monitor/warnings"]`."""
    metrics["monitor/warnings"] = float(len(self.update(step, metrics)))

  def collapse(self) -> StabilityWarning | None:
    """The collapse to roll back from (`collapse_reason` while `collapsed`), else None."""
    return self._collapse

  def rolled_back(self, step: int) -> None:
    """The loop restored the checkpoint of `step`: `rollback(step)`."""
    self.rollback(step)

  def update(self, step: int, metrics: Mapping[str, Any]) -> list[StabilityWarning]:
    """Records one update's metrics and returns the checks that fail at this step.

    Args:
      step: the trainer's step (PPO update index), stored with each value.
      metrics: metric name -> scalar (Python/NumPy/JAX scalar). Missing metrics skip their
        checks; non-numeric values are ignored; non-finite values raise a `non_finite` warning
        and are not added to the windows.

    Returns:
      The failing checks in `WARNING_KINDS` order; each is also logged (rate-limited).
    """
    step = int(step)
    c = self.config
    values = {k: _as_float(v) for k, v in metrics.items()}
    warnings: list[StabilityWarning] = []

    def finite(key: str) -> float | None:
      value = values.get(key)
      return value if value is not None and math.isfinite(value) else None

    reward_key = next((k for k in c.reward_keys if k in values), None)
    reward = finite(reward_key) if reward_key is not None else None
    kl = finite(c.kl_key)
    length = finite(c.kl_length_key) if c.kl_length_key is not None else None
    self._kl_label = "KL"
    if kl is not None and length is not None and length > 0:
      kl, self._kl_label = kl / length, "KL per token"
    clipfrac = finite(c.clipfrac_key)
    value_loss = finite(c.value_loss_key)

    # Collapse is judged against the history before this step.
    collapse_drop = self._reward_drop(reward) if reward is not None else None

    if reward is not None:
      self._rewards.append((step, reward))
      warnings.extend(self._check_reward_volatility(step))
    if kl is not None:
      self._kls.append((step, kl))
      warnings.extend(self._check_kl(step))
    if clipfrac is not None and clipfrac > c.clipfrac_threshold:
      warnings.append(
          StabilityWarning(
              "clipfrac_high",
              step,
              f"clip fraction {clipfrac:.3f} > {c.clipfrac_threshold}: the policy moves too far "
              "in one update. Lower learning_rate, reduce ppo_epochs or use more/smaller "
              "minibatches; if it is high from the very first minibatch, old log-probs do not "
              "match the training forward pass (temperature, dtype, padding).",
              clipfrac,
          )
      )
    bad = sorted(k for k, v in values.items() if v is not None and not math.isfinite(v))
    if bad:
      warnings.append(
          StabilityWarning(
              "non_finite",
              step,
              f"non-finite values in {', '.join(bad)}: overflow or log(0) somewhere. Roll back "
              "to the last checkpoint, lower learning_rate, make sure max_grad_norm clipping is "
              "on, compute log-softmax and losses in float32, and check the reward model's "
              "outputs for NaN/inf.",
              math.nan,
          )
      )
    if value_loss is not None:
      self._value_losses.append((step, value_loss))
      warnings.extend(self._check_value_loss(step))
    if collapse_drop is not None:
      warnings.append(self._reward_collapse_warning(step, reward, *collapse_drop))
    if kl is not None and kl > c.collapse_kl_multiple * c.kl_threshold:
      warnings.append(
          StabilityWarning(
              "kl_blowup",
              step,
              f"{self._kl_label} {kl:.4g} > {c.collapse_kl_multiple:g} x kl_threshold "
              f"({c.kl_threshold:g}): the policy has diverged from the reference. Roll back to "
              "the last good checkpoint, then raise kl_coef (or lower kl_target with an adaptive "
              "controller), lower learning_rate, tighten clip_eps and reduce ppo_epochs.",
              kl,
          )
      )

    for w in warnings:
      if self._collapse is None and (
          w.is_collapse or (w.kind == "non_finite" and c.collapse_on_nonfinite)
      ):
        self._collapse = w
    self._log(step, warnings)
    return warnings

  def state_dict(self) -> dict[str, Any]:
    """The monitor's state as plain Python lists/dicts (JSON- and YAML-serialisable)."""
    return {
        "rewards": [[s, v] for s, v in self._rewards],
        "kls": [[s, v] for s, v in self._kls],
        "value_losses": [[s, v] for s, v in self._value_losses],
        "last_logged": [[k, s] for k, s in sorted(self._last_logged.items())],
        "active": sorted(self._active),
        "collapse": None if self._collapse is None else dataclasses.asdict(self._collapse),
    }

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restores a `state_dict()`; windows longer than this config's keep their newest values."""
    for name, window in (
        ("rewards", self._rewards),
        ("kls", self._kls),
        ("value_losses", self._value_losses),
    ):
      window.clear()
      window.extend((int(s), float(v)) for s, v in state.get(name, []))
    self._last_logged = {str(k): int(s) for k, s in state.get("last_logged", [])}
    self._active = set(state.get("active", []))
    collapse = state.get("collapse")
    self._collapse = None
    if collapse is not None:
      self._collapse = StabilityWarning(
          kind=collapse["kind"],
          step=int(collapse["step"]),
          message=collapse["message"],
          value=float(collapse["value"]),
      )

  # ---- checks ----------------------------------------------------------------------------------

  def _check_reward_volatility(self, step: int) -> list[StabilityWarning]:
    c = self.config
    if len(self._rewards) < c.reward_window:
      return []
    recent = [v for _, v in list(self._rewards)[-c.reward_window :]]
    mean, std = _mean(recent), _std(recent)
    if std <= c.reward_volatility_ratio * abs(mean):
      return []
    return [
        StabilityWarning(
            "reward_volatility",
            step,
            f"mean reward is volatile: std {std:.4g} over the last {c.reward_window} updates > "
            f"{c.reward_volatility_ratio:g} x |mean| ({abs(mean):.4g}). Updates are too large or "
            "the reward is noisy: lower learning_rate, raise batch_size, tighten clip_eps, and "
            "check the reward model (normalise its scores, look for exploitable features).",
            std,
        )
    ]

  def _check_kl(self, step: int) -> list[StabilityWarning]:
    c = self.config
    if len(self._kls) < c.kl_window:
      return []
    recent = [v for _, v in self._kls]
    if c.kl_rule == "consecutive":
      failing, value = all(v > c.kl_threshold for v in recent), recent[-1]
      what = (
          f"{self._kl_label} above {c.kl_threshold:g} for {c.kl_window} consecutive updates "
          f"(now {value:.4g})"
      )
    else:
      value = _mean(recent)
      failing = value > c.kl_threshold
      what = (
          f"mean {self._kl_label} over the last {c.kl_window} updates {value:.4g} > "
          f"{c.kl_threshold:g}"
      )
    if not failing:
      return []
    return [
        StabilityWarning(
            "kl_high",
            step,
            f"{what}: the policy is drifting away from the reference. Raise kl_coef (or lower "
            "kl_target with an adaptive controller), lower learning_rate or reduce ppo_epochs.",
            value,
        )
    ]

  def _check_value_loss(self, step: int) -> list[StabilityWarning]:
    c = self.config
    n = c.value_loss_window
    if len(self._value_losses) < 2 * n:
      return []
    losses = [v for _, v in self._value_losses]
    previous, last = _mean(losses[:n]), _mean(losses[n:])
    if last < (1 - c.value_loss_min_decrease) * previous:
      return []
    return [
        StabilityWarning(
            "value_loss_plateau",
            step,
            f"value loss is not decreasing: mean {last:.4g} over the last {n} updates vs "
            f"{previous:.4g} over the {n} before. Check the reward scale (normalise rewards), "
            "raise vf_coef or the value learning rate, and check cliprange_value; a value model "
            "initialised from the reward model learns faster.",
            last,
        )
    ]

  def _reward_drop(self, reward: float) -> tuple[float, float, float] | None:
    """(best level, drop, noise std) when `reward` makes the smoothed level collapse, else None."""
    c = self.config
    history = [v for _, v in self._rewards][-c.collapse_window :]
    k = c.collapse_smoothing
    if len(history) < c.collapse_min_history:
      return None
    levels = [_mean(history[i : i + k]) for i in range(len(history) - k + 1)]
    best = max(levels)
    current = _mean(history[len(history) - k + 1 :] + [reward])
    # Noise from the updates before the current level, so a collapse does not hide itself.
    noise = _reward_noise(history[: len(history) - k + 1])
    drop = best - current
    if drop > c.collapse_reward_drop_std * noise and drop > (
        c.collapse_reward_drop_fraction * abs(best)
    ):
      return best, drop, noise
    return None

  def _reward_collapse_warning(
      self, step: int, reward: float, best: float, drop: float, noise: float
  ) -> StabilityWarning:
    c = self.config
    return StabilityWarning(
        "reward_collapse",
        step,
        f"mean reward collapsed: smoothed level fell {drop:.4g} below the best recent level "
        f"{best:.4g} (reward now {reward:.4g}, update-to-update noise std {noise:.4g}, "
        f"limits {c.collapse_reward_drop_std:g} std and {c.collapse_reward_drop_fraction:g} x "
        "|best|). Roll back to the last good checkpoint, then lower learning_rate, tighten "
        "clip_eps and raise kl_coef; check the reward model if the policy was exploiting it.",
        drop,
    )

  def _log(self, step: int, warnings: list[StabilityWarning]) -> None:
    interval = self.config.log_interval
    now = {w.kind for w in warnings}
    for w in warnings:
      last = self._last_logged.get(w.kind)
      # Collapses are rare and decisive: log each new episode. Other conditions, which may
      # flicker on and off, are logged at most once per interval.
      fresh_collapse = w.is_collapse and w.kind not in self._active
      if fresh_collapse or last is None or step < last or step - last >= interval:
        self._last_logged[w.kind] = step
        level = logging.ERROR if w.is_collapse or w.kind == "non_finite" else logging.WARNING
        logger.log(level, "step %d [%s] %s", step, w.kind, w.message)
    self._active = now
