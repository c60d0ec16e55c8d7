"""What the SFT and reward-model run configs share: record files, model folders, config loading.

`read_records` reads the training data of a stage (JSONL, Parquet or a local `datasets` folder
through `jax_ppo.data.iter_records`, or a JSON file holding a list of objects) and checks that
every record has the fields the stage needs, so a malformed record is reported with the config
field, the file and the line (or row).
`load_stage_config` builds a frozen stage config from a YAML/JSON file and `key=value` overrides
with `jax_ppo.config_io` (unknown keys are named with the nearest valid one).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
from collections.abc import Sequence
from typing import Any, TypeVar

import jax.numpy as jnp

from jax_ppo.compile_cache import AUTO as AUTO_CACHE
from jax_ppo.compile_cache import check_cache_setting
from jax_ppo.config_io import config_from_argv
from jax_ppo.data.files import check_data_path, iter_records
from jax_ppo.models import LoRAConfig, resize_token_embeddings
from jax_ppo.parallel import distributed
from jax_ppo.parallel.distributed import DistributedConfig
from jax_ppo.parallel.mesh import MeshConfig
from jax_ppo.training.loop import RunOptions

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
"""`RunConfig.dtype` name -> compute dtype (parameters stay float32)."""
DTYPE_NAMES = tuple(DTYPES)

T = TypeVar("T")

RECORD_SUFFIXES = (".jsonl", ".parquet", ".json")
RECORD_FORMATS = ("a .jsonl file (one JSON object per line), a .parquet file, a local Hugging Face "
                  "`datasets` folder (save_to_disk) or a .json file holding a list of objects")


STAGE_OPERATIONAL_FIELDS = ("run_dir", "export_dir", "steps_per_run", "save_every", "keep_last",
                            "tensorboard", "progress", "mesh", "distributed",
                            "compilation_cache_dir")
"""Stage-config fields that may change between invocations of one run (they do not change what
is computed); a difference in any other field refuses to resume."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageRunConfig:
  """The fields every stage run (SFT, reward model) has: model, data, run folder, export."""

  model_path: str
  """Local Hugging Face folder of the starting model (config.json, safetensors, tokenizer)."""
  train_path: str
  """Training records: a .jsonl file (one JSON object per line), a .parquet file, a local
  Hugging Face `datasets` folder, or a .json list of objects."""
  run_dir: str
  """Run folder: config.yaml, metrics.jsonl, tensorboard/, checkpoints/."""
  eval_path: str | None = None
  """Held-out records (same format); None holds out the stage config's `eval_fraction`."""
  export_dir: str | None = None
  """Where the trained model is written as a Hugging Face folder when the run is complete;
  None: `<run_dir>/hf_model`."""
  lora: LoRAConfig | None = None
  """Train LoRA adapters instead of every weight (merged into the exported folder)."""
  dtype: str = "float32"
  """Compute dtype: "float32", "bfloat16" or "float16" (weights stay float32)."""
  pad_token: str | None = None
  """Pad token of the tokenizer (None: the tokenizer's own, or an unused special token)."""
  resize_embeddings: bool = False
  """Add a pad token when the tokenizer has no usable one and grow the embedding to fit."""
  steps_per_run: int | None = None
  """Stop after this many steps in one invocation (None: run to the end); run again to go on."""
  save_every: int = 50
  """Checkpoint every this many steps (and at the end of each invocation)."""
  keep_last: int = 2
  """Number of most recent checkpoints kept."""
  tensorboard: bool = False
  """Write TensorBoard events."""
  progress: bool = True
  """Show a progress bar."""
  mesh: MeshConfig | None = None
  """Device mesh `(data, fsdp, tensor)` (`jax_ppo.parallel.MeshConfig`; -1: the rest), as
  `RunConfig.mesh`: e.g. `mesh.fsdp=8` shards the model and the optimizer state over 8 devices,
  `mesh.data=-1` splits each batch's rows over every device; None: one device. A run may resume
  on another mesh."""
  distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
  """Multi-host set-up, as `RunConfig.distributed` (`jax_ppo.parallel.distributed`)."""
  compilation_cache_dir: str | None = AUTO_CACHE
  """Folder of JAX's persistent compilation cache: "auto" (`$JAX_PPO_CACHE_DIR`, else
  `~/.cache/jax_ppo/xla`; a folder JAX was already given is kept), a path, or null (or "off")
  to leave the cache to JAX's own settings (`jax_ppo.compile_cache`)."""

  def __post_init__(self):
    name = type(self).__name__

    def bad(field: str, fix: str):
      raise ValueError(f"{name}.{field}={getattr(self, field)!r} is invalid: {fix}.")

    for field in ("model_path", "train_path", "run_dir"):
      if not isinstance(getattr(self, field), str) or not getattr(self, field):
        bad(field, "give a path")
    for field in ("eval_path", "export_dir", "pad_token"):
      value = getattr(self, field)
      if value is not None and (not isinstance(value, str) or not value):
        bad(field, "give a non-empty string, or null")
    if self.dtype not in DTYPE_NAMES:
      bad("dtype", f"choose one of {list(DTYPE_NAMES)}")
    for field in ("resize_embeddings", "tensorboard", "progress"):
      if not isinstance(getattr(self, field), bool):
        bad(field, "use true or false")
    check_cache_setting(self.compilation_cache_dir, field=f"{name}.compilation_cache_dir")
    if self.steps_per_run is not None and (
        isinstance(self.steps_per_run, bool) or not isinstance(self.steps_per_run, int)
        or self.steps_per_run < 1):
      bad("steps_per_run", "use an int >= 1 or null")
    try:
      self.run_options()
    except ValueError as e:
      raise ValueError(str(e).replace("RunOptions.", f"{name}.")) from None

  @property
  def export_path(self) -> pathlib.Path:
    """The folder the trained model is exported to."""
    return pathlib.Path(self.export_dir or os.path.join(self.run_dir, "hf_model"))

  def run_options(self) -> RunOptions:
    """The run folder's `RunOptions` (no samples: these stages generate nothing)."""
    return RunOptions(save_every=self.save_every, keep_last=self.keep_last, log_samples_every=0,
                      tensorboard=self.tensorboard, progress=self.progress,
                      resume_ignore=STAGE_OPERATIONAL_FIELDS)


