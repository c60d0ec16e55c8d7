"""What the run configs share: their base and run-folder block, record files, model folders.

`BaseRunConfig` holds the fields of every run config, validated once: the run folder
(`run_dir`), how it is written (the `run` block), LoRA, the compute dtype, the pad token, the
mesh, the multi-host set-up and the compilation cache. `RunConfig` (PPO,
`jax_ppo.runs.ppo_config`) and `StageRunConfig` (SFT and the reward model) subclass it. The
`run` block holds the run loop's options as a config file gives them (`run.save_every=5`,
`run.updates_per_run=100`); `RunFolder.options` builds the loop's `RunOptions` from it, so their
validation is `RunOptions`'s own. Each family has its block (`PPORunFolder` adds PPO's samples,
W&B, plots and rollback; `StageRunFolder` has other defaults); its fields may all change when a
run resumes. The keys a run config held flat before the block (`save_every`, `updates_per_run`,
...) are in its `MOVED_KEYS` (`jax_ppo.config_io`): a file or override that uses one is one
error naming the new key, and a run folder saved with them resumes with the same meaning.

`read_records` reads the training data of a stage (JSONL, Parquet or a local `datasets` folder
through `jax_ppo.data.iter_records`, or a JSON file holding a list of objects) and checks every
record with the stage's check from `jax_ppo.data.records` before any weights load, so a
malformed record is reported with the config field, the file and the line (or row).
`load_stage_config` builds a frozen stage config from a YAML/JSON file and `key=value` overrides
with `jax_ppo.config_io` (unknown keys are named with the nearest valid one).
`resolve_model_paths` turns the model fields that name a Hugging Face Hub id (`org/name`) into
the folders of their snapshots in the local cache, once, when a stage's run starts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import jax.numpy as jnp

from jax_ppo.compile_cache import AUTO as AUTO_CACHE
from jax_ppo.compile_cache import check_cache_setting
from jax_ppo.config_io import config_from_argv
from jax_ppo.data.files import check_data_path, iter_records
from jax_ppo.data.records import Record
from jax_ppo.models import LoRAConfig, hub_model_folder, load_config, resize_token_embeddings
from jax_ppo.parallel import distributed
from jax_ppo.parallel.distributed import DistributedConfig
from jax_ppo.parallel.mesh import MeshConfig
from jax_ppo.runs.paths import PathField, check_run_paths, relation
from jax_ppo.training.export import ADAPTER_MARKER, check_export_target, export_adapter
from jax_ppo.training.loop import RunOptions

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
"""`dtype` name of a run config -> compute dtype (parameters stay float32)."""
DTYPE_NAMES = tuple(DTYPES)

T = TypeVar("T")

RECORD_SUFFIXES = (".jsonl", ".parquet", ".json")
RECORD_FORMATS = ("a .jsonl file (one JSON object per line), a .parquet file, a local Hugging Face "
                  "`datasets` folder (save_to_disk) or a .json file holding a list of objects")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunFolder:
  """How a run folder is written: the fields every run's `run` block has.

  Validated by the run config that holds it (`check`), so that errors name its place
  (`RunConfig.run.save_every`).
  """

  save_every: int = 10
  """Checkpoint every this many steps (and at the end of each invocation)."""
  keep_last: int = 3
  """Number of most recent checkpoints kept."""
  tensorboard: bool = True
  """Write TensorBoard events."""
  progress: bool = True
  """Show a progress bar."""

  PER_RUN: ClassVar[str | None] = None
  """The name of the family's field that limits the steps (PPO: updates) of one invocation (its
  value None: to the end of the run)."""

  def options(self, **fixed: Any) -> RunOptions:
    """The run loop's `RunOptions`: this block's fields that are `RunOptions` fields, and
    `fixed` (e.g. `resume_ignore=...`)."""
    names = {f.name for f in dataclasses.fields(RunOptions)}
    own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in names}
    return RunOptions(**own, **fixed)

  def check(self, owner: str) -> None:
    """Raises a ValueError naming `<owner>.<field>` for an invalid field (`RunOptions` decides,
    and the per-invocation limit is an int >= 1 or null)."""
    for field in ("tensorboard", "progress"):
      if not isinstance(getattr(self, field), bool):
        raise ValueError(f"{owner}.{field}={getattr(self, field)!r} is invalid: use true or "
                         "false.")
    limit = None if self.PER_RUN is None else getattr(self, self.PER_RUN)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
      raise ValueError(f"{owner}.{self.PER_RUN}={limit!r} is invalid: use an int >= 1 or null.")
    try:
      self.options()
    except ValueError as e:
      raise ValueError(str(e).replace("RunOptions.", f"{owner}.")) from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPORunFolder(RunFolder):
  """The `run` block of a PPO run (`RunConfig.run`): the checkpoints, the logs and samples,
  W&B, the plots, the progress bar and the rollback on a collapse."""

  updates_per_run: int | None = None
  """Stop after this many updates in one invocation (None: run to `ppo.total_updates`); run the
  same command again to continue (for schedulers with time limits)."""
  save_every: int = 10
  """Checkpoint every this many updates (and at the end of each invocation)."""
  best_metric: str | None = None
  """Also keep the checkpoint with the best value of this metric."""
  best_mode: str = "max"
  """"max" or "min" for `best_metric`."""
  log_samples_every: int = 10
  """Write samples to samples.jsonl every this many updates (0: never)."""
  wandb: bool = False
  """Also log metrics to Weights & Biases (needs the `wandb` package; without it a warning)."""
  wandb_init: dict[str, Any] | None = None
  """Keyword arguments of `wandb.init`, e.g. `{project: rlhf, name: run1}`; the run's
  configuration is passed as `config`, the run folder as `dir`. The run folder keeps the W&B
  run's id (`wandb_run_id`), so a resumed run continues the same W&B run, unless these give `id`
  or `resume` (then they are used as given)."""
  plots: bool = True
  """Write PNG plots of `metrics.jsonl` into `run_dir/plots` at the end of each invocation: one
  per panel (reward, KL and entropy per response and per token, response length, losses, ...)
  and `overview.png` (`jax_ppo.logging.plots`; also `jax-ppo plot RUN_DIR`)."""
  rollback: bool = False
  """Roll back to the last good checkpoint when the monitor reports a collapse."""
  rollback_lr_factor: float = 0.5
  """Learning-rate multiplier applied at each rollback."""
  max_rollbacks: int = 3
  """Stop the run when it collapses again after this many rollbacks."""

  PER_RUN: ClassVar[str | None] = "updates_per_run"


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageRunFolder(RunFolder):
  """The `run` block of an SFT or reward-model run (`SFTRunConfig.run`, `RewardRunConfig.run`):
  they write no samples and have no hook that reports a collapse."""

  steps_per_run: int | None = None
  """Stop after this many steps in one invocation (None: run to the end); run again to go on."""
  save_every: int = 50
  """Checkpoint every this many steps (and at the end of each invocation)."""
  keep_last: int = 2
  """Number of most recent checkpoints kept."""
  tensorboard: bool = False
  """Write TensorBoard events."""

  PER_RUN: ClassVar[str | None] = "steps_per_run"


PPO_RUN_FIELDS = tuple(f.name for f in dataclasses.fields(PPORunFolder))
"""The `run` block fields `RunConfig` held flat before the block."""
STAGE_RUN_FIELDS = tuple(f.name for f in dataclasses.fields(StageRunFolder))
"""The `run` block fields `StageRunConfig` held flat before the block."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BaseRunConfig:
  """The fields of every run config: the run folder, its `run` block, and how the models are
  loaded and placed. Subclasses give `run` their family's block."""

  run_dir: str
  """Run folder: config.yaml, metrics.jsonl, tensorboard/, checkpoints/. It must not be, contain
  or lie inside a path the run reads (its models, tokenizers, data): refused when the config is
  built (`jax_ppo.runs.paths`)."""
  run: RunFolder = dataclasses.field(default_factory=RunFolder)
  """How the run folder is written and how much of the run one invocation does."""
  lora: LoRAConfig | None = None
  """Train LoRA adapters instead of every weight (e.g. `lora.rank=16`; merged into exports)."""
  export_adapter_dir: str | None = None
  """Where the trained LoRA adapters are also written, alone, as a PEFT adapter folder
  (`adapter_config.json`, `adapter_model.safetensors`, the tokenizer) that
  `peft.PeftModel.from_pretrained(base, folder)` loads on the starting model, when the run is
  complete (SFT, DPO: beside `export_dir`, which stays the merged model; PPO: at the end of the
  invocation that completes `ppo.total_updates`). None: not written. Needs `lora`, and the
  starting model's vocabulary (no `resize_embeddings` growth: new embedding rows are no adapter
  weights); not for reward models. Written atomically (an earlier adapter export there is
  replaced, a non-empty folder without `adapter_config.json` refused); it must not overlap a path
  the run reads, the run folder or a stage's `export_dir`."""
  pad_token: str | None = None
  """Pad token of the tokenizer (e.g. "<unk>"); None: the tokenizer's own, else an existing
  unused special token (see `jax_ppo.models.load_tokenizer`). It must not be a stop token; a
  token missing from the vocabulary needs `resize_embeddings`."""
  resize_embeddings: bool = False
  """When the tokenizer has no usable pad token (GPT-2) or `pad_token` is new, add it and grow
  the embedding (and an untied LM head) of every model that reads its ids, new rows initialised
  to the mean row (`jax_ppo.models.resize_token_embeddings`). False: such a tokenizer is an
  error naming this switch."""
  dtype: str = "float32"
  """Compute dtype of every model: "float32", "bfloat16" or "float16". The weights, gradients and
  optimizer state stay float32 (master weights), and log-probs, entropies, norms and softmaxes
  are computed in float32 whatever this is."""
  mesh: MeshConfig | None = None
  """Device mesh `(data, fsdp, tensor)` (`jax_ppo.parallel.MeshConfig`; -1: the rest), e.g.
  `mesh.fsdp=8` to shard every model and the optimizer state over 8 devices, `mesh.data=-1` to
  split each batch's rows over every device; None: one device. A run may resume on another mesh
  (checkpoints restore into the new shardings)."""
  distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
  """Multi-host set-up (`jax_ppo.parallel.distributed`): "auto" joins a multi-process job when
  the environment or `distributed.coordinator_address` describes one (e.g.
  `distributed.coordinator_address=10.0.0.2:12355 distributed.num_processes=2
  distributed.process_id=1`); a single process otherwise."""
  compilation_cache_dir: str | None = AUTO_CACHE
  """Folder of JAX's persistent compilation cache, so that a second invocation (a resumed run,
  the next run of the same setup) loads its compiled programs instead of compiling them again:
  "auto" (`$JAX_PPO_CACHE_DIR`, else `~/.cache/jax_ppo/xla`; a folder JAX was already given is
  kept), a path, or null (or "off") to leave the cache to JAX's own settings
  (`jax_ppo.compile_cache`)."""

  OPERATIONAL_FIELDS: ClassVar[tuple[str, ...]] = ()
  """Dotted keys that may change between invocations of one run (`RunOptions.resume_ignore`)."""

  def __post_init__(self):
    name = type(self).__name__

    def bad(field: str, fix: str):
      raise ValueError(f"{name}.{field}={getattr(self, field)!r} is invalid: {fix}.")

    if not isinstance(self.run_dir, str) or not self.run_dir:
      bad("run_dir", "give a path")
    block = {f.name: f for f in dataclasses.fields(self)}["run"].default_factory
    if not isinstance(self.run, block):
      bad("run", f"give a mapping of {block.__name__} fields")
    self.run.check(f"{name}.run")
    if self.pad_token is not None and (not isinstance(self.pad_token, str) or not self.pad_token):
      bad("pad_token", "give a token string of the tokenizer's vocabulary, or null")
    if not isinstance(self.resize_embeddings, bool):
      bad("resize_embeddings", "use true or false")
    if self.dtype not in DTYPES:
      bad("dtype", f"choose one of {list(DTYPE_NAMES)}")
    check_cache_setting(self.compilation_cache_dir, field=f"{name}.compilation_cache_dir")
    if self.export_adapter_dir is not None:
      if not isinstance(self.export_adapter_dir, str) or not self.export_adapter_dir:
        bad("export_adapter_dir", "give a folder for the PEFT adapter, or null")
      if self.lora is None:
        bad("export_adapter_dir", "a PEFT adapter export needs LoRA adapters and lora is null; "
                                  "set lora (e.g. lora.rank=16), or remove export_adapter_dir "
                                  "(export_dir holds the full model)")

  def adapter_exports(self, prefix: str | None = None) -> list[PathField]:
    """`[(field, export_adapter_dir)]` when it is set (for `check_run_paths`), else []."""
    if self.export_adapter_dir is None:
      return []
    return [(f"{prefix or type(self).__name__}.export_adapter_dir", self.export_adapter_dir)]

  def check_adapter_export_target(self) -> None:
    """Before anything loads: `export_adapter_dir`, when set, is absent, empty or an earlier
    adapter export (`jax_ppo.training.export.check_export_target`)."""
    for field, path in self.adapter_exports():
      check_export_target(path, field=field, marker=ADAPTER_MARKER)

  def run_options(self, **fixed: Any) -> RunOptions:
    """The run loop's `RunOptions`: the `run` block, the family's `OPERATIONAL_FIELDS` as
    `resume_ignore`, and `fixed`."""
    return self.run.options(resume_ignore=type(self).OPERATIONAL_FIELDS, **fixed)


