"""JAX's persistent compilation cache for jax_ppo runs: compiled programs outlive the process.

A PPO update compiles a handful of large programs (the sampler, the reward model, the fused
experience + update step); compiling them takes far longer than running them once (tens of
seconds on a CPU at 100M parameters). With the persistent cache on, a second invocation of the
same run (a resumed run, the next stage of a pipeline, a rerun with another seed) loads them
from disk instead.

`enable_compilation_cache(setting)` is called by the run entry points (`jax-ppo train`,
`jax-ppo sft`, `jax-ppo reward` and the quickstart) before they build anything, with the
config field `compilation_cache_dir`:

- `"auto"` (the default): `$JAX_PPO_CACHE_DIR`, else `$XDG_CACHE_HOME/jax_ppo/xla`
  (`~/.cache/jax_ppo/xla`); but when JAX was already given a cache folder
  (`JAX_COMPILATION_CACHE_DIR`, or `jax.config.update("jax_compilation_cache_dir", ...)`), that
  folder and JAX's other cache settings are kept as they are;
- a path: that folder (created; `~` is expanded);
- `None` (`null` in YAML) or `"off"`: jax_ppo turns nothing on; JAX's own settings apply.

Every program is written, however fast it compiled (`MIN_COMPILE_TIME_S` = 0; JAX's default
is 1 s; an explicit `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` wins): a run compiles a few
dozen small helper programs besides the large ones, each in 10-200 ms, and together they cost
about a second of a second invocation's start when they are not cached. The cache is keyed by
the program, the JAX and XLA versions and the device, so it never serves a stale program; the
folder can be deleted at any time. Like JAX's own cache, it is trusted code: do not point it at
a folder others can write.
"""

from __future__ import annotations

import os
import pathlib

import jax

AUTO = "auto"
OFF = "off"
ENV_DIR = "JAX_PPO_CACHE_DIR"
MIN_COMPILE_TIME_S = 0.0
"""Programs compiled faster than this are not written to the cache (seconds)."""

_JAX_MIN_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def default_cache_dir() -> pathlib.Path:
  """`$JAX_PPO_CACHE_DIR`, else `$XDG_CACHE_HOME/jax_ppo/xla` (default `~/.cache/jax_ppo/xla`)."""
  if os.environ.get(ENV_DIR):
    return pathlib.Path(os.environ[ENV_DIR]).expanduser()
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
  return pathlib.Path(root).expanduser() / "jax_ppo" / "xla"


def check_cache_setting(value, *, field: str) -> None:
  """Raises one `ValueError` naming `field` unless `value` is "auto", "off", None or a
  non-empty path."""
  if value is not None and (not isinstance(value, (str, os.PathLike)) or not str(value).strip()):
    raise ValueError(
        f"{field}={value!r} is invalid: use \"auto\" (the default cache folder), a folder path, "
        "or null (or \"off\") to leave JAX's persistent compilation cache off."
    )


def enable_compilation_cache(setting: str | os.PathLike | None = AUTO) -> pathlib.Path | None:
  """Turns JAX's persistent compilation cache on for this process (see the module docstring).

  Call it before the first compilation that should be cached; calling it again with another
  folder switches to that folder. Returns the folder in use, or None when `setting` is None or
  "off" (nothing changed).

  Raises:
    ValueError: `setting` is neither "auto", "off", None nor a path.
    OSError: the folder cannot be created.
  """
  check_cache_setting(setting, field="compilation_cache_dir")
  if setting is None or setting == OFF:
    return None
  setting = os.fspath(setting)
  current = jax.config.jax_compilation_cache_dir
  if setting == AUTO and current:
    return pathlib.Path(current)  # configured by the user (or a test): left as it is
  folder = default_cache_dir() if setting == AUTO else pathlib.Path(setting).expanduser()
  folder.mkdir(parents=True, exist_ok=True)
  if not os.environ.get(_JAX_MIN_TIME_ENV):
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
  jax.config.update("jax_enable_compilation_cache", True)
  if current != str(folder):
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.set_cache_dir(str(folder))
    compilation_cache.reset_cache()  # a cache opened on another folder is dropped
  return folder


__all__ = ["AUTO", "ENV_DIR", "MIN_COMPILE_TIME_S", "OFF", "check_cache_setting",
           "default_cache_dir", "enable_compilation_cache"]
