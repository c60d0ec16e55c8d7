"""The errors a checkpoint folder can raise, and the check that a checkpoint belongs to the run.

`check_config` compares the configuration stored with a checkpoint against the run's (flattened
to dotted keys), so a resume under other computing settings is refused naming every difference.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


class CheckpointError(RuntimeError):
  """A checkpoint exists but cannot be read (or a requested step does not exist)."""


class CheckpointConfigMismatch(ValueError):
  """The checkpoint directory holds a run whose configuration differs from the current one.

  Attributes:
    differences: `(dotted key, saved value, current value)` for every differing field.
  """

  def __init__(self, message: str, differences: Sequence[tuple[str, Any, Any]]):
    super().__init__(message)
    self.differences = list(differences)


class CheckpointCorrupt(CheckpointError):
  """A committed checkpoint step is damaged: a file is missing, truncated or unreadable.

  Attributes:
    step: the damaged step.
    where: the damaged file, item folder or array, for the message.
    reason: what is wrong with it.
  """

  def __init__(self, message: str, *, step: int, where: str, reason: str):
    super().__init__(message)
    self.step, self.where, self.reason = step, where, reason


class CheckpointStructureMismatch(CheckpointError):
  """A checkpoint's arrays have other paths, shapes or dtypes than the state restored into.

  Attributes:
    differences: `(parameter path, saved, expected)` for every differing array, where saved
      and expected read like "float32[16, 32]" or "<missing>".
  """

  def __init__(self, message: str, differences: Sequence[tuple[str, str, str]]):
    super().__init__(message)
    self.differences = list(differences)


_MISSING = "<missing>"


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  if isinstance(tree, Mapping):
    out: dict[str, Any] = {}
    for key, value in tree.items():
      out.update(_flatten(value, f"{prefix}{key}."))
    if not tree and prefix:
      out[prefix[:-1]] = {}
    return out
  return {prefix[:-1]: tree}


def config_differences(
    saved: Mapping[str, Any], current: Mapping[str, Any], *, ignore: Sequence[str] = ()
) -> list[tuple[str, Any, Any]]:
  """Fields (dotted keys) whose values differ between two config dicts.

  Args:
    saved: the configuration stored with a checkpoint (plain dict).
    current: the configuration of the run being started (plain dict).
    ignore: dotted keys (or prefixes of them, e.g. "monitor") that may differ.

  Returns:
    `(key, saved value, current value)` triples in key order; a key present on one side only
    shows `"<missing>"` on the other.
  """
  a, b = _flatten(saved), _flatten(current)

  def ignored(key: str) -> bool:
    return any(key == p or key.startswith(p + ".") for p in ignore)

  return [
      (key, a.get(key, _MISSING), b.get(key, _MISSING))
      for key in sorted(set(a) | set(b))
      if not ignored(key) and a.get(key, _MISSING) != b.get(key, _MISSING)
  ]


def check_config(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    *,
    where: str,
    ignore: Sequence[str] = (),
    config_type: type | None = None,
) -> None:
  """Raises `CheckpointConfigMismatch` naming every differing field (see `config_differences`).

  Args:
    saved: the stored configuration (plain dict).
    current: the configuration of the run being started (plain dict).
    where: what holds the saved configuration, for the message (e.g. "'runs/a' (step 40)").
    ignore: dotted keys (or prefixes) allowed to differ.
    config_type: the dataclass `current` was made from; fields `saved` lacks (it was written
      before they were added) count at their defaults (`jax_ppo.config_io.with_defaults`).
  """
  if config_type is not None:
    from jax_ppo.config_io import with_defaults

    saved = with_defaults(config_type, saved)
  diffs = config_differences(saved, current, ignore=ignore)
  if not diffs:
    return
  shown = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, a, b in diffs[:20])
  more = f" (and {len(diffs) - 20} more)" if len(diffs) > 20 else ""
  raise CheckpointConfigMismatch(
      f"{where} holds a run with a different configuration: {shown}{more}. Resume with the "
      "saved configuration, or start the new run in another directory; nothing was changed.",
      diffs,
  )


def plain_config(config: Any) -> dict[str, Any] | None:
  """A dataclass config or mapping as JSON-round-tripped plain types (None stays None)."""
  if config is None:
    return None
  if isinstance(config, Mapping):
    data = dict(config)
  else:
    from jax_ppo.config_io import config_to_dict

    data = config_to_dict(config)
  return json.loads(json.dumps(data))