STAGE_OPERATIONAL_FIELDS = ("run_dir", "export_dir", "export_adapter_dir", "run", "mesh",
                            "distributed", "compilation_cache_dir")
"""Stage-config fields (dotted keys or prefixes: `run` is the whole run block) that may change
between invocations of one run (they do not change what is computed); a difference in any other
field refuses to resume."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageRunConfig(BaseRunConfig):
  """The fields every stage run (SFT, reward model) has: model, data, export, and the fields of
  every run (`BaseRunConfig`) with the stage's run block (`run.steps_per_run`, `run.save_every`,
  ...)."""

  model_path: str
  """Local Hugging Face folder of the starting model (config.json, safetensors, tokenizer), or a
  Hugging Face Hub id `org/name[@revision]` already in the local cache (`hf download org/name`;
  never downloaded by a run, `resolve_model_paths`). Every model field takes either."""
  train_path: str
  """Training records: a .jsonl file (one JSON object per line), a .parquet file, a local
  Hugging Face `datasets` folder, or a .json list of objects."""
  eval_path: str | None = None
  """Held-out records (same format); None holds out the stage config's `eval_fraction`."""
  export_dir: str | None = None
  """Where the trained model is written as a Hugging Face folder when the run is complete;
  None: `<run_dir>/hf_model`. Written atomically (a temporary folder beside it, renamed into
  place); an earlier export there is replaced, a non-empty folder without `config.json` refused.
  It must not be, contain or lie inside a path the run reads, nor be or contain `run_dir`
  (`jax_ppo.runs.paths`)."""
  run: StageRunFolder = dataclasses.field(default_factory=StageRunFolder)
  """How the run folder is written: `run.steps_per_run`, `run.save_every`, `run.keep_last`,
  `run.tensorboard`, `run.progress` (`StageRunFolder`)."""

  OPERATIONAL_FIELDS: ClassVar[tuple[str, ...]] = STAGE_OPERATIONAL_FIELDS
  MOVED_KEYS: ClassVar[dict[str, str]] = {f: f"run.{f}" for f in STAGE_RUN_FIELDS}
  """Old flat run-folder keys -> their place in the `run` block (`jax_ppo.config_io`)."""

  def __post_init__(self):
    super().__post_init__()
    name = type(self).__name__
    defaults = {f.name: f.default for f in dataclasses.fields(self)}
    for field in ("model_path", "train_path"):
      if getattr(self, field) is None and defaults[field] is None:
        continue  # (a stage whose records are optional: DPO reads prompts instead)
      if not isinstance(getattr(self, field), str) or not getattr(self, field):
        raise ValueError(f"{name}.{field}={getattr(self, field)!r} is invalid: give a path.")
    for field in ("eval_path", "export_dir"):
      value = getattr(self, field)
      if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{name}.{field}={value!r} is invalid: give a non-empty string, or "
                         "null.")
    self.check_paths()

  def read_paths(self, prefix: str | None = None) -> list[PathField]:
    """The paths the run reads, as `(field, path)` (unset fields: None): the starting model (and
    its tokenizer) and the record files. `prefix` names the fields (default: the class name)."""
    prefix = prefix or type(self).__name__
    return [(f"{prefix}.{f}", getattr(self, f)) for f in ("model_path", "train_path", "eval_path")]

  def check_paths(self) -> None:
    """The run folder and the export folder overlap no path the run reads, and the export does
    not hold the run folder (`jax_ppo.runs.paths.check_run_paths`; one ValueError naming both
    fields)."""
    name = type(self).__name__
    check_run_paths(inputs=self.read_paths(), run_dirs=[(f"{name}.run_dir", self.run_dir)],
                    exports=[(f"{name}.export_dir", str(self.export_path)),
                             *self.adapter_exports()])
    for field, path in self.adapter_exports():
      how = relation(path, str(self.export_path))
      if how is not None:
        raise ValueError(f"{field}={path!r} {how} {name}.export_dir={str(self.export_path)!r}: "
                         "each export replaces its folder whole. Give the adapter a folder of "
                         "its own beside the model's, e.g. <run_dir>/hf_adapter.")

  def check_export_target(self) -> None:
    """Before anything loads: the export folder is absent, empty, or an earlier export that the
    run's export replaces (`jax_ppo.training.export.check_export_target`)."""
    check_export_target(self.export_path, field=f"{type(self).__name__}.export_dir")
    self.check_adapter_export_target()

  @property
  def export_path(self) -> pathlib.Path:
    """The folder the trained model is exported to."""
    return pathlib.Path(self.export_dir or os.path.join(self.run_dir, "hf_model"))

  def run_options(self, **fixed: Any) -> RunOptions:
    """The run folder's `RunOptions` (no samples: these stages generate nothing)."""
    return super().run_options(log_samples_every=0, **fixed)


