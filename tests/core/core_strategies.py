"""Hypothesis strategies and assertion helpers shared by the tests of `jax_ppo.core`.

Shapes are drawn from a handful of `(B, T)` and `(B, T, V)` shapes: JAX compiles a program
once per input shape and dtype, so a few shapes shared by all tests keep the suite fast while
still covering a single row, a single step, both together and uneven sizes. For the same reason
each `(B, T)` comes with one mask dtype (bool or float32), so both dtypes are exercised without
doubling the compilations.

Values are drawn on a coarse grid (multiples of 1/8 by default) rather than from arbitrary
floats: every property then holds without catastrophic cancellation in float32, so the
float32-vs-float64 comparisons can use tight tolerances. Masks cover the cases that break
padding code: rows of only padding, a single valid token in the whole batch, holes, left and
right padding, and bool, float and int dtypes.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

BATCH_SHAPES = ((1, 1), (1, 4), (3, 1), (3, 4), (2, 6))
MASK_DTYPE_OF_SHAPE = {
    (1, 1): np.bool_,
    (1, 4): np.float32,
    (3, 1): np.float32,
    (3, 4): np.bool_,
    (2, 6): np.float32,
}
LOGITS_SHAPES = ((1, 1, 5), (1, 4, 2), (3, 1, 2), (3, 4, 5), (2, 6, 5))

NONFINITE_JUNK = (np.nan, np.inf, -np.inf, 1e30, -1e30, 123.0)
FINITE_JUNK = (1e4, -1e4, 50.0, -50.0, 123.0, 0.0)


def batch_shapes():
  """`(B, T)` pairs."""
  return st.sampled_from(BATCH_SHAPES)


def logits_shapes():
  """`(B, T, V)` triples."""
  return st.sampled_from(LOGITS_SHAPES)


def grid_arrays(shape, *, lo: float = -4.0, hi: float = 4.0, step: float = 0.125):
  """float32 arrays whose entries are multiples of `step` in `[lo, hi]`."""
  n_lo, n_hi = int(round(lo / step)), int(round(hi / step))
  # `fill=st.nothing()` draws every entry: no array made mostly of one repeated value.
  return hnp.arrays(np.int64, shape, elements=st.integers(n_lo, n_hi), fill=st.nothing()).map(
      lambda a: (a * step).astype(np.float32)
  )


ROW_KINDS = ("prefix", "segment", "empty", "single", "full", "random", "holes")


@st.composite
def masks(draw, shape, *, contiguous: bool = False, dtypes=None) -> np.ndarray:
  """`[B, T]` masks of dtype `MASK_DTYPE_OF_SHAPE[shape]`, or drawn from `dtypes`.

  The whole batch is padding (1 in 10 draws), or holds a single valid token (1 in 10), or each
  row independently is right-padded ("prefix"), padded on both sides ("segment"), empty, a
  single token, full, random, or random with a hole ("holes": valid, padding, ..., valid). With
  `contiguous=True` only the first five kinds are used, as for real responses. The structure
  comes from a drawn seed rather than from Hypothesis' own choices, which favour the simplest
  masks and would rarely produce holes.
  """
  b, t = shape
  rng = np.random.default_rng(draw(seeds()))
  mode = rng.choice(["rows", "one_valid", "all_padding"], p=[0.8, 0.1, 0.1])
  m = np.zeros((b, t), bool)
  if mode == "one_valid":
    m[rng.integers(b), rng.integers(t)] = True
  elif mode == "rows":
    kinds = ROW_KINDS[:5] if contiguous else ROW_KINDS
    for row in range(b):
      kind = rng.choice(kinds)
      if kind in ("random", "holes"):
        m[row] = rng.random(t) < 0.5
        if kind == "holes" and t >= 3:
          m[row, 0], m[row, 1], m[row, -1] = True, False, True
      elif kind == "prefix":
        m[row, : rng.integers(t + 1)] = True
      elif kind == "segment":
        start = rng.integers(t + 1)
        m[row, start : rng.integers(start, t + 1)] = True
      elif kind == "single":
        m[row, rng.integers(t)] = True
      elif kind == "full":
        m[row] = True
  if dtypes is None:
    return m.astype(MASK_DTYPE_OF_SHAPE.get(tuple(shape), np.bool_))
  return m.astype(draw(st.sampled_from(dtypes)))


def junk(shape, *, nonfinite: bool = True):
  """float32 arrays of values that must never matter (NaN, inf, huge)."""
  pool = NONFINITE_JUNK if nonfinite else FINITE_JUNK
  return hnp.arrays(np.float32, shape, elements=st.sampled_from(pool), fill=st.nothing())


def fill_masked(x: np.ndarray, mask: np.ndarray, fill: np.ndarray) -> np.ndarray:
  """`x` with the entries where `mask == 0` replaced by `fill` (broadcast over trailing axes)."""
  m = np.asarray(mask) != 0
  m = m.reshape(m.shape + (1,) * (np.ndim(x) - m.ndim))
  return np.where(m, x, fill).astype(np.asarray(x).dtype)


def permutations(n: int):
  return st.permutations(list(range(n))).map(np.asarray)


def seeds():
  return st.integers(0, 2**32 - 1)


def f64(x) -> np.ndarray:
  return np.asarray(x, np.float64)


def assert_close(
    actual, expected, *, rtol: float = 1e-5, atol: float = 1e-5, err_msg: str = ""
) -> None:
  np.testing.assert_allclose(f64(actual), f64(expected), rtol=rtol, atol=atol, err_msg=err_msg)


def assert_f32_scalar(x) -> None:
  assert np.shape(x) == (), np.shape(x)
  assert np.asarray(x).dtype == np.float32, np.asarray(x).dtype


@functools.cache
def _jitted(fn, static_argnames: tuple[str, ...]):
  return jax.jit(fn, static_argnames=static_argnames)


def jit_call(fn, *args, **kwargs):
  """`fn(*args, **kwargs)` under one cached `jax.jit` per function and static configuration.

  String, bool and int keywords (estimator, reduction, group_size, axis, ...) are static; float
  keywords (gamma, clip_eps, temperature, ...) are traced, so new values do not recompile.
  Property tests call the core through this: compiling one program per shape is several times
  cheaper than eager dispatch, which compiles every primitive for every new shape. Eager calls
  are compared with jitted ones in each module's jit/vmap test.
  """
  static = tuple(sorted(k for k, v in kwargs.items() if isinstance(v, (str, int))))
  return _jitted(fn, static)(*args, **kwargs)