def train_stage(trainer: Any, config: StageRunConfig, *, stage: str,
                train_keys: Sequence[str]) -> tuple[dict[str, Any], bool]:
  """Runs what is left of an offline stage's run (at most `config.steps_per_run` steps).

  Args:
    trainer: the stage's trainer (`SFTTrainer`, `RewardModelTrainer`).
    config: the stage's run config.
    stage: the summary's "stage" value ("sft", "reward").
    train_keys: metrics of the last step copied into the summary (those it has).

  Returns:
    `(summary, finished)`: the summary holds "stage", "run_dir", "step", "total_steps",
    "steps_run", "complete", "preempted", "export_dir" (None: the caller exports) and the last
    step's `train_keys`; `finished` is True when the run is complete and was not preempted (time
    to evaluate and export).
  """
  if trainer.step_count >= trainer.total_steps:
    logger.info("%s is complete (step %d of %d); exporting only.", config.run_dir,
                trainer.step_count, trainer.total_steps)
  left = max(trainer.total_steps - trainer.step_count, 0)
  # The trainers' train(n) runs n more steps even past total_steps: never ask for more.
  history = trainer.train(left if config.steps_per_run is None else min(config.steps_per_run,
                                                                         left))
  complete = trainer.step_count >= trainer.total_steps
  summary: dict[str, Any] = {
      "stage": stage, "run_dir": config.run_dir, "step": trainer.step_count,
      "total_steps": trainer.total_steps, "steps_run": len(history), "complete": complete,
      "preempted": history.preempted, "export_dir": None,
  }
  if history:
    summary.update({k: float(history[-1][k]) for k in train_keys if k in history[-1]})
  return summary, complete and not history.preempted


def check_run_mesh(config_name: str, mesh: MeshConfig | None) -> None:
  """Before any model loads: a run in a multi-process job needs a mesh over every process's
  devices (alone, each process would train the whole model on its own). One clear error naming
  `<config_name>.mesh` and the fix; nothing on one process."""
  if mesh is None and distributed.multi_process():
    raise ValueError(
        f"{config_name}.mesh=None, but this is one of several processes of a multi-process job: "
        "give a mesh over every process's devices, e.g. mesh.data=-1 (data parallel) or "
        "mesh.fsdp=-1.")


def load_stage_config(cls: type[T], argv: Sequence[str]) -> T:
  """A stage config (`SFTRunConfig`, `RewardRunConfig`) from at most one YAML/JSON file and
  `key=value` overrides (e.g. `["sft.yaml", "sft.learning_rate=1e-5"]`).

  Raises:
    ValueError: unknown keys (with the nearest valid one), bad values, several files.
    FileNotFoundError: the config file does not exist.
  """
  return config_from_argv(cls, argv)