def train_stage(trainer: Any, config: StageRunConfig, *, stage: str,
                train_keys: Sequence[str]) -> tuple[dict[str, Any], bool]:
  """Runs what is left of an offline stage's run (at most `config.run.steps_per_run` steps).

  Args:
    trainer: the stage's trainer (`SFTTrainer`, `RewardModelTrainer`, `DPOTrainer`).
    config: the stage's run config.
    stage: the summary's "stage" value ("sft", "reward", "dpo").
    train_keys: metrics of the last step copied into the summary (those it has).

  Returns:
    `(summary, finished)`: the summary holds "stage", "run_dir", "step", "total_steps",
    "steps_run", "complete", "preempted", "export_dir" (None: the caller exports), "cut_records"
    (how many training and held-out records were cut to `max_length`) and the last step's
    `train_keys`; `finished` is True when the run is complete and was not preempted (time
    to evaluate and export).
  """
  if trainer.step_count >= trainer.total_steps:
    logger.info("%s is complete (step %d of %d); exporting only.", config.run_dir,
                trainer.step_count, trainer.total_steps)
  left = max(trainer.total_steps - trainer.step_count, 0)
  # The trainers' train(n) runs n more steps even past total_steps: never ask for more.
  per_run = config.run.steps_per_run
  history = trainer.train(left if per_run is None else min(per_run, left))
  complete = trainer.step_count >= trainer.total_steps
  summary: dict[str, Any] = {
      "stage": stage, "run_dir": config.run_dir, "step": trainer.step_count,
      "total_steps": trainer.total_steps, "steps_run": len(history), "complete": complete,
      "preempted": history.preempted, "export_dir": None,
  }
  if history:
    summary.update({k: float(history[-1][k]) for k in train_keys if k in history[-1]})
  # Records longer than max_length, cut to fit (each stage's warning names them).
  summary["cut_records"] = int(sum(trainer.cut_records.values()))
  return summary, complete and not history.preempted


