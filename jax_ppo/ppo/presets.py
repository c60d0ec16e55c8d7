"""Scenario presets and a hyperparameter guide for PPO fine-tuning of language models.

`PRESETS` maps a scenario to the `PPOConfig` fields practitioners' articles change for it
(dialogue, knowledge QA, creative writing), by dotted key (`optimizer.learning_rate` is the
learning rate of the `optimizer` block); `preset_overrides(name)` returns them as a fresh nested
dict, the shape of a config file's `ppo` section (`jax_ppo.runs.ppo_config.load_run_config`
merges it under the file's values, key by key). `HYPERPARAMETER_GUIDE` is a table of recommended
ranges, defaults and one-line advice keyed by dotted `PPOConfig` keys; `check_against_guide(values)`
turns out-of-range values into advice and `format_guide()` renders the table as Markdown for
docs/presets.md (`jax_ppo.runs.reference`).

Sources: the N+ implementation details of RLHF with PPO (Huang et al. 2024), TRL's PPO defaults,
Ziegler et al. 2019 (adaptive KL controller) and practitioners' tuning guides.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping
from typing import Any, NamedTuple

PRESETS: Mapping[str, Mapping[str, Any]] = types.MappingProxyType(
    {
        "dialogue": types.MappingProxyType(
            {"clip_eps": 0.15, "optimizer.learning_rate": 3e-6,
             "batch_size": 64, "entropy_coef": 0.03}
        ),
        "knowledge_qa": types.MappingProxyType(
            {"clip_eps": 0.2, "optimizer.learning_rate": 1e-6,
             "batch_size": 32, "entropy_coef": 0.01}
        ),
        "creative": types.MappingProxyType(
            {"clip_eps": 0.1, "optimizer.learning_rate": 5e-6,
             "batch_size": 128, "entropy_coef": 0.05}
        ),
    }
)
"""Scenario name -> `PPOConfig` values by dotted key (read-only).

* `dialogue`: moderate clipping and some entropy to keep replies varied.
* `knowledge_qa`: small, careful updates (low lr, little entropy) so facts are not forgotten.
* `creative`: tight clipping but a higher lr, larger batches and more entropy for diversity.
"""


LORA_SCALED = "optimizer.learning_rate"
"""The guide's key whose range is 10x higher for LoRA adapters."""


