"""Loading and saving frozen, keyword-only dataclass configs (YAML/JSON files + `key=value`).

A config is a (possibly nested) dataclass; its annotations say how file and command-line values
are converted. Typical use in an experiment script::

  config = load_config(TrainerConfig, "configs/gpt2_sentiment.yaml", ["learning_rate=3e-6",
                       "sampling.temperature=0.7", "sampling.stop_token_ids=[50256]"])
  save_config(config, run_dir)          # writes run_dir/config.yaml
  assert load_config(TrainerConfig, run_dir) == config

Rules:

* Files are YAML (`.yaml`/`.yml`) or JSON (`.json`) holding a mapping of field names; nested
  dataclass fields are nested mappings; missing fields keep their defaults.
* Overrides are `dotted.key=value` strings; the value is parsed with `yaml.safe_load`, so
  `lr=3e-6`, `flag=true`, `ids=[1,2]`, `name=null` work. Where the field is a string, text that
  YAML would read as something else (`name=123`, `mode=yes`) is kept as text.
* Values are converted to the annotated type: lists to tuples for `tuple[...]` fields, numbers
  written as text (YAML 1.1 reads `3e-6` as a string) to floats, integral floats to ints,
  mappings to nested dataclasses, values to enums and paths; `Optional[X]`/`X | None` accept
  `null`. Anything else that does not match raises a `ValueError` naming the key.
* Unknown keys raise a `ValueError` naming the key, suggesting the closest field name and listing
  the valid ones. Validation in the dataclass's `__post_init__` runs as usual.

Annotations are resolved with `typing.get_type_hints`, so configs may use
`from __future__ import annotations`.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import os
import pathlib
import tempfile
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import yaml

T = TypeVar("T")

CONFIG_FILENAME = "config.yaml"
"""File name used when `save_config`/`load_config` are given a directory (a run folder)."""

_YAML_SUFFIXES = (".yaml", ".yml")
_JSON_SUFFIXES = (".json",)


class _Mismatch(Exception):
  """A value does not fit a type; turned into a ValueError that names the key."""


# ---- public API ----------------------------------------------------------------------------------


def config_to_dict(config: Any) -> dict[str, Any]:
  """A dataclass config as plain YAML/JSON types (dicts, lists, str, int, float, bool, None).

  Nested dataclasses become dicts, tuples become lists, enums their values and paths strings.
  Fields with `init=False` (derived values) are left out.
  """
  if not dataclasses.is_dataclass(config) or isinstance(config, type):
    raise TypeError(f"config_to_dict expects a dataclass instance, got {type(config).__name__}")
  return _plain(config)


def config_from_dict(cls: type[T], data: Mapping[str, Any]) -> T:
  """Builds `cls` from a (nested) mapping, converting values to the annotated field types.

  Raises:
    ValueError: for unknown keys (with a suggestion), missing required keys and values that do
      not fit the field's type; each message names the dotted key.
  """
  if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
    raise TypeError(f"config_from_dict expects a dataclass type, got {cls!r}")
  return _build(cls, data, prefix="")


def parse_override(text: str) -> tuple[str, str]:
  """Splits `"dotted.key=value"` into the key and the raw value text."""
  key, sep, value = text.partition("=")
  key = key.strip()
  if not sep or not key or any(not part for part in key.split(".")):
    raise ValueError(
        f"Invalid override {text!r}: write key=value, with dots for nested fields "
        "(e.g. sampling.temperature=0.7)."
    )
  return key, value.strip()


def apply_overrides(
    cls: type, data: Mapping[str, Any], overrides: Sequence[str]
) -> dict[str, Any]:
  """Returns a copy of `data` with `key=value` overrides applied (later ones win).

  Each key is checked against `cls` (dotted keys walk into nested dataclass fields) and each value
  against the field's type, so errors name the override. Values stay plain (parsed YAML or the raw
  text for string fields); `config_from_dict` converts them.
  """
  if isinstance(overrides, str):
    raise TypeError("overrides must be a sequence of 'key=value' strings, not one string")
  result = _copy_tree(data)
  for text in overrides:
    key, raw = parse_override(text)
    parts = key.split(".")
    owner: type = cls
    node = result
    for depth, part in enumerate(parts):
      hints = _init_hints(owner)
      dotted = ".".join(parts[: depth + 1])
      if part not in hints:
        raise ValueError(_unknown_key_message(owner, dotted, part, hints))
      tp = hints[part]
      if depth == len(parts) - 1:
        where = f"Config key '{dotted}' ({owner.__name__}.{part}) in override {text!r}"
        node[part] = _override_value(tp, raw, where)
        break
      nested = _dataclass_of(tp)
      if nested is None:
        raise ValueError(
            f"Invalid override {text!r}: {owner.__name__}.{part} has type {_type_name(tp)}, "
            f"not a nested config, so '{dotted}' takes no sub-keys; write {dotted}=<value>."
        )
      child = node.get(part)
      if dataclasses.is_dataclass(child) and not isinstance(child, type):
        child = _plain(child)
      if not isinstance(child, dict):
        child = {}
      node[part] = child
      node, owner = child, nested
  return result


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
  """Reads a YAML or JSON config file (or `config.yaml` in a directory) into a dict."""
  path = _resolve_path(path)
  suffix = path.suffix.lower()
  try:
    text = path.read_text(encoding="utf-8")
  except UnicodeDecodeError as e:
    raw = path.read_bytes()
    line = raw.count(b"\n", 0, e.start) + 1
    column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
    raise ValueError(f"Config file {str(path)!r}, line {line}, column {column}: not valid UTF-8; "
                     "save it as UTF-8.") from None
  if suffix in _JSON_SUFFIXES:
    try:
      data = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
      raise ValueError(f"Config file {str(path)!r}, line {e.lineno}, column {e.colno}: invalid "
                       f"JSON ({e.msg}).") from None
  elif suffix in _YAML_SUFFIXES:
    try:
      data = yaml.safe_load(text)
    except yaml.YAMLError as e:
      raise ValueError(_yaml_error_message(path, e)) from None
  else:
    raise ValueError(
        f"Config file {str(path)!r} has an unsupported suffix {suffix!r}; use one of "
        f"{', '.join(_YAML_SUFFIXES + _JSON_SUFFIXES)}."
    )
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise ValueError(
        f"Config file {str(path)!r} must hold a mapping of field names, got {type(data).__name__}."
    )
  return data


def check_keys(cls: type, data: Any, *, source: str) -> None:
  """Raises a ValueError for the first key of `data` that is no field of `cls` (nested mappings
  are checked against nested dataclass fields), naming `source` (e.g. the config file), the
  dotted key and the closest valid one. Values are not checked (`config_from_dict` does)."""
  def walk(owner: type, node: Any, prefix: str) -> None:
    if not isinstance(node, Mapping):
      return
    hints = _init_hints(owner)
    for key, value in node.items():
      if key not in hints:
        raise ValueError(f"{source}: " + _unknown_key_message(owner, f"{prefix}{key}", str(key),
                                                             hints))
      nested = _dataclass_of(hints[key])
      if nested is not None:
        walk(nested, value, f"{prefix}{key}.")

  walk(cls, data, "")


def load_config(
    cls: type[T],
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
) -> T:
  """Builds `cls` from an optional YAML/JSON file and `key=value` overrides.

  Args:
    cls: the (frozen, keyword-only) dataclass config type.
    path: a `.yaml`, `.yml` or `.json` file, or a run folder holding `config.yaml`; None starts
      from the dataclass defaults.
    overrides: `dotted.key=value` strings applied after the file.
  """
  data = read_config_file(path) if path is not None else {}
  if path is not None:
    check_keys(cls, data, source=f"Config file {str(_resolve_path(path))!r}")
  return config_from_dict(cls, apply_overrides(cls, data, overrides))


def config_from_argv(cls: type[T], argv: Sequence[str]) -> T:
  """`load_config` from command-line arguments: at most one config file, then `key=value`s.

  Example: `python train.py configs/base.yaml learning_rate=1e-6 sampling.temperature=0.7`.
  """
  files = [a for a in argv if "=" not in a]
  overrides = [a for a in argv if "=" in a]
  if len(files) > 1:
    raise ValueError(f"Give at most one config file, got {files}; other arguments are key=value.")
  return load_config(cls, files[0] if files else None, overrides)


def override_config(config: T, overrides: Sequence[str]) -> T:
  """A copy of `config` with `key=value` overrides applied."""
  cls = type(config)
  return config_from_dict(cls, apply_overrides(cls, config_to_dict(config), overrides))


def save_config(config: Any, path: str | os.PathLike) -> pathlib.Path:
  """Writes `config` as YAML (or JSON for a `.json` path) so that `load_config` gives it back.

  Args:
    config: a dataclass config instance.
    path: a file path, or an existing directory (a run folder), which gets `config.yaml`.
      Parent directories are created; the file is replaced atomically.

  Returns:
    The path written.
  """
  path = pathlib.Path(path)
  if path.is_dir():
    path = path / CONFIG_FILENAME
  suffix = path.suffix.lower()
  data = config_to_dict(config)
  cls = type(config)
  if suffix in _JSON_SUFFIXES:
    text = json.dumps(data, indent=2) + "\n"
  elif suffix in _YAML_SUFFIXES:
    header = f"# {cls.__module__}.{cls.__qualname__}\n"
    text = header + yaml.safe_dump(data, sort_keys=False, default_flow_style=None)
  else:
    raise ValueError(
        f"save_config: unsupported suffix {suffix!r} in {str(path)!r}; use one of "
        f"{', '.join(_YAML_SUFFIXES + _JSON_SUFFIXES)} or pass a directory."
    )
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "w") as f:
      f.write(text)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise
  return path


# ---- building ------------------------------------------------------------------------------------


def _init_hints(cls: type) -> dict[str, Any]:
  """Resolved annotations of the `init=True` fields of a dataclass, in field order."""
  try:
    hints = typing.get_type_hints(cls)
  except NameError as e:
    raise TypeError(
        f"Cannot resolve the annotations of {cls.__qualname__}: {e}. Define the types it uses at "
        "module level."
    ) from e
  return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls) if f.init}


def _build(cls: type[T], data: Any, prefix: str) -> T:
  where = prefix.rstrip(".") or cls.__name__
  if not isinstance(data, Mapping):
    raise ValueError(
        f"{where}: expected a mapping of {cls.__name__} fields, got {_describe(data)}."
    )
  hints = _init_hints(cls)
  for key in data:
    if key not in hints:
      raise ValueError(_unknown_key_message(cls, f"{prefix}{key}", str(key), hints))
  kwargs = {}
  for name, tp in hints.items():
    if name in data:
      kwargs[name] = _convert_field(cls, name, tp, data[name], prefix)
  missing = [
      f.name
      for f in dataclasses.fields(cls)
      if f.init
      and f.name not in data
      and f.default is dataclasses.MISSING
      and f.default_factory is dataclasses.MISSING
  ]
  if missing:
    keys = ", ".join(f"'{prefix}{m}'" for m in missing)
    raise ValueError(f"{cls.__name__}: missing required key(s) {keys}.")
  return cls(**kwargs)


def _convert_field(cls: type, name: str, tp: Any, value: Any, prefix: str) -> Any:
  dotted = f"{prefix}{name}"
  try:
    return _convert(tp, value, dotted + ".")
  except _Mismatch as e:
    raise ValueError(f"Config key '{dotted}' ({cls.__name__}.{name}): {e}") from None


def _convert(tp: Any, value: Any, prefix: str) -> Any:
  """Converts `value` to type `tp`; raises `_Mismatch` saying what was expected."""
  if tp is Any or tp is object:
    return value
  if tp is type(None):
    if value is None:
      return None
    raise _Mismatch(f"expected null, got {_describe(value)}")
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if origin is typing.Union or origin is types.UnionType:
    if value is None and type(None) in args:
      return None
    for arm in (a for a in args if a is not type(None)):
      try:
        return _convert(arm, value, prefix)
      except _Mismatch:
        pass
    raise _Mismatch(f"expected {_type_name(tp)}, got {_describe(value)}")
  if origin is typing.Literal:
    for choice in args:
      if value == choice and type(value) is type(choice):
        return choice
    raise _Mismatch(f"expected one of {list(args)}, got {_describe(value)}")
  if origin is typing.ClassVar:
    return value
  if isinstance(tp, type) and dataclasses.is_dataclass(tp):
    if isinstance(value, tp):
      return value
    if isinstance(value, Mapping):
      return _build(tp, value, prefix)
    raise _Mismatch(f"expected a mapping of {tp.__name__} fields, got {_describe(value)}")
  if origin is tuple or tp is tuple:
    items = _sequence(value, tp)
    if not args:
      return tuple(items)
    if len(args) == 2 and args[1] is Ellipsis:
      return tuple(_convert_item(args[0], v, i, prefix) for i, v in enumerate(items))
    if args == ((),):  # tuple[()]
      args = ()
    if len(items) != len(args):
      raise _Mismatch(f"expected {_type_name(tp)} with {len(args)} items, got {len(items)}")
    pairs = enumerate(zip(args, items, strict=True))
    return tuple(_convert_item(a, v, i, prefix) for i, (a, v) in pairs)
  if origin in (list, Sequence) or tp is list:
    items = _sequence(value, tp)
    item_type = args[0] if args else Any
    return [_convert_item(item_type, v, i, prefix) for i, v in enumerate(items)]
  if origin in (set, frozenset) or tp in (set, frozenset):
    items = _sequence(value, tp)
    item_type = args[0] if args else Any
    return (origin or tp)(_convert_item(item_type, v, i, prefix) for i, v in enumerate(items))
  if origin in (dict, Mapping) or tp is dict:
    if not isinstance(value, Mapping):
      raise _Mismatch(f"expected a mapping ({_type_name(tp)}), got {_describe(value)}")
    key_type, value_type = args if args else (Any, Any)
    return {
        _convert_item(key_type, k, k, prefix): _convert_item(value_type, v, k, prefix)
        for k, v in value.items()
    }
  if tp is bool:
    if isinstance(value, bool):
      return value
    raise _Mismatch(f"expected a bool (true/false), got {_describe(value)}")
  if tp is int:
    return _to_int(value)
  if tp is float:
    return _to_float(value)
  if tp is str:
    if isinstance(value, str):
      return value
    raise _Mismatch(f"expected a string, got {_describe(value)}")
  if isinstance(tp, type) and issubclass(tp, enum.Enum):
    if isinstance(value, tp):
      return value
    try:
      return tp(value)
    except ValueError:
      if isinstance(value, str) and value in tp.__members__:
        return tp[value]
    raise _Mismatch(
        f"expected one of {[m.value for m in tp]} ({tp.__name__}), got {_describe(value)}"
    )
  if isinstance(tp, type) and issubclass(tp, pathlib.PurePath):
    if isinstance(value, str | os.PathLike):
      return tp(value)
    raise _Mismatch(f"expected a path, got {_describe(value)}")
  if isinstance(tp, type):
    if isinstance(value, tp):
      return value
    raise _Mismatch(f"expected {tp.__name__}, got {_describe(value)}")
  return value  # An annotation this module does not interpret (Callable, TypeVar...).


def _convert_item(tp: Any, value: Any, index: Any, prefix: str) -> Any:
  try:
    return _convert(tp, value, f"{prefix.rstrip('.')}[{index!r}].")
  except _Mismatch as e:
    raise _Mismatch(f"item {index!r}: {e}") from None


def _sequence(value: Any, tp: Any) -> list:
  if isinstance(value, list | tuple):
    return list(value)
  raise _Mismatch(f"expected a list ({_type_name(tp)}), got {_describe(value)}")


def _to_int(value: Any) -> int:
  if isinstance(value, bool):
    raise _Mismatch(f"expected an int, got {_describe(value)}")
  if isinstance(value, int):
    return value
  if isinstance(value, str):
    try:
      return int(value)
    except ValueError:
      pass
    try:
      value = float(value)
    except ValueError:
      raise _Mismatch(f"expected an int, got {_describe(value)}") from None
  if isinstance(value, float) and value.is_integer():
    return int(value)
  raise _Mismatch(f"expected an int, got {_describe(value)}")


def _to_float(value: Any) -> float:
  if isinstance(value, bool):
    raise _Mismatch(f"expected a float, got {_describe(value)}")
  if isinstance(value, int | float):
    return float(value)
  if isinstance(value, str):
    try:
      return float(value)  # YAML 1.1 reads 3e-6 (no dot) as a string.
    except ValueError:
      pass
  raise _Mismatch(f"expected a float, got {_describe(value)}")


def _override_value(tp: Any, raw: str, where: str) -> Any:
  """The plain value an override stores: parsed YAML, or the raw text where the type wants it."""
  try:
    parsed = yaml.safe_load(raw) if raw else None
    yaml_error = None
  except yaml.YAMLError as e:
    parsed, yaml_error = raw, e
  first_error = None
  if yaml_error is None:
    try:
      _convert(tp, parsed, "")
      return parsed
    except _Mismatch as e:
      first_error = e
    except ValueError:
      return parsed  # A nested config's own validation; config_from_dict reports it in full.
  try:
    _convert(tp, raw, "")
    return raw
  except (_Mismatch, ValueError):
    pass
  if yaml_error is not None:
    reason = str(yaml_error).splitlines()[0]
    raise ValueError(f"{where}: cannot parse {raw!r} as YAML ({reason}).")
  raise ValueError(f"{where}: {first_error}")


# ---- plain values --------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
  if isinstance(value, enum.Enum):
    return _plain(value.value)
  if isinstance(value, pathlib.PurePath):
    return str(value)
  if isinstance(value, Mapping):
    return {_plain(k): _plain(v) for k, v in value.items()}
  if isinstance(value, list | tuple | set | frozenset):
    items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
    return [_plain(v) for v in items]
  return value


def _copy_tree(data: Mapping[str, Any]) -> dict[str, Any]:
  return {k: _copy_tree(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def _dataclass_of(tp: Any) -> type | None:
  """The dataclass in `tp` (a dataclass type or an Optional of one), else None."""
  if isinstance(tp, type) and dataclasses.is_dataclass(tp):
    return tp
  if typing.get_origin(tp) in (typing.Union, types.UnionType):
    arms = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(arms) == 1:
      return _dataclass_of(arms[0])
  return None


def _resolve_path(path: str | os.PathLike) -> pathlib.Path:
  path = pathlib.Path(path)
  if path.is_dir():
    path = path / CONFIG_FILENAME
  if not path.exists():
    raise FileNotFoundError(f"Config file {str(path)!r} does not exist.")
  return path


def _yaml_error_message(path: pathlib.Path, error: yaml.YAMLError) -> str:
  """One line for a YAML syntax error: file, line, column (1-based) and the parser's reason."""
  mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
  where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
  reason = " ".join(
      str(part) for part in (getattr(error, "context", None), getattr(error, "problem", None))
      if part
  ) or str(error).splitlines()[0]
  return f"Config file {str(path)!r}{where}: invalid YAML ({reason})."


def _unknown_key_message(cls: type, dotted: str, key: str, hints: Mapping[str, Any]) -> str:
  valid = list(hints)
  close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
  hint = f" Did you mean '{close[0]}'?" if close else ""
  return (
      f"Unknown config key '{dotted}' for {cls.__name__}.{hint} "
      f"Valid keys: {', '.join(valid)}."
  )


def _type_name(tp: Any) -> str:
  if isinstance(tp, type) and not typing.get_args(tp):
    return tp.__name__
  return str(tp).replace("typing.", "")


def _describe(value: Any) -> str:
  text = repr(value)
  if len(text) > 60:
    text = text[:57] + "..."
  return f"{text} ({type(value).__name__})"