def grow_vocab(model: Any, num_tokens: int, *, resize: bool, what: str) -> None:
  """With `resize` (a config's `resize_embeddings`), grows `model` to `num_tokens` ids when its
  tokenizer has more (a new pad token); otherwise `check_vocab_covers` reports the mismatch."""
  old = model.config.vocab_size
  if resize and num_tokens > old:
    resize_token_embeddings(model, num_tokens)
    logger.info("resize_embeddings: grew the %s's vocabulary from %d to %d ids (new rows are "
                "the mean embedding).", what, old, num_tokens)


def check_model_folder(field: str, path: str | None) -> None:
  """FileNotFoundError naming `field` unless `path` (when given) is a Hugging Face folder."""
  if path is not None and not os.path.isfile(os.path.join(path, "config.json")):
    raise FileNotFoundError(
        f"{field}={path!r}: no Hugging Face model folder there (config.json is missing); give a "
        "local folder written by save_pretrained (or by an earlier jax-ppo stage's export_dir)."
    )


def check_records_file(path: str, *, field: str) -> pathlib.Path:
  """The records source as a path: a .json list of objects, or whatever
  `jax_ppo.data.check_data_path` accepts (JSONL, Parquet, a local `datasets` folder);
  FileNotFoundError/ValueError naming `field` when unusable."""
  if str(path).lower().endswith(".json"):
    file = pathlib.Path(path)
    if not file.is_file():
      raise FileNotFoundError(f"{field}={path!r}: no such file; give {RECORD_FORMATS}.")
    return file
  return check_data_path(path, name=field, suffixes=RECORD_SUFFIXES[:2],
                         formats=RECORD_FORMATS)


def _json_list(file: pathlib.Path, where: str) -> list[tuple[int, Any]]:
  try:
    data = json.loads(file.read_text(encoding="utf-8"))
  except UnicodeDecodeError:
    raise ValueError(f"{where}: not valid UTF-8; save the file as UTF-8.") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"{where}, line {e.lineno}, column {e.colno}: invalid JSON "
                     f"({e.msg}).") from None
  if not isinstance(data, list):
    raise ValueError(f"{where}: a .json file must hold a list of objects, got "
                     f"{type(data).__name__}; or write one object per line in a .jsonl file.")
  return [(i, record) for i, record in enumerate(data)]


class Records(list):
  """A list of records that knows where each came from (`places[i]`, e.g. "'train.jsonl', line
  3"), so that the trainers' errors about a record name its file and line, not its index."""

  places: list[str]

  def __init__(self, records: Sequence[dict[str, Any]], places: Sequence[str]):
    super().__init__(records)
    self.places = list(places)


def read_records(
    path: str,
    *,
    field: str,
    required: Sequence[str | tuple[str, ...]],
) -> Records:
  """The records (JSON objects) of a .jsonl or .json file, each checked for its fields, as
  `Records` (which name their file and line).

  Args:
    path: the file.
    field: how errors name the path (e.g. "SFTRunConfig.train_path").
    required: field names every record must have; a tuple of names is a choice (any one of
      them, e.g. `("messages", "prompt")`); `None` values count as missing.

  Raises:
    FileNotFoundError / ValueError: naming `field`, the file, the line (JSONL; the index in a
      .json list) and the fix.
  """
  file = check_records_file(path, field=field)
  where = f"{field}={path!r}"
  if file.suffix.lower() == ".json":
    rows = [(f"{where}, item {n}", r) for n, r in _json_list(file, where)]
  else:  # JSONL, Parquet or a datasets folder, read by jax_ppo.data
    rows = [(r.where, r.data) for r in iter_records(file, name=field)]
  records, places = [], []
  for place, record in rows:
    if not isinstance(record, dict):
      raise ValueError(f"{place}: expected a JSON object, got {type(record).__name__}.")
    for need in required:
      names = need if isinstance(need, tuple) else (need,)
      if not any(record.get(name) is not None for name in names):
        wanted = " or ".join(f'"{n}"' for n in names)
        raise ValueError(
            f"{place}: the record has no {wanted} (its keys: "
            f"{sorted(map(str, record))}); add it, or name the record's own field in the config "
            "(e.g. sft.prompt_field, reward.chosen_field)."
        )
    records.append(record)
    places.append(place)
  if not records:
    raise ValueError(f"{where} holds no records; give at least one JSON object.")
  return Records(records, places)


__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "grow_vocab",
    "RECORD_SUFFIXES",
    "Records",
    "STAGE_OPERATIONAL_FIELDS",
    "StageRunConfig",
    "check_model_folder",
    "check_run_mesh",
    "check_records_file",
    "load_stage_config",
    "read_records",
    "train_stage",
]