def nest(dotted: Mapping[str, Any]) -> dict[str, Any]:
  """`{"a.b": 1, "c": 2}` -> `{"a": {"b": 1}, "c": 2}` (a config file's nesting)."""
  out: dict[str, Any] = {}
  for key, value in dotted.items():
    *parents, leaf = key.split(".")
    node = out
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = value
  return out


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """`{"a": {"b": 1}, "c": 2}` -> `{"a.b": 1, "c": 2}`; nested dataclasses count as mappings."""
  out = {}
  for key, value in values.items():
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
      value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
      out.update(flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def preset_overrides(name: str) -> dict[str, Any]:
  """The values of a scenario preset as a new nested dict (the shape of a `ppo` section:
  `{"clip_eps": 0.15, "optimizer": {"learning_rate": 3e-6}, ...}`).

  Args:
    name: one of `PRESETS` ("dialogue", "knowledge_qa", "creative").

  Raises:
    ValueError: for an unknown name, listing the available presets.
  """
  if name not in PRESETS:
    raise ValueError(f"Unknown preset {name!r}; available presets: {', '.join(sorted(PRESETS))}.")
  return nest(PRESETS[name])


class GuideEntry(NamedTuple):
  """One row of the hyperparameter guide."""

  low: float
  """Lowest recommended value."""
  high: float
  """Highest recommended value."""
  default: float | None
  """A good starting value (None: off)."""
  advice: str
  """One line on what the parameter does and how to move it."""


HYPERPARAMETER_GUIDE: Mapping[str, GuideEntry] = types.MappingProxyType(
    {
        "optimizer.learning_rate": GuideEntry(
            1e-6,
            5e-6,
            3e-6,
            "Full fine-tuning; decay linearly or cosine to 0. LoRA adapters take ~10x higher "
            "(1e-5..5e-5). Lower it first when KL or clip fraction runs away.",
        ),
        "clip_eps": GuideEntry(
            0.1,
            0.3,
            0.2,
            "PPO ratio clip range; tighten (0.1) when updates are unstable, widen when learning "
            "stalls with a near-zero clip fraction.",
        ),
        "kl_coef": GuideEntry(
            0.01,
            0.2,
            0.05,
            "KL penalty beta against the reference (initial value with a controller); raise it "
            "when KL keeps growing, or use the adaptive controller with kl_target.",
        ),
        "kl_target": GuideEntry(
            1.0,
            10.0,
            6.0,
            "Target KL (nats per sequence) of the adaptive KL controller (Ziegler et al. 2019: 6, "
            "horizon 10000); lower keeps the policy closer to the reference.",
        ),
        "target_kl": GuideEntry(
            0.01,
            0.1,
            None,
            "Early stop: skip the remaining epochs once an epoch's mean approximate KL exceeds it "
            "(None disables); set it when later epochs overshoot.",
        ),
        "entropy_coef": GuideEntry(
            0.0,
            0.05,
            0.0,
            "Entropy bonus; the KL penalty usually suffices. Add 0.01-0.05 when responses "
            "collapse to a few repeated outputs.",
        ),
        "gamma": GuideEntry(
            1.0,
            1.0,
            1.0,
            "No discounting within a response: the score arrives at the last token.",
        ),
        "lam": GuideEntry(
            0.95,
            1.0,
            0.95,
            "GAE lambda; 0.95 trades a little bias for much lower variance, 1.0 is Monte-Carlo.",
        ),
        "vf_coef": GuideEntry(
            0.1,
            0.5,
            0.1,
            "Value-loss weight; raise it when the value loss plateaus.",
        ),
        "value_clip_eps": GuideEntry(
            0.1,
            0.3,
            0.2,
            "Value-prediction clip around the old values (cliprange_value); None disables.",
        ),
        "ppo_epochs": GuideEntry(
            1,
            4,
            4,
            "Passes over each rollout batch; reduce when the clip fraction or KL is high.",
        ),
        "batch_size": GuideEntry(
            32,
            512,
            64,
            "Responses per update; larger batches give less noisy advantages and steadier "
            "rewards.",
        ),
        "num_minibatches": GuideEntry(
            1,
            4,
            1,
            "Optimizer steps per epoch; must divide batch_size. More minibatches mean more, "
            "noisier updates per rollout.",
        ),
        "sampling.temperature": GuideEntry(
            0.7,
            1.0,
            0.7,
            "Sampling temperature, used for old, new and reference log-probs too; below 0.7 "
            "exploration suffers.",
        ),
        "optimizer.max_grad_norm": GuideEntry(
            0.5,
            1.0,
            1.0,
            "Global gradient-norm clip; keep it on, lower it when losses spike.",
        ),
    }
)
"""Dotted `PPOConfig` key -> recommended range, default and advice (PPO fine-tuning of LLMs)."""


def _values_of(values: Mapping[str, Any] | Any) -> Mapping[str, Any]:
  if dataclasses.is_dataclass(values) and not isinstance(values, type):
    return flatten({f.name: getattr(values, f.name) for f in dataclasses.fields(values)})
  if not isinstance(values, Mapping):
    raise TypeError(f"values must be a mapping or a dataclass instance, got {type(values)}")
  return flatten(values)


def _fmt(value: float) -> str:
  """Short number format: ints as ints, floats as 3e-6 (not 3e-06), 0.2, 1.0."""
  if isinstance(value, int):
    return str(value)
  text = f"{value:g}".replace("e-0", "e-").replace("e+0", "e+")
  if text.lstrip("-").isdigit():
    text += ".0"
  return text


def _span(low: float, high: float, sep: str) -> str:
  return _fmt(low) if low == high else f"{_fmt(low)}{sep}{_fmt(high)}"


def check_against_guide(values: Mapping[str, Any] | Any, *, lora: bool = False) -> list[str]:
  """Advice for each value outside the guide's recommended range.

  Args:
    values: dotted key -> value, a nested mapping (a `ppo` section) or a config dataclass
      instance (`PPOConfig`). Keys missing from the guide, `None` and non-numeric values are
      ignored.
    lora: the run trains LoRA adapters, which take a learning rate about 10x higher.

  Returns:
    One line per out-of-range field, in guide order, naming the value, the range and the advice;
    plus a line when `num_minibatches` does not divide `batch_size`. Empty when all is in range.
  """
  values = _values_of(values)
  advice = []
  for field, entry in HYPERPARAMETER_GUIDE.items():
    value = values.get(field)
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
      continue
    low, high = entry.low, entry.high
    if field == LORA_SCALED and lora:
      low, high = 10 * low, 10 * high
    if math.isnan(value) or value < low or value > high:
      where = "below" if value < low else "above" if value > high else "outside"
      span = _span(low, high, "..")
      advice.append(
          f"{field}={_fmt(value)} is {where} the recommended {span}"
          f"{' (LoRA)' if field == LORA_SCALED and lora else ''}: {entry.advice}"
      )
  batch, minibatches = values.get("batch_size"), values.get("num_minibatches")
  if isinstance(batch, int) and isinstance(minibatches, int) and minibatches > 0:
    if batch % minibatches:
      advice.append(
          f"num_minibatches={minibatches} does not divide batch_size={batch}: choose a divisor "
          "so every rollout is used exactly once per epoch."
      )
  return advice


def format_guide() -> str:
  """The hyperparameter guide as a Markdown table (field, range, default, advice)."""
  lines = [
      "| Field | Recommended range | Default | Advice |",
      "| --- | --- | --- | --- |",
  ]
  for field, entry in HYPERPARAMETER_GUIDE.items():
    span = _span(entry.low, entry.high, " to ")
    default = "None (off)" if entry.default is None else _fmt(entry.default)
    lines.append(f"| `{field}` | {span} | {default} | {entry.advice} |")
  return "\n".join(lines) + "\n"


def format_presets() -> str:
  """The scenario presets as a Markdown table (one column per preset)."""
  fields = list(dict.fromkeys(f for p in PRESETS.values() for f in p))
  lines = [
      "| Field | " + " | ".join(f"`{name}`" for name in PRESETS) + " |",
      "| --- |" + " --- |" * len(PRESETS),
  ]
  for field in fields:
    cells = [_fmt(p[field]) if field in p else "" for p in PRESETS.values()]
    lines.append(f"| `{field}` | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"
