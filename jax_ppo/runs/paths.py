"""What a run writes never overlaps what it reads: one check of a run's folders, before anything
loads.

Every stage names the paths it reads (the starting model or policy and its tokenizer, the
reference, the reward and value models, the record and prompt files or `datasets` folders) and
the paths it writes (the run folder, an export folder, an output file). `check_run_paths` refuses,
in one error naming both config fields, both paths and the fix:

* a written path (run folder, export, output file) that is, contains or lies inside a path the
  run reads: the run would write its checkpoints, logs or model files over (or into) its input.
  A data file is compared as itself (a run folder beside `data/train.jsonl` is fine; one that is
  `data/` or holds it is not); a folder (a model, a `datasets` folder) with everything under it.
* an export folder that is or contains a run folder: an export replaces its folder whole
  (`jax_ppo.training.export`), so it would delete the run. An export inside the run folder (the
  default `<run_dir>/hf_model`) is fine.

Paths are compared resolved (`os.path.realpath`: relative to the working directory, symbolic
links followed), so `runs/../models/x` and a link to `models/x` are `models/x`. The check reads
nothing but the paths' names and links: it runs in each config's validation (`SFTRunConfig`,
`RewardRunConfig`, `RunConfig`), in the pipeline over every stage's paths, and in `export_run`
and `evaluate_run` for their `--out`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

PathField = tuple[str, "str | os.PathLike | None"]
"""`(how the error names it, e.g. "SFTRunConfig.model_path", the path or None)`."""


def resolved(path: str | os.PathLike) -> str:
  """`path` as the absolute, link-free, case-normalised string the check compares."""
  return os.path.normcase(os.path.realpath(os.path.abspath(os.fspath(path))))


def relation(written: str | os.PathLike, read: str | os.PathLike) -> str | None:
  """How `written` overlaps `read`: "is", "lies inside", "contains", or None (apart)."""
  a, b = resolved(written), resolved(read)
  if a == b:
    return "is"
  common = os.path.commonpath([a, b])
  if common == b:
    return "lies inside"
  if common == a:
    return "contains"
  return None


def _given(paths: Iterable[PathField]) -> list[tuple[str, str]]:
  return [(field, os.fspath(path)) for field, path in paths
          if isinstance(path, str | os.PathLike) and os.fspath(path)]


def check_run_paths(
    *,
    inputs: Iterable[PathField],
    run_dirs: Iterable[PathField] = (),
    exports: Iterable[PathField] = (),
) -> None:
  """Raises one ValueError when a path the run writes overlaps one it reads.

  Args:
    inputs: the paths the run reads (model folders, tokenizer folders, data files or folders);
      None paths (fields left unset) are skipped.
    run_dirs: the folders and files the run writes into without replacing them (run folders,
      an evaluation's output file).
    exports: the folders the run replaces whole (exports).

  Raises:
    ValueError: its first line names the written field and path, how it overlaps, the read
      field and path, and the fix.
  """
  inputs, run_dirs, exports = _given(inputs), _given(run_dirs), _given(exports)
  for out_field, out in [*run_dirs, *exports]:
    for in_field, path in inputs:
      how = relation(out, path)
      if how is not None:
        raise ValueError(
            f"{out_field}={out!r} {how} {in_field}={path!r}, which the run reads: the run would "
            f"write over its own input. Give {out_field} a path outside every folder and file "
            "the run reads (its models, tokenizers and data), e.g. a new folder under runs/.")
  for export_field, export in exports:
    for run_field, run_dir in run_dirs:
      how = relation(run_dir, export)
      if how in ("is", "lies inside"):
        where = "is" if how == "is" else "contains"
        raise ValueError(
            f"{export_field}={export!r} {where} {run_field}={run_dir!r}: an export replaces its "
            "folder whole, so it would delete the run folder. Give an export folder outside "
            f"the run folder, or inside it (the default <run_dir>/hf_model).")


__all__ = ["PathField", "check_run_paths", "relation", "resolved"]