def check_adapter_vocab(config: BaseRunConfig, model: Any, base_path: str, *,
                        field: str) -> None:
  """With `config.export_adapter_dir`: `model` (the policy, after `grow_vocab`) has the vocabulary
  of its starting model at `base_path` (`field` names it); a grown vocabulary's new embedding rows
  are no adapter weights, so PEFT on the starting model could not read the new ids. One
  ValueError, before training."""
  if config.export_adapter_dir is None:
    return
  base = load_config(base_path).vocab_size
  if model.config.vocab_size != base:
    raise ValueError(
        f"{type(config).__name__}.export_adapter_dir={config.export_adapter_dir!r}: the run grew "
        f"the vocabulary of {field}={base_path!r} from {base} to {model.config.vocab_size} ids "
        "(resize_embeddings), and a PEFT adapter holds only the LoRA matrices, not the new "
        "embedding rows. Remove export_adapter_dir and use the merged export, or give "
        "pad_token an existing token so that nothing grows.")


def write_adapter(config: BaseRunConfig, model: Any, *, base_model: str,
                  tokenizer: Any) -> str | None:
  """Writes `model`'s adapters to `config.export_adapter_dir` (when set) as a PEFT adapter folder
  with the tokenizer, atomically (`jax_ppo.training.export.export_adapter`; several processes:
  every process calls it, process 0 writes). Returns the folder, or None when unset."""
  if config.export_adapter_dir is None:
    return None
  field = f"{type(config).__name__}.export_adapter_dir"
  path = export_adapter(model, config.export_adapter_dir, base_model=base_model,
                        tokenizer=tokenizer, field=field)
  logger.info("PEFT adapter written to %s.", path)
  return str(path)


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


