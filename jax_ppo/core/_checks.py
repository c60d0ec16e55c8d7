"""Trace-time argument validation shared by the core functions.

Every check runs on static information only (shapes, dtypes, Python scalars), so it costs nothing
inside `jax.jit` and raises a `ValueError` naming the offending argument before anything is traced
further. Values that arrive as traced arrays (for instance a KL coefficient that changes during
training) cannot be checked here and are documented as the caller's responsibility.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

REDUCTIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum-norm")
"""The `reduction`s of the policy and value losses (`aggregate_loss`)."""


def shape_of(x) -> tuple[int, ...]:
  return tuple(jnp.shape(x))


def check_rank(name: str, x, rank: int, layout: str) -> None:
  """Raises unless `x` has exactly `rank` dimensions (`layout` is e.g. "[B, T]")."""
  shape = shape_of(x)
  if len(shape) != rank:
    raise ValueError(
        f"`{name}` must have rank {rank} with layout {layout}, got shape {shape}."
    )


def check_same_shape(**arrays) -> None:
  """Raises unless all keyword arrays share one shape; the message lists every shape."""
  shapes = {name: shape_of(x) for name, x in arrays.items()}
  if len(set(shapes.values())) > 1:
    listing = ", ".join(f"`{n}` {s}" for n, s in shapes.items())
    raise ValueError(f"Shapes must match: {listing}.")


def check_per_token(name: str, x, layout: str, token_name: str, tokens) -> None:
  """Raises unless `x`'s leading `[B, T]` equals the shape of the `[B, T]` array `tokens`."""
  if shape_of(x)[:2] != shape_of(tokens):
    raise ValueError(
        f"`{name}` {layout} and `{token_name}` [B, T] disagree: `{name}` {shape_of(x)}, "
        f"`{token_name}` {shape_of(tokens)}."
    )


def check_per_row(name: str, x, ref_name: str, ref) -> None:
  """Raises unless the `[B]` array `x` has one entry per row of the `[B, T]` array `ref`."""
  check_rank(name, x, 1, "[B]")
  if shape_of(x)[0] != shape_of(ref)[0]:
    raise ValueError(
        f"`{name}` [B] must match the batch of `{ref_name}` [B, T]: `{name}` {shape_of(x)}, "
        f"`{ref_name}` {shape_of(ref)}."
    )


def is_concrete(x) -> bool:
  """True for Python numbers and non-traced arrays, whose value can be checked now."""
  return not isinstance(x, jax.core.Tracer)


def check_scalar_range(
    name: str,
    value,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
) -> None:
  """Checks a hyperparameter against an interval when its value is known at trace time."""
  if value is None or not is_concrete(value):
    return
  if jnp.ndim(value) != 0:
    return  # Per-row arrays are allowed where documented; ranges are checked on scalars only.
  v = float(value)
  ok = True
  if low is not None:
    ok &= v >= low if low_inclusive else v > low
  if high is not None:
    ok &= v <= high if high_inclusive else v < high
  if not ok or math.isnan(v):
    lo = "(-inf" if low is None else ("[" if low_inclusive else "(") + f"{low}"
    hi = "inf)" if high is None else f"{high}" + ("]" if high_inclusive else ")")
    raise ValueError(f"`{name}` must lie in {lo}, {hi}, got {v}.")


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
  if value not in choices:
    raise ValueError(f"Unknown `{name}` {value!r}; expected one of {tuple(choices)}.")
