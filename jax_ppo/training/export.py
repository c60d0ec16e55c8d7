"""The one export every stage ends with: a Hugging Face folder of the trained model.

`export_pretrained(model, path, tokenizer=..., files=...)` writes the model with
`jax_ppo.models.save_pretrained` (LoRA merged, a value head on a policy trunk left out; several
processes: every process gathers one tensor at a time and process 0 writes), then, on process 0,
the tokenizer and any extra files (e.g. the reward model's normalisation), and returns once every
process sees the folder complete.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Any

from jax_ppo.models import save_pretrained
from jax_ppo.parallel.distributed import barrier, is_main_process


def export_pretrained(
    model: Any,
    path: str | os.PathLike,
    *,
    tokenizer: Any = None,
    dtype: Any = None,
    max_shard_size: int | str | None = "5GB",
    files: Mapping[str, str] | None = None,
) -> pathlib.Path:
  """Writes `model` (a `CausalLM` or `ScalarModel`) as a Hugging Face folder at `path`.

  Args:
    model: the NNX module to write.
    path: output folder (created).
    tokenizer: saved next to the weights when it has `save_pretrained` (None: none).
    dtype: dtype of the written tensors (None keeps the parameter dtype).
    max_shard_size: bytes (or e.g. "2GB") per safetensors file.
    files: extra text files, name -> contents, written into the folder by process 0.

  Returns:
    The folder written.
  """
  path = pathlib.Path(path)
  save_pretrained(model, str(path), dtype=dtype, max_shard_size=max_shard_size)
  if is_main_process():
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
      tokenizer.save_pretrained(str(path))
    for name, text in (files or {}).items():
      (path / name).write_text(text)
  barrier(f"export {path}")
  return path


__all__ = ["export_pretrained"]