MODEL_PATH_FIELDS = ("model_path", "policy_path", "reward_model_path", "value_model_path",
                     "reference_path")
"""The run-config fields that name a model folder (those a config has), besides PPO's
`rewards[i].model_path`: each a local folder or a Hugging Face Hub id (`org/name[@revision]`)."""


def resolve_model_paths(config: T) -> T:
  """`config` with every model field (`MODEL_PATH_FIELDS`, PPO's `rewards[i].model_path`) that
  names a Hugging Face Hub id in place of a local folder replaced by the folder of its snapshot in
  the local cache (`jax_ppo.models.hf.hub_model_folder`: an existing local path always wins;
  nothing is downloaded).

  Every stage's run (`run_sft`, `run_reward`, `run_dpo`, `run_training` and the pipeline through
  them, the `build_*` functions, `evaluate_run`, `export_run`, `jax-ppo plan`) calls it before
  any check reads `config.json`, so the checks, the loaders and the run folder's `config.yaml`
  see the snapshot folder (a resumed run is compared with the same folder; a newer snapshot of
  the id is a changed config). Calling it again changes nothing.

  Raises:
    FileNotFoundError: an id absent from the cache, naming the field, the id and the
      `hf download` command.
  """
  name = type(config).__name__
  changes: dict[str, Any] = {}
  for field in MODEL_PATH_FIELDS:
    path = getattr(config, field, None)
    if isinstance(path, str) and path:
      folder = hub_model_folder(path, field=f"{name}.{field}")
      if folder != path:
        changes[field] = folder
  sources = getattr(config, "rewards", ())
  resolved_sources = tuple(
      source if not isinstance(getattr(source, "model_path", None), str) else
      dataclasses.replace(source, model_path=hub_model_folder(
          source.model_path, field=f"{name}.rewards[{i}].model_path"))
      for i, source in enumerate(sources))
  if resolved_sources != tuple(sources):
    changes["rewards"] = resolved_sources
  if not changes:
    return config
  for field, folder in changes.items():
    if field != "rewards":
      logger.info("%s.%s=%r is the Hugging Face Hub snapshot %s.", name, field,
                  getattr(config, field), folder)
  return dataclasses.replace(config, **changes)


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
    check: Callable[[Record], Any],
) -> Records:
  """The records (JSON objects) of a records source (`check_records_file`), each checked by
  `check` (`jax_ppo.data.records.sft_record` or `preference_record`, with the run's field
  names: the checks the trainer makes again, here before any weights load), as `Records`
  (which name their file and line).

  Args:
    path: the file or folder.
    field: how errors name the path (e.g. "SFTRunConfig.train_path").
    check: raises the record's ValueError (naming its place, field and fix).

  Raises:
    FileNotFoundError / ValueError: naming `field`, the file, the line (JSONL; the row of
      Parquet or `datasets`; the index in a .json list) and the fix.
  """
  file = check_records_file(path, field=field)
  where = f"{field}={path!r}"
  if file.suffix.lower() == ".json":
    rows = [Record(f"{where}, item {n}", r) for n, r in _json_list(file, where)]
  else:  # JSONL, Parquet or a datasets folder, read by jax_ppo.data
    rows = list(iter_records(file, name=field))
  records, places = [], []
  for row in rows:
    place, record = row.where, row.data
    if not isinstance(record, dict):
      raise ValueError(f"{place}: expected a JSON object, got {type(record).__name__}.")
    check(row)
    records.append(record)
    places.append(place)
  if not records:
    raise ValueError(f"{where} holds no records; give at least one JSON object.")
  return Records(records, places)


__all__ = [
    "BaseRunConfig",
    "DTYPES",
    "DTYPE_NAMES",
    "PPORunFolder",
    "PPO_RUN_FIELDS",
    "RunFolder",
    "STAGE_RUN_FIELDS",
    "StageRunFolder",
    "grow_vocab",
    "RECORD_SUFFIXES",
    "Records",
    "STAGE_OPERATIONAL_FIELDS",
    "StageRunConfig",
    "MODEL_PATH_FIELDS",
    "check_adapter_vocab",
    "check_model_folder",
    "check_run_mesh",
    "check_records_file",
    "load_stage_config",
    "read_records",
    "resolve_model_paths",
    "train_stage",
    "write_adapter",
]
