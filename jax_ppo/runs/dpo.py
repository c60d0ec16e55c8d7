"""DPO runs from one config file: `DPORunConfig` and `run_dpo` (`jax-ppo dpo`).

Direct preference optimisation on a user's own checkpoint: a local Hugging Face causal-LM folder
(usually the SFT stage's export), a file of preference records (the reward-model stage's: prompt,
chosen, rejected, as text or chats, with an explicit or implicit prompt;
`jax_ppo.data.preferences`) and a `DPOConfig`. `run_dpo(config)` trains with `DPOTrainer` in
`config.run_dir` against a frozen reference (the starting model; `reference_path` another folder;
with LoRA the base weights) and, when the run is complete, evaluates the held-out split and
writes the policy (LoRA merged) with its tokenizer to `config.export_path`, atomically, the
folder PPO (`policy_path`) or evaluation reads (with `export_adapter_dir`, also the LoRA adapters
alone as a PEFT adapter folder). Running it again resumes.

Example config (YAML)::

  model_path: runs/sft/hf_model
  train_path: data/preferences.jsonl   # {"prompt": ..., "chosen": ..., "rejected": ...}
  run_dir: runs/dpo
  dpo: {beta: 0.1, loss_type: sigmoid, batch_size: 8, num_epochs: 1, eval_fraction: 0.05,
        optimizer: {learning_rate: 1.0e-6}}

With `mesh` (e.g. `mesh.fsdp=-1`) the policy and the reference are read straight into their
shards and train on the mesh; a multi-process job (`distributed`) needs one.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jax_ppo.compile_cache import enable_compilation_cache
from jax_ppo.data.records import Record, preference_record
from jax_ppo.dpo import DPOConfig, DPOTrainer
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
from jax_ppo.runs.paths import PathField
from jax_ppo.runs.run_folders import check_run_folder_stage

logger = logging.getLogger("jax_ppo.dpo_run")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPORunConfig(StageRunConfig):
  """Everything `run_dpo` needs; saved as `run_dir/config.yaml`. The record field names are
  `dpo.prompt_field`, `dpo.chosen_field`, `dpo.rejected_field`."""

  dpo: DPOConfig = dataclasses.field(default_factory=DPOConfig)
  """DPO hyperparameters (`jax_ppo.dpo.DPOConfig`; its optimizer block is `dpo.optimizer`)."""
  reference_path: str | None = None
  """Causal-LM folder (or cached Hub id `org/name`) of the frozen reference (same architecture
  and vocabulary as the policy);
  None: the starting model `model_path`. Not with `lora` (the reference is then the base
  weights)."""

  def __post_init__(self):
    super().__post_init__()
    if not isinstance(self.dpo, DPOConfig):
      raise ValueError(f"DPORunConfig.dpo must be a DPOConfig, got {type(self.dpo).__name__}.")
    if self.reference_path is not None:
      if not isinstance(self.reference_path, str) or not self.reference_path:
        raise ValueError(f"DPORunConfig.reference_path={self.reference_path!r} is invalid: give "
                         "a path, or null.")
      if self.lora is not None:
        raise ValueError("DPORunConfig.reference_path is set with lora: a LoRA policy's "
                         "reference is its base weights (adapters off); set reference_path to "
                         "null, or lora to null.")

  def read_paths(self, prefix: str | None = None) -> list[PathField]:
    """The stage's paths (`StageRunConfig.read_paths`) and the reference's folder."""
    prefix = prefix or type(self).__name__
    return [*super().read_paths(prefix), (f"{prefix}.reference_path", self.reference_path)]


def load_dpo_config(argv: Sequence[str]) -> DPORunConfig:
  """A `DPORunConfig` from at most one YAML/JSON file and `key=value` overrides."""
  return load_stage_config(DPORunConfig, argv)


def build_dpo_trainer(config: DPORunConfig) -> DPOTrainer:
  """Loads the policy, the reference (with `reference_path`), tokenizer and records of `config`
  and builds the trainer (resuming from the run folder); with `config.mesh` the models are read
  straight into their shards."""
  config = resolve_model_paths(config)  # a Hub id -> its cached snapshot folder
  check_model_folder("DPORunConfig.model_path", config.model_path)
  if config.reference_path is not None:
    check_model_folder("DPORunConfig.reference_path", config.reference_path)
  config.check_export_target()
  check_run_mesh("DPORunConfig", config.mesh)  # (before loading any model)
  mesh = None if config.mesh is None else make_mesh(config.mesh)
  c = config.dpo
  for field in ("train_path", "eval_path"):
    if getattr(config, field) is not None:
      check_records_file(getattr(config, field), field=f"DPORunConfig.{field}")
  check_run_folder_stage(config.run_dir, "dpo", field="DPORunConfig.run_dir")

  def check(record: Record) -> None:  # (the trainer's checks, before any weights load)
    preference_record(record, (c.prompt_field, c.chosen_field, c.rejected_field), None,
                      prefix="dpo.")

  train = read_records(config.train_path, field="DPORunConfig.train_path", check=check)
  evaluation = None if config.eval_path is None else read_records(
      config.eval_path, field="DPORunConfig.eval_path", check=check)
  model_config = load_config(config.model_path)
  check_fits_context("DPORunConfig.dpo.max_length", c.max_length, model_config,
                     model_field="DPORunConfig.model_path", model_path=config.model_path)
  eos = model_config.eos_token_ids
  tokenizer = load_tokenizer(config.model_path, pad_token=config.pad_token,
                             add_pad_token=config.resize_embeddings, extra_eos_ids=eos)

  def load(path: str, what: str) -> nnx.Module:
    model = from_pretrained(path, dtype=DTYPES[config.dtype], param_dtype=jnp.float32,
                            mesh=mesh)
    grow_vocab(model, len(tokenizer), resize=config.resize_embeddings, what=what)
    check_vocab_covers(tokenizer, model.config)
    return model

  model = load(config.model_path, "policy")
  check_adapter_vocab(config, model, config.model_path, field="DPORunConfig.model_path")
  reference = None if config.reference_path is None else load(config.reference_path,
                                                              "reference")
  if config.lora is not None:
    add_lora(model, config.lora, rngs=nnx.Rngs(c.seed))
  return DPOTrainer(c, model, train_data=train, eval_data=evaluation, tokenizer=tokenizer,
                    reference=reference, run_dir=config.run_dir,
                    run_options=config.run_options(), run_config=config, mesh=mesh)


def run_dpo(config: DPORunConfig) -> dict[str, Any]:
  """Trains (or resumes) the DPO run of `config`; exports the policy when the run is complete.

  Returns:
    `{"stage": "dpo", "run_dir", "step", "total_steps", "steps_run", "complete", "preempted",
    "export_dir" (None until complete), "adapter_dir" (the PEFT adapter folder once written,
    with `export_adapter_dir`), "cut_records" (records cut to max_length),
    "train/loss", "rewards/accuracies", "rewards/margins" (the last step's, when a step ran),
    "eval/loss", "eval/rewards/accuracies", "eval/rewards/margins" with a held-out split, and
    "time/reference_s" (seconds spent computing the reference's log-probs) with
    `dpo.precompute_reference`}`.
  """
  config = resolve_model_paths(config)  # a Hub id -> its cached snapshot folder
  enable_compilation_cache(config.compilation_cache_dir)  # before anything compiles
  trainer = build_dpo_trainer(config)
  try:
    summary, finished = train_stage(
        trainer, config, stage="dpo",
        train_keys=("train/loss", "rewards/accuracies", "rewards/margins"))
    if finished:
      if trainer.eval_pairs is not None:
        metrics = trainer.evaluate()
        summary.update({k: metrics[k] for k in ("eval/loss", "eval/rewards/accuracies",
                                                "eval/rewards/margins")})
      summary["export_dir"] = str(trainer.export(config.export_path))
      logger.info("DPO policy written to %s.", config.export_path)
      summary["adapter_dir"] = write_adapter(
          config, trainer.model(), base_model=config.model_path, tokenizer=trainer.tokenizer)
    if trainer.reference_seconds is not None:
      summary["time/reference_s"] = trainer.reference_seconds
    return summary
  finally:
    trainer.close()


__all__ = ["DPORunConfig", "build_dpo_trainer", "load_dpo_config", "run_dpo"]
