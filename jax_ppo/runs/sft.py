"""SFT runs from one config file: `SFTRunConfig` and `run_sft` (`jax-ppo sft`).

The first RLHF stage on a user's own checkpoint: a local Hugging Face causal-LM folder, a file of
(prompt, response) or chat records, and an `SFTConfig`. `run_sft(config)` loads everything,
trains with `SFTTrainer` in `config.run_dir` (config.yaml, metrics.jsonl, checkpoints, progress
bar) and, when the run is complete, evaluates the held-out split and writes the model (LoRA
merged) with its tokenizer to `config.export_path`, the folder the reward-model and PPO stages
start from (with `export_adapter_dir`, also the LoRA adapters alone as a PEFT adapter folder).
Running it again on the same run folder resumes from the latest checkpoint (a run whose
computing fields changed is refused); a complete run only exports again.

Example config (YAML)::

  model_path: models/Qwen3-0.6B
  train_path: data/sft.jsonl        # {"prompt", "response" (or "completion")} or {"messages"}
  run_dir: runs/sft
  sft: {max_length: 512, batch_size: 16, num_epochs: 1, eval_fraction: 0.05,
        optimizer: {learning_rate: 2.0e-5}}
  mesh: {data: -1}                  # optional: data parallel over every device (fsdp/tensor too)

With `mesh` the model is read from the folder straight into its shards
(`from_pretrained(..., mesh=mesh)`) and trained on the mesh (`SFTTrainer(mesh=...)`); a
multi-process job (`distributed`) needs one. A run folder written before `sft.optimizer`
existed (flat `sft.learning_rate`, ...) resumes with the same meaning: the checkpoints' saved
configuration is read through `jax_ppo.config_io.migrate_keys` (`SFTConfig.MOVED_KEYS`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jax_ppo.compile_cache import enable_compilation_cache
from jax_ppo.data.records import Record, sft_record
from jax_ppo.models import (
  add_lora,
  check_vocab_covers,
  from_pretrained,
  load_config,
  load_tokenizer,
)
from jax_ppo.parallel.mesh import make_mesh
from jax_ppo.runs.common import (
  DTYPES,
  StageRunConfig,
  check_adapter_vocab,
  check_model_folder,
  check_records_file,
  check_run_mesh,
  grow_vocab,
  load_stage_config,
  read_records,
  resolve_model_paths,
  train_stage,
  write_adapter,
)
from jax_ppo.runs.context import check_fits_context
from jax_ppo.runs.run_folders import check_run_folder_stage
from jax_ppo.sft import SFTConfig, SFTTrainer

logger = logging.getLogger("jax_ppo.sft_run")

@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTRunConfig(StageRunConfig):
  """Everything `run_sft` needs; saved as `run_dir/config.yaml`. The record field names are
  `sft.prompt_field`, `sft.response_field` and `sft.messages_field`."""

  sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
  """SFT hyperparameters (`jax_ppo.sft.SFTConfig`)."""

  def __post_init__(self):
    super().__post_init__()
    if not isinstance(self.sft, SFTConfig):
      raise ValueError(f"SFTRunConfig.sft must be an SFTConfig, got {type(self.sft).__name__}.")


def load_sft_config(argv: Sequence[str]) -> SFTRunConfig:
  """An `SFTRunConfig` from at most one YAML/JSON file and `key=value` overrides."""
  return load_stage_config(SFTRunConfig, argv)


def build_sft_trainer(config: SFTRunConfig) -> SFTTrainer:
  """Loads the model, tokenizer and records of `config` and builds the trainer (which resumes
  from the run folder's latest checkpoint); with `config.mesh` the model is read straight into
  its shards on that mesh.

  Before any weights load, `run_dir` must not be another stage's run folder
  (`jax_ppo.runs.run_folders`) and `sft.max_length` must fit the model's context
  (`max_position_embeddings`, `jax_ppo.runs.context`): one ValueError naming the field.
  """
  config = resolve_model_paths(config)  # a Hub id -> its cached snapshot folder
  check_model_folder("SFTRunConfig.model_path", config.model_path)
  check_run_folder_stage(config.run_dir, "sft", field="SFTRunConfig.run_dir")
  config.check_export_target()
  check_run_mesh("SFTRunConfig", config.mesh)  # (before loading any model)
  mesh = None if config.mesh is None else make_mesh(config.mesh)
  c = config.sft
  for field in ("train_path", "eval_path"):
    if getattr(config, field) is not None:
      check_records_file(getattr(config, field), field=f"SFTRunConfig.{field}")

  def check(record: Record) -> None:  # (the trainer's checks, before any weights load)
    sft_record(record, c.prompt_field, c.response_field, c.messages_field, prefix="sft.")

  train = read_records(config.train_path, field="SFTRunConfig.train_path", check=check)
  evaluation = None if config.eval_path is None else read_records(
      config.eval_path, field="SFTRunConfig.eval_path", check=check)
  model_config = load_config(config.model_path)
  check_fits_context("SFTRunConfig.sft.max_length", c.max_length, model_config,
                     model_field="SFTRunConfig.model_path", model_path=config.model_path)
  eos = model_config.eos_token_ids
  tokenizer = load_tokenizer(config.model_path, pad_token=config.pad_token,
                             add_pad_token=config.resize_embeddings, extra_eos_ids=eos)
  model = from_pretrained(config.model_path, dtype=DTYPES[config.dtype],
                          param_dtype=jnp.float32, mesh=mesh)
  grow_vocab(model, len(tokenizer), resize=config.resize_embeddings, what="policy")
  check_vocab_covers(tokenizer, model.config)
  check_adapter_vocab(config, model, config.model_path, field="SFTRunConfig.model_path")
  if config.lora is not None:
    add_lora(model, config.lora, rngs=nnx.Rngs(c.seed))
  return SFTTrainer(c, model, train_data=train, eval_data=evaluation, tokenizer=tokenizer,
                    run_dir=config.run_dir, run_options=config.run_options(), run_config=config,
                    mesh=mesh)


def run_sft(config: SFTRunConfig) -> dict[str, Any]:
  """Trains (or resumes) the SFT run of `config`; exports the model when the run is complete.

  Returns:
    `{"stage": "sft", "run_dir", "step", "total_steps", "steps_run", "complete", "preempted",
    "export_dir" (None until complete), "adapter_dir" (the PEFT adapter folder once written,
    with `export_adapter_dir`), "cut_records" (records cut to max_length), "train/loss" (the
    last step's, when a step ran), and the held-out "eval/loss" and
    "eval/perplexity" when there is a held-out split}`.
  """
  config = resolve_model_paths(config)  # a Hub id -> its cached snapshot folder
  enable_compilation_cache(config.compilation_cache_dir)  # before anything compiles
  trainer = build_sft_trainer(config)
  try:
    summary, finished = train_stage(trainer, config, stage="sft", train_keys=("train/loss",))
    if finished:
      if trainer.eval_rows is not None:
        metrics = trainer.evaluate()
        summary.update({k: metrics[k] for k in ("eval/loss", "eval/perplexity")})
      summary["export_dir"] = str(trainer.export(config.export_path))
      logger.info("SFT model written to %s.", config.export_path)
      summary["adapter_dir"] = write_adapter(
          config, trainer.model(), base_model=config.model_path, tokenizer=trainer.tokenizer)
    return summary
  finally:
    trainer.close()


__all__ = ["SFTRunConfig", "build_sft_trainer", "load_sft_config", "run_sft"]
