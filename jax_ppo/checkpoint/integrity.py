"""Reading a checkpoint safely: the arrays it should hold, what differs, and Orbax's reads.

`RunCheckpointer` checks a step before Orbax reads any array: `structure_differences` compares
the saved array metadata with the live state (`abstract_like`), and a failed read is summarised
in one line (`error_summary`, `unparsable_json_files`). `orbax_reads_drained` lets Orbax's
pending reads finish before their event loop closes, so a damaged file gives one error instead
of a flood of "Event loop is closed" tracebacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import re
import threading
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax

_MISSING = "<missing>"
"""How a path absent on one side of a comparison is shown."""


def abstract_like(tree: Any) -> Any:
  """`jax.ShapeDtypeStruct`s (with shardings) of a live pytree: the restore target."""

  def spec(x):
    if isinstance(x, jax.Array):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return jax.eval_shape(lambda: x)

  return jax.tree.map(spec, tree)


def _spec_text(shape: tuple[int, ...] | None, dtype: Any) -> str:
  """`float32[16, 32]`: how a saved or expected array is shown in messages."""
  if shape is None:
    return _MISSING
  return f"{'<any dtype>' if dtype is None else dtype}[{', '.join(str(n) for n in shape)}]"


def _array_specs(tree: Any, prefix: str = "") -> dict[str, tuple[tuple[int, ...], Any]]:
  """`{dotted path: (shape, dtype)}` of the array leaves of a nested dict/list tree.

  The tree is Orbax's serialized form of a state (`ocp.tree.serialize_tree`) or its saved
  metadata tree (`ArrayMetadata` leaves); both name a leaf by the same keys, so paths match.
  `None` and empty containers hold no array and are skipped.
  """
  if isinstance(tree, Mapping):
    items: Any = tree.items()
  elif isinstance(tree, list | tuple):
    items = enumerate(tree)
  elif tree is None:
    return {}
  else:
    shape = getattr(tree, "shape", None)
    dtype = getattr(tree, "dtype", None)
    return {prefix[:-1] or "<root>": (tuple(shape) if shape is not None else (), dtype)}
  out: dict[str, tuple[tuple[int, ...], Any]] = {}
  for key, value in items:
    out.update(_array_specs(value, f"{prefix}{key}."))
  return out


class _ShapeOnly:
  """An expected leaf whose dtype is not checked (a host scalar or NumPy array in `like`, which
  Orbax casts to the restore target's dtype)."""

  def __init__(self, shape: tuple[int, ...]):
    self.shape, self.dtype = shape, None


def expected_specs(like: Any, target: Any) -> Any:
  """`target` (abstract `like`) with dtype-free leaves where `like` holds no JAX array."""

  def spec(x: Any, t: Any) -> Any:
    return t if isinstance(x, jax.Array | jax.ShapeDtypeStruct) else _ShapeOnly(tuple(t.shape))

  return jax.tree.map(spec, like, target)


def structure_differences(saved: Any, expected: Any) -> list[tuple[str, str, str]]:
  """`(path, saved, expected)` for every array whose presence, shape or dtype differs.

  In the order of the live state's leaves (so a model's parameters come before their optimizer
  moments), then the paths found only in the checkpoint.

  Args:
    saved: the checkpoint's array metadata tree (nested dicts/lists of `ArrayMetadata`).
    expected: the serialized abstract target (nested dicts/lists of `jax.ShapeDtypeStruct`, or
      of `_ShapeOnly` where only the shape is checked).
  """
  a, b = _array_specs(saved), _array_specs(expected)

  def same_dtype(x: Any, y: Any) -> bool:
    if x is None or y is None:
      return True  # (a leaf without a dtype is checked by its shape alone)
    try:
      return jax.numpy.dtype(x) == jax.numpy.dtype(y)
    except TypeError:
      return str(x) == str(y)

  out = []
  for path in [*b, *(p for p in a if p not in b)]:
    sa, sb = a.get(path), b.get(path)
    if sa is not None and sb is not None and sa[0] == sb[0] and same_dtype(sa[1], sb[1]):
      continue
    out.append((path, _spec_text(*(sa or (None, None))), _spec_text(*(sb or (None, None)))))
  return out


def error_summary(error: BaseException) -> str:
  """The innermost cause of an (Orbax / TensorStore) error as `Type: first line`, shortened.

  Orbax wraps TensorStore failures in exceptions whose text is a whole TensorStore spec; the
  innermost one says what is wrong ("OUT_OF_RANGE: Error reading "w/0.0" ... byte range").
  """
  chain, seen = [], set()
  current: BaseException | None = error
  while current is not None and id(current) not in seen:
    seen.add(id(current))
    chain.append(current)
    current = current.__cause__ or current.__context__
  for e in reversed(chain):
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if text:
      text = text if len(text) <= 400 else text[:400] + "..."
      return f"{type(e).__name__}: {text}"
  return type(error).__name__


def unparsable_json_files(folder: pathlib.Path) -> list[pathlib.Path]:
  """The JSON files under `folder` (Orbax's metadata files) that are empty or do not parse.

  Orbax's JSON errors do not name their file; this finds it. Binary files (array data, OCDBT
  manifests) are recognised by their first byte and skipped.
  """
  bad = []
  for path in sorted(p for p in folder.rglob("*") if p.is_file()):
    if path.stat().st_size > (16 << 20):
      continue
    data = path.read_bytes()
    if data and data.lstrip()[:1] not in (b"{", b"["):
      continue
    try:
      json.loads(data)
    except ValueError:
      bad.append(path)
  return bad


def has_json_error(error: BaseException) -> bool:
  """Whether `error` or any error in its cause/context chain is a JSON decoding error (a damaged
  Orbax metadata file)."""
  current, seen = error, set()
  while current is not None and id(current) not in seen:
    if isinstance(current, json.JSONDecodeError):
      return True
    seen.add(id(current))
    current = current.__cause__ or current.__context__
  return False


ARRAY_KEY = re.compile(r'Error (?:reading|opening) "([^"/]+)/')
"""TensorStore's error text names the array it failed to read: group 1 is the array's key."""
_DRAIN_TIMEOUT_S = 60.0
_DRAIN_LOCK = threading.RLock()


def _close_after_pending_tasks(loop: asyncio.AbstractEventLoop, close: Callable[[], None]) -> None:
  """Runs `loop` until its pending tasks end, then closes it."""
  if not loop.is_closed() and not loop.is_running():
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    if pending:
      loop.run_until_complete(asyncio.wait(pending, timeout=_DRAIN_TIMEOUT_S))
    for task in pending:
      if task.done() and not task.cancelled():
        task.exception()  # (retrieved: no "Task exception was never retrieved" log)
  close()


@contextlib.contextmanager
def orbax_reads_drained():
  """Makes Orbax's synchronous calls on this thread finish their pending reads before closing.

  Orbax runs each restore in a fresh event loop (`asyncio.new_event_loop()`) and gathers one
  TensorStore read per array. When one read fails (a damaged file, a shape error), the gather
  raises at once and the loop is closed while the other reads are still in flight; each of
  them then completes into the closed loop and prints a "RuntimeError: Event loop is closed"
  traceback on stderr (dozens for a model). Inside this context, loops created on the calling
  thread first run their pending tasks to completion (at most `_DRAIN_TIMEOUT_S`) when closed,
  so the error comes back alone. Other threads' loops are untouched.
  """
  with _DRAIN_LOCK:  # (one policy swap at a time; the lock is re-entrant for nested calls)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)  # (the policy API, Python >= 3.14)
      base = getattr(asyncio.events, "_AbstractEventLoopPolicy", None) or getattr(
          asyncio, "AbstractEventLoopPolicy", None)
      swappable = base is not None and hasattr(asyncio, "set_event_loop_policy")
      previous = asyncio.get_event_loop_policy() if swappable else None
    if previous is None:
      yield
      return
    thread = threading.get_ident()

    class DrainingPolicy(base):
      def get_event_loop(self):
        return previous.get_event_loop()

      def set_event_loop(self, loop):
        return previous.set_event_loop(loop)

      def new_event_loop(self):
        loop = previous.new_event_loop()
        if threading.get_ident() == thread:
          close = loop.close
          loop.close = lambda: _close_after_pending_tasks(loop, close)
        return loop

      def __getattr__(self, name):  # (child watchers on older Pythons)
        return getattr(previous, name)

    with warnings.catch_warnings():
      warnings.simplefilter("ignore", DeprecationWarning)
      asyncio.set_event_loop_policy(DrainingPolicy())
    try:
      yield
    finally:
      with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        asyncio.set_event_loop_policy(previous)
