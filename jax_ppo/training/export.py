"""The one export every stage ends with: a Hugging Face folder of the trained model, written
whole or not at all.

`export_pretrained(model, path, tokenizer=..., files=...)` writes the model with
`jax_ppo.models.save_pretrained` (LoRA merged, a value head on a policy trunk left out; several
processes: every process gathers one tensor at a time and process 0 writes), then, on process 0,
the tokenizer and any extra files (e.g. the reward model's normalisation), and returns once every
process sees the folder complete. A tokenizer's pad id is written as `pad_token_id` of both
`config.json` and `generation_config.json`, so transformers' `generate` pads with it.

Every export is atomic (`write_folder_atomically`): it is written to `<name>.export-tmp` beside
the target and renamed into place when complete, so a crash or preemption half way never leaves
a half-written model at `path`. An existing export at `path` (a folder holding `config.json`: an
earlier export of the same run, exported again) is replaced, and removed only after the new one
is complete; a non-empty folder that is not a model folder, or a file, is refused
(`check_export_target`), never deleted.

`export_adapter(model, path, base_model=..., tokenizer=...)` writes a LoRA model's adapters alone
as a PEFT adapter folder (`jax_ppo.models.save_peft_adapter`: `adapter_config.json`,
`adapter_model.safetensors`) with the tokenizer, the same way (its marker of an earlier export is
`adapter_config.json`).
"""

from __future__ import annotations

import os
import pathlib
import shutil
from collections.abc import Callable, Mapping
from typing import Any

from jax_ppo.models import has_lora, save_peft_adapter, save_pretrained
from jax_ppo.parallel.distributed import barrier, is_main_process

TMP_SUFFIX = ".export-tmp"
"""Suffix of the folder an export is written to before it is renamed into place."""
OLD_SUFFIX = ".export-old"
"""Suffix an existing export is renamed to while the new one replaces it (then removed)."""
MODEL_MARKER = "config.json"
"""The file that marks a folder as a model export (replaceable by the next export)."""
ADAPTER_MARKER = "adapter_config.json"
"""The file that marks a folder as a PEFT adapter export (`export_adapter`)."""


def check_export_target(path: str | os.PathLike, *, field: str = "export folder",
                        marker: str = MODEL_MARKER) -> None:
  """Nothing when `path` is absent, an empty folder or an earlier export (it holds `marker`:
  `config.json` for a model, `adapter_config.json` for a PEFT adapter; replaced by the next);
  otherwise a ValueError naming `field`, the path and the fix.

  Raises:
    ValueError: `path` is a file, or a non-empty folder without `marker` (files an export would
      delete).
  """
  path = pathlib.Path(path)
  if not os.path.lexists(path):
    return
  if not path.is_dir():
    raise ValueError(f"{field}={str(path)!r} is a file, not a folder; give a folder for the "
                     "exported model (new, empty, or an earlier export to replace).")
  entries = sorted(p.name for p in path.iterdir())
  if entries and marker not in entries:
    shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
    what = "no model" if marker == MODEL_MARKER else "no PEFT adapter"
    raise ValueError(
        f"{field}={str(path)!r} is a folder that holds {what} (no {marker}; it holds "
        f"{shown}): an export replaces its folder whole and would delete them. Give a new or "
        "empty folder, or an earlier export to replace.")


def write_folder_atomically(write: Callable[[pathlib.Path], Any], path: str | os.PathLike,
                            *, field: str = "export folder",
                            marker: str = MODEL_MARKER) -> pathlib.Path:
  """Runs `write(tmp)` into `<path>.export-tmp` beside `path`, then moves it to `path`.

  An existing folder at `path` is renamed aside (`<path>.export-old`) and removed only once the
  new folder is in place (`check_export_target` decides whether it may be replaced). Several
  processes: every process calls it and `write` (which may gather); only process 0 clears,
  renames and removes, and every process returns once the folder is in place (`barrier`).

  Args:
    write: writes the complete folder at the path it is given.
    path: the target folder (its parents are created).
    field: how errors name `path`.
    marker: the file of an earlier export that may be replaced (`check_export_target`).

  Returns:
    `path`.
  """
  path = pathlib.Path(path)
  check_export_target(path, field=field, marker=marker)
  tmp = path.with_name(path.name + TMP_SUFFIX)
  old = path.with_name(path.name + OLD_SUFFIX)
  main = is_main_process()
  if main:
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)  # a crashed export's leftovers
  barrier(f"export {tmp}: cleared")
  write(tmp)
  if main:
    if os.path.lexists(path):
      shutil.rmtree(old, ignore_errors=True)
      os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
  barrier(f"export {path}: in place")
  return path


