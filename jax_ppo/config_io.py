"""Loading and saving frozen, keyword-only dataclass configs (YAML/JSON files + `key=value`).

  config = load_config(TrainerConfig, "configs/run.yaml", ["learning_rate=3e-6",
                       "sampling.temperature=0.7", "sampling.stop_token_ids=[50256]"])
  save_config(config, run_dir)          # writes run_dir/config.yaml
  assert load_config(TrainerConfig, run_dir) == config

Converting plain values to the annotated types (nested and Optional dataclasses, tuples, also of
dataclasses, Literal, Enum, Path, unions) and back is draccus's (`draccus.decode`/`encode`),
Levanter's choice. It builds each dataclass through its constructor, so `__post_init__` stays
the one place that decides validity, and it takes only YAML 1.2 booleans. OmegaConf, the other
candidate, leaves the items of a `tuple[RewardSource, ...]` as dicts, reads `true` as "True" for
a string and 1/"yes"/"on" as true for a bool, resolves `${...}` inside paths, and cannot build a
frozen dataclass with `init=False` fields. This module adds what neither library does:

* `dotted.key=value` overrides, the value parsed as YAML (`lr=3e-6`, `ids=[1,2]`, `x=null`)
  except for string fields, which keep the text as written (`name=123`, `prompt=a: b`);
* unknown keys named with the nearest valid one (difflib); a bool for a number, a non-string for
  a string or a scalar for a nested config refused (draccus would coerce them);
* one-line errors naming the dotted key, the field and the expected type; YAML/JSON syntax
  errors with file, line and column;
* `with_defaults`: the fields a config saved by an older version lacks, at today's defaults, so
  that resuming such a run does not call them changed;
* `field_docs` and `documented_yaml`: the documentation written under each field (an attribute
  docstring, or an `Attributes:` entry of the class docstring) and a config as YAML with that
  documentation as comments (`jax-ppo config`, `jax_ppo.runs.templates`);
* moved keys: a config class lists the keys it no longer has in `MOVED_KEYS` (old key -> new
  dotted key, e.g. `{"learning_rate": "optimizer.learning_rate"}`). A file or override that uses
  an old key gets one error naming the old and the new key; `migrate_keys` moves them in a
  config a run folder saved before the change, so the run resumes with the same meaning.

Files are YAML (`.yaml`/`.yml`) or JSON (`.json`) holding a mapping of field names; missing
fields keep their defaults. Fields with `init=False` are neither saved nor read.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import json
import os
import pathlib
import re
import tempfile
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import draccus
import yaml
from draccus.utils import DecodingError, ParsingError

T = TypeVar("T")

CONFIG_FILENAME = "config.yaml"
"""File name used when `save_config`/`load_config` are given a directory (a run folder)."""

_YAML_SUFFIXES = (".yaml", ".yml")
_JSON_SUFFIXES = (".json",)


# ---- public API ----------------------------------------------------------------------------------


def config_to_dict(config: Any) -> dict[str, Any]:
  """A dataclass config as plain YAML/JSON types (dicts, lists, str, int, float, bool, None), in
  field order: nested dataclasses become dicts, tuples lists, enums their names, paths strings.
  Fields with `init=False` (derived values) are left out."""
  if not dataclasses.is_dataclass(config) or isinstance(config, type):
    raise TypeError(f"config_to_dict expects a dataclass instance, got {type(config).__name__}")
  hints = _init_hints(type(config))
  return {name: draccus.encode(getattr(config, name), tp) for name, tp in hints.items()}


def config_from_dict(cls: type[T], data: Mapping[str, Any]) -> T:
  """Builds `cls` from a (nested) mapping, converting values to the annotated field types.

  Raises:
    ValueError: for unknown keys (with a suggestion), missing required keys, values that do not
      fit the field's type, and the config's own validation; each message names the dotted key.
  """
  if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
    raise TypeError(f"config_from_dict expects a dataclass type, got {cls!r}")
  check_keys(cls, data, source="")
  return _decode(cls, dict(data), cls, ())


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
  result = copy.deepcopy(dict(data))
  for text in overrides:
    key, raw = parse_override(text)
    parts = key.split(".")
    owner, node = cls, result
    for depth, part in enumerate(parts[:-1]):
      tp = _field_type(owner, ".".join(parts[: depth + 1]), part)
      nested = _dataclass_of(tp)
      if nested is None:
        dotted = ".".join(parts[: depth + 1])
        raise ValueError(
            f"Invalid override {text!r}: {owner.__name__}.{part} has type {_type_name(tp)}, "
            f"not a nested config, so '{dotted}' takes no sub-keys; write {dotted}=<value>."
        )
      if not isinstance(node.get(part), dict):
        node[part] = {}
      node, owner = node[part], nested
    tp = _field_type(owner, key, parts[-1])
    where = f"Config key '{key}' ({owner.__name__}.{parts[-1]}) in override {text!r}"
    node[parts[-1]] = value = _override_value(tp, raw, where)
    _check_value(tp, value, key, where, source="")
    _decode(tp, value, owner, (parts[-1],), where=where)
  return result


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
  """Reads a YAML or JSON config file (or `config.yaml` in a directory) into a dict."""
  path = _resolve_path(path)
  suffix = path.suffix.lower()
  if suffix not in _YAML_SUFFIXES + _JSON_SUFFIXES:
    raise ValueError(f"Config file {str(path)!r} has an unsupported suffix {suffix!r}; use one of "
                     f"{', '.join(_YAML_SUFFIXES + _JSON_SUFFIXES)}.")
  raw = path.read_bytes()
  try:
    text = raw.decode("utf-8")
    data = (json.loads(text) if text.strip() else {}) if suffix in _JSON_SUFFIXES else (
        yaml.safe_load(text))
  except UnicodeDecodeError as e:
    line, column = raw.count(b"\n", 0, e.start) + 1, e.start - raw.rfind(b"\n", 0, e.start)
    raise ValueError(f"Config file {str(path)!r}, line {line}, column {column}: not valid UTF-8; "
                     "save it as UTF-8.") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"Config file {str(path)!r}, line {e.lineno}, column {e.colno}: invalid "
                     f"JSON ({e.msg}).") from None
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    reason = " ".join(str(p) for p in (getattr(e, "context", None), getattr(e, "problem", None))
                      if p) or str(e).splitlines()[0]
    raise ValueError(f"Config file {str(path)!r}{where}: invalid YAML ({reason}).") from None
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise ValueError(
        f"Config file {str(path)!r} must hold a mapping of field names, got {type(data).__name__}."
    )
  return data


def check_keys(cls: type, data: Any, *, source: str, prefix: str = "") -> None:
  """Raises a ValueError for the first key of `data` that is no field of `cls` (nested mappings,
  and the items of `tuple[Dataclass, ...]` fields, are checked against their dataclass), naming
  `source` (e.g. the config file; "" for none), the dotted key and the closest valid one; and for
  a value of the wrong kind that draccus would coerce (a bool for a number, a number for a string,
  a scalar for a nested config)."""
  lead = f"{source}: " if source else ""
  if not isinstance(data, Mapping):
    where = prefix.rstrip(".") or cls.__name__
    raise ValueError(f"{lead}{where}: expected a mapping of {cls.__name__} fields, got "
                     f"{_describe(data)}.")
  hints = _init_hints(cls)
  for key, value in data.items():
    dotted = f"{prefix}{key}"
    if key not in hints:
      raise ValueError(lead + _unknown_key_message(cls, dotted, str(key), hints))
    _check_value(hints[key], value, dotted, f"{lead}Config key '{dotted}' ({cls.__name__}.{key})",
                 source=source)


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


def migrate_keys(cls: type, data: Any) -> Any:
  """`data` (a plain config dict, maybe written by an older version) with every key listed in
  `cls.MOVED_KEYS` moved to its new dotted place, recursively into nested configs and the items
  of `tuple[Dataclass, ...]` fields.

  A moved key whose new place also holds a value is an error (the two could disagree). Keys
  `cls` does not know and non-mapping values are left for `check_keys` to report.

  Raises:
    ValueError: an old key and its new key are both given.
  """
  if not isinstance(data, Mapping):
    return data
  out = dict(data)
  for old, new in getattr(cls, "MOVED_KEYS", {}).items():
    if old not in out:
      continue
    value = out.pop(old)
    *parents, leaf = new.split(".")
    node = out
    for part in parents:
      if not isinstance(node.get(part), Mapping):
        node[part] = {}
      node[part] = dict(node[part])
      node = node[part]
    if leaf in node:
      raise ValueError(f"Config keys '{old}' and '{new}' of {cls.__name__} are both given; "
                       f"'{old}' is the old name of '{new}': keep only '{new}'.")
    node[leaf] = value
  hints = _init_hints(cls)
  for key, value in out.items():
    if key not in hints:
      continue
    if (nested := _dataclass_of(hints[key])) is not None:
      out[key] = migrate_keys(nested, value)
    elif (item := _tuple_item_dataclass(hints[key])) is not None and isinstance(value, list):
      out[key] = [migrate_keys(item, entry) for entry in value]
  return out


def with_defaults(cls: type, saved: Mapping[str, Any]) -> dict[str, Any]:
  """`saved` (a plain config dict written by `config_to_dict`, maybe by an older version) with
  every `cls` field it lacks set to today's default, recursively into nested configs and the
  items of `tuple[Dataclass, ...]` fields.

  Resuming compares the saved config with the current one; a field added after the run was
  started ran at what is (by design) today's default, so it must not count as changed. Fields
  without a default, keys `cls` no longer has and non-mapping values are left as they are.
  """
  if not isinstance(saved, Mapping):
    return saved
  out = dict(migrate_keys(cls, saved))
  for field in (f for f in dataclasses.fields(cls) if f.init):
    tp = _init_hints(cls)[field.name]
    if field.name not in out and field.default is not dataclasses.MISSING:
      out[field.name] = draccus.encode(field.default, tp)
    elif field.name not in out and field.default_factory is not dataclasses.MISSING:
      out[field.name] = draccus.encode(field.default_factory(), tp)
    elif (nested := _dataclass_of(tp)) is not None and isinstance(out.get(field.name), Mapping):
      out[field.name] = with_defaults(nested, out[field.name])
    elif (item := _tuple_item_dataclass(tp)) is not None and isinstance(out.get(field.name), list):
      out[field.name] = [with_defaults(item, entry) for entry in out[field.name]]
  return out


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


def field_docs(cls: type) -> dict[str, str]:
  """The documentation of each `init` field of the dataclass `cls`, in field order.

  A field's documentation is the string literal written under it (an attribute docstring, the
  house style; fields written one after the other without one share the next), else its entry in
  an `Attributes:` section of the class docstring; base classes are read too and a subclass's
  text wins. Whitespace is collapsed to single spaces; a field without documentation maps to "".
  """
  if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
    raise TypeError(f"field_docs expects a dataclass type, got {cls!r}")
  docs: dict[str, str] = {}
  for klass in reversed(cls.__mro__):
    docs.update(_class_field_docs(klass))
  return {name: docs.get(name, "") for name in _init_hints(cls)}


def documented_yaml(
    cls: type,
    data: Mapping[str, Any],
    *,
    commented: Sequence[str] = (),
    notes: Mapping[str, str] | None = None,
    width: int = 100,
) -> str:
  """`data` (a plain config dict of `cls`, as `config_to_dict` gives it) as YAML text with each
  field's documentation (`field_docs`) as a comment above it.

  Nested configs are indented blocks documented the same way; a nested config that is null gets,
  after `key: null`, the block of its defaults commented out (when its class has defaults for
  every field), ready to uncomment. `load_config(cls, file)` reads the text back to `data`.

  Args:
    cls: the dataclass config type.
    data: its fields' plain values; keys that are not fields of `cls` are an error.
    commented: top-level keys written commented out (`# key: value`), e.g. required fields the
      user fills in, so that the text still loads.
    notes: top-level key -> a comment line written before its documentation (e.g. "REQUIRED").
    width: the width comments are wrapped to.
  """
  check_keys(cls, {k: v for k, v in data.items() if k not in commented}, source="")
  lines = _yaml_lines(cls, data, indent="", commented=frozenset(commented), notes=notes or {},
                      width=width)
  return "\n".join(lines) + "\n"


# ---- helpers -------------------------------------------------------------------------------------


def _decode(tp: Any, value: Any, owner: type, path: tuple[str, ...], *, where: str = "") -> Any:
  """`draccus.decode(tp, value)`; its errors become one-line ValueErrors naming the dotted key,
  the field and the expected type. `owner`/`path`: where `tp` sits (`path` empty: `tp` is
  `owner`); `where`: a prefix for the message that replaces the key (e.g. the override)."""
  try:
    return draccus.decode(tp, value)
  except (ParsingError, TypeError, ValueError, KeyError, AttributeError) as e:
    error: Exception = e
  # draccus wraps the error of an Optional's arm (and of each arm of a union): keep the inner one
  # where it is a constructor's refusal or comes from deeper in the config.
  while isinstance(error, DecodingError) and isinstance(error.__cause__, ParsingError) and (
      not isinstance(error.__cause__, DecodingError)
      or len(error.__cause__.key_path) > len(error.key_path)):
    error = error.__cause__
  if isinstance(error, DecodingError):
    parts, message = (*path, *map(str, error.key_path)), error.message
  elif isinstance(error, ParsingError):  # the constructor refused: the config's own message
    if isinstance(error.__cause__, ValueError | TypeError):
      raise ValueError(" ".join(str(error.__cause__).split())) from None
    parts, message = path, str(error)
  else:  # a value draccus cannot read
    parts, message = path, f"cannot read {_describe(value)} ({type(error).__name__}: {error})"
  # The innermost dataclass field on the path names the field and its expected type.
  cls, field, field_tp, rest, current = owner, None, tp, list(parts), owner
  while rest and current is not None and rest[0] in (hints := _init_hints(current)):
    cls, field = current, rest.pop(0)
    field_tp = hints[field]
    current = _dataclass_of(field_tp)
    if current is None and rest and rest[0].isdigit():  # an item of a tuple[Dataclass, ...]
      current = _tuple_item_dataclass(field_tp)
      rest = rest[1:] if current is not None else rest
  message = " ".join(message.split())
  if field is None:
    raise ValueError(f"{where or cls.__name__}: {message}.") from None
  head = where or f"Config key '{'.'.join(parts)}' ({cls.__name__}.{field})"
  item = f"item {'.'.join(parts[len(path):])}: " if where and parts[len(path):] else ""
  raise ValueError(f"{head}: {item}{message}; expected {_type_name(field_tp)}.") from None


def _check_value(tp: Any, value: Any, dotted: str, where: str, *, source: str) -> None:
  """`check_keys` for the value of one field (type `tp`, key `dotted`); errors start `where`."""
  problem = _shape_problem(tp, value)
  if problem:
    raise ValueError(f"{where}: {problem}.")
  if (nested := _dataclass_of(tp)) is not None and value is not None:
    check_keys(nested, value, source=source, prefix=dotted + ".")
  if (item := _tuple_item_dataclass(tp)) is not None and isinstance(value, list | tuple):
    for i, entry in enumerate(value):
      check_keys(item, entry, source=source, prefix=f"{dotted}.{i}.")


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


def _field_type(owner: type, dotted: str, name: str) -> Any:
  hints = _init_hints(owner)
  if name not in hints:
    raise ValueError(_unknown_key_message(owner, dotted, name, hints))
  return hints[name]


def _union_arms(tp: Any) -> tuple[Any, ...]:
  if typing.get_origin(tp) in (typing.Union, types.UnionType):
    return typing.get_args(tp)
  return (tp,)


def _override_value(tp: Any, raw: str, where: str) -> Any:
  """The plain value an override stores: the text itself for a string field (`null` or nothing
  gives None where the field is Optional), else the text parsed as YAML."""
  arms = _union_arms(tp)
  if str in arms:
    return None if type(None) in arms and raw in ("", "null", "~") else raw
  try:
    return yaml.safe_load(raw) if raw else None
  except yaml.YAMLError as e:
    reason = str(e).splitlines()[0]
    raise ValueError(f"{where}: cannot parse {raw!r} as YAML ({reason}).") from None


def _shape_problem(tp: Any, value: Any) -> str | None:
  """What is wrong with `value` for a field of type `tp` that draccus would not refuse: a scalar
  for a nested config, a bool for a number, a non-string (or null) for a string; else None."""
  arms = set(_union_arms(tp))
  if value is None:
    scalar = arms & {bool, int, float, str} or _dataclass_of(tp) is not None
    return None if type(None) in arms or not scalar else f"expected {_type_name(tp)}, got null"
  nested = _dataclass_of(tp)
  if nested is not None and not isinstance(value, Mapping):
    return f"expected a mapping of {nested.__name__} fields, got {_describe(value)}"
  if typing.get_origin(tp) in (tuple, list) and not isinstance(value, list | tuple):
    return f"expected a list ({_type_name(tp)}), got {_describe(value)}"
  if not arms <= {bool, int, float, str, type(None)}:
    return None  # not a plain scalar field: draccus checks it
  if isinstance(value, bool):
    fits = bool in arms
  elif isinstance(value, int | float):
    fits = bool(arms & {int, float})
  else:
    fits = isinstance(value, str)
  return None if fits else f"expected {_type_name(tp)}, got {_describe(value)}"


def _dataclass_of(tp: Any) -> type | None:
  """The dataclass in `tp` (a dataclass type or an Optional of one), else None."""
  arms = [a for a in _union_arms(tp) if a is not type(None)]
  if len(arms) == 1 and isinstance(arms[0], type) and dataclasses.is_dataclass(arms[0]):
    return arms[0]
  return None


def _tuple_item_dataclass(tp: Any) -> type | None:
  """The dataclass `D` of a `tuple[D, ...]` field, else None."""
  args = typing.get_args(tp)
  if typing.get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis:
    return _dataclass_of(args[0])
  return None


def _resolve_path(path: str | os.PathLike) -> pathlib.Path:
  path = pathlib.Path(path)
  if path.is_dir():
    path = path / CONFIG_FILENAME
  if not path.exists():
    raise FileNotFoundError(f"Config file {str(path)!r} does not exist.")
  return path


def _unknown_key_message(cls: type, dotted: str, key: str, hints: Mapping[str, Any]) -> str:
  moved = getattr(cls, "MOVED_KEYS", {})
  if key in moved:
    new = dotted[: len(dotted) - len(key)] + moved[key]
    return (f"Config key '{dotted}' has moved to '{new}' ({cls.__name__}.{moved[key]}); "
            f"write '{new}' instead.")
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


@functools.cache
def _class_field_docs(cls: type) -> dict[str, str]:
  """The field documentation written in `cls`'s own body (attribute docstrings) and docstring
  (`Attributes:` entries); the attribute docstring wins. Empty for a class without source."""
  docs = _attributes_section(cls.__dict__.get("__doc__") or "")
  try:
    source = textwrap.dedent(inspect.getsource(cls))
  except (OSError, TypeError):
    return docs
  body = next((n.body for n in ast.parse(source).body if isinstance(n, ast.ClassDef)), [])
  group: list[str] = []  # consecutive fields written without a docstring share the next one
  for node in body:
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
      group.append(node.target.id)
      continue
    if (group and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)):
      docs.update(dict.fromkeys(group, " ".join(node.value.value.split())))
    group = []
  return docs


def _attributes_section(doc: str) -> dict[str, str]:
  """`name -> text` of the entries of a Google-style `Attributes:` section of a docstring."""
  entries: dict[str, str] = {}
  lines = inspect.cleandoc(doc).splitlines()
  start = next((i for i, line in enumerate(lines) if line.strip() == "Attributes:"), None)
  if start is None:
    return entries
  entry_indent, current = None, None
  for line in lines[start + 1:]:
    indent = len(line) - len(line.lstrip())
    if not line.strip() or indent == 0:
      break
    entry_indent = indent if entry_indent is None else entry_indent
    match = re.match(r"(\w+)(?: \([^)]*\))?: ?(.*)$", line.strip())
    if indent == entry_indent and match:
      current = match.group(1)
      entries[current] = match.group(2).strip()
    elif current is not None:
      entries[current] = f"{entries[current]} {line.strip()}".strip()
  return entries


def _yaml_value(value: Any) -> str:
  """One value as flow-style YAML on one line."""
  text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**9)
  return text.removesuffix("\n...\n").rstrip("\n")


def _yaml_lines(cls: type, data: Mapping[str, Any], *, indent: str, commented: frozenset[str],
                notes: Mapping[str, str], width: int) -> list[str]:
  """`documented_yaml`'s lines for the fields of `cls` in `data`, at `indent`."""
  docs, hints = field_docs(cls), _init_hints(cls)
  lines: list[str] = []
  for name, tp in hints.items():
    if name not in data:
      continue
    value = data[name]
    for text in (notes.get(name, ""), docs[name]):
      if text:
        lines += textwrap.wrap(text, width=max(width - len(indent) - 2, 40),
                               initial_indent=f"{indent}# ", subsequent_indent=f"{indent}# ",
                               break_long_words=False, break_on_hyphens=False)
    nested = _dataclass_of(tp)
    if nested is not None and isinstance(value, Mapping) and value:
      block = [f"{indent}{name}:", *_yaml_lines(nested, value, indent=indent + "  ",
                                                commented=frozenset(), notes={}, width=width)]
    else:
      block = [f"{indent}{name}: {_yaml_value(value)}"]
      if nested is not None and value is None and (example := _defaults_of(nested)):
        sub = _yaml_lines(nested, example, indent=indent + "  ", commented=frozenset(),
                          notes={}, width=width - 2)
        lines += block
        block = [f"{indent}# {name}:  # to set it, uncomment this block instead of the line above",
                 *(f"{indent}# {line[len(indent):]}" for line in sub)]
    if name in commented:
      block = [f"{indent}# {line[len(indent):]}" for line in block]
    lines += block
  return lines


def _defaults_of(cls: type) -> dict[str, Any] | None:
  """The plain values of `cls()`, or None when `cls` has a field without a default or refuses
  its defaults."""
  try:
    return config_to_dict(cls())
  except (TypeError, ValueError):
    return None