def export_pretrained(
    model: Any,
    path: str | os.PathLike,
    *,
    tokenizer: Any = None,
    dtype: Any = None,
    max_shard_size: int | str | None = "5GB",
    files: Mapping[str, str] | None = None,
) -> pathlib.Path:
  """Writes `model` (a `CausalLM` or `ScalarModel`) as a Hugging Face folder at `path`,
  atomically (`write_folder_atomically`).

  Args:
    model: the NNX module to write.
    path: output folder (created; an earlier export there is replaced once this one is complete).
    tokenizer: saved next to the weights when it has `save_pretrained` (None: none); its
      `pad_token_id`, when it has one, is written into `config.json` and
      `generation_config.json`.
    dtype: dtype of the written tensors (None keeps the parameter dtype).
    max_shard_size: bytes (or e.g. "2GB") per safetensors file.
    files: extra text files, name -> contents, written into the folder by process 0.

  Returns:
    The folder written.

  Raises:
    ValueError: `path` is a file or a non-empty folder that holds no model
      (`check_export_target`).
  """
  pad = getattr(tokenizer, "pad_token_id", None)

  def write(folder: pathlib.Path) -> None:
    save_pretrained(model, str(folder), dtype=dtype, max_shard_size=max_shard_size,
                    pad_token_id=pad)
    if is_main_process():
      if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(folder))
      for name, text in (files or {}).items():
        (folder / name).write_text(text)

  return write_folder_atomically(write, path)


def export_adapter(
    model: Any,
    path: str | os.PathLike,
    *,
    base_model: str | None = None,
    tokenizer: Any = None,
    dtype: Any = None,
    field: str = "adapter export folder",
) -> pathlib.Path:
  """Writes the LoRA adapters of `model` (a `CausalLM`) as a PEFT adapter folder at `path`,
  atomically (`write_folder_atomically`, marker `adapter_config.json`); the merged export
  (`export_pretrained`) is separate.

  Args:
    model: the NNX module whose adapters are written (`jax_ppo.models.save_peft_adapter`).
    path: output folder (created; an earlier adapter export there is replaced once this one is
      complete).
    base_model: the base model's name or folder, the adapter's `base_model_name_or_path`.
    tokenizer: saved next to the adapter when it has `save_pretrained` (None: none).
    dtype: dtype of the written tensors (None keeps the adapters' parameter dtype).
    field: how errors name `path`.

  Returns:
    The folder written.

  Raises:
    ValueError: `model` has no adapters (before anything is written), or `path` is a file or a
      non-empty folder that holds no adapter.
  """
  if not has_lora(model):
    raise ValueError(f"{field}={str(path)!r}: the model has no LoRA adapters to write as a PEFT "
                     "adapter; train with a `lora` block, or use the merged export.")

  def write(folder: pathlib.Path) -> None:
    save_peft_adapter(model, str(folder), base_model=base_model, dtype=dtype)
    if is_main_process() and tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
      tokenizer.save_pretrained(str(folder))

  return write_folder_atomically(write, path, field=field, marker=ADAPTER_MARKER)


__all__ = [
    "ADAPTER_MARKER",
    "MODEL_MARKER",
    "OLD_SUFFIX",
    "TMP_SUFFIX",
    "check_export_target",
    "export_adapter",
    "export_pretrained",
    "write_folder_atomically",
]
