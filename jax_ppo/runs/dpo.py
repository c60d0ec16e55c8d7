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

Online DPO (`jax_ppo.dpo.online`): `prompts_path` (a prompts file, the PPO run's forms) in place
of `train_path`, and a reward source as the PPO run names it (exactly one of
`reward_model_path`, `reward_function`, `rewards`; `jax_ppo.runs.scoring`). Each step samples
`dpo.n_samples` responses per prompt from the current policy, the scorer picks the chosen and
rejected ones, and `OnlineDPOTrainer` makes one DPO step; one process (a mesh of its devices is
fine)::

  model_path: runs/sft/hf_model
  prompts_path: data/prompts.jsonl     # {"prompt": ...} or {"messages": [...]}
  reward_model_path: runs/reward/hf_model
  run_dir: runs/online_dpo
  dpo: {beta: 0.1, batch_size: 8, total_steps: 500, sampling: {max_new_tokens: 64}}
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jax_ppo.compile_cache import enable_compilation_cache
from jax_ppo.data.files import PROMPT_FORMATS, PROMPT_SUFFIXES, check_data_path, read_prompts
from jax_ppo.data.records import Record, preference_record
from jax_ppo.dpo import DPOConfig, DPOTrainer, OnlineDPOTrainer
from jax_ppo.models import (
  add_lora,
  check_vocab_covers,
  from_pretrained,
  load_config,
  load_tokenizer,
)
from jax_ppo.parallel.distributed import multi_process
from jax_ppo.parallel.mesh import make_mesh
from jax_ppo.rewards.specs import RewardSource
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
from jax_ppo.runs.context import check_fits_context, prompt_token_budget
from jax_ppo.runs.paths import PathField
from jax_ppo.runs.run_folders import check_run_folder_stage
from jax_ppo.runs.scoring import (
  build_scorer,
  check_reward_models,
  check_reward_source,
  reward_given,
  reward_model_fields,
)

logger = logging.getLogger("jax_ppo.dpo_run")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPORunConfig(StageRunConfig):
  """Everything `run_dpo` needs; saved as `run_dir/config.yaml`. The record field names are
  `dpo.prompt_field`, `dpo.chosen_field`, `dpo.rejected_field`."""

  train_path: str | None = None
  """Preference records (offline DPO): a .jsonl file (one JSON object per line), a .parquet file,
  a local Hugging Face `datasets` folder, or a .json list of objects. Exactly one of train_path
  and prompts_path."""
  prompts_path: str | None = None
  """Prompts (online DPO, as the PPO run reads them): a .txt file (one per line), a .jsonl or
  .parquet file or a local `datasets` folder of "prompt" or "messages" records. Needs a reward
  source (`reward_model_path`, `reward_function` or `rewards`); not with `eval_path`,
  `dpo.eval_fraction` or `dpo.precompute_reference`."""
  reward_model_path: str | None = None
  """Online DPO: the reward model that picks each pair's chosen and rejected response, a Hugging
  Face `*ForSequenceClassification` folder (one label) or a cached Hub id, e.g. the export of
  `jax-ppo reward` (as `RunConfig.reward_model_path`)."""
  reward_function: str | None = None
  """Online DPO: a programmatic reward instead of a reward model: a built-in
  (`REWARD_FUNCTIONS`) or "package.module:function" (as `RunConfig.reward_function`)."""
  rewards: tuple[RewardSource, ...] = ()
  """Online DPO: several reward sources combined with weights (as `RunConfig.rewards`); each
  source's raw score is logged as `reward/<name>`."""
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
    if (self.train_path is None) == (self.prompts_path is None):
      raise ValueError(
          "DPORunConfig needs exactly one of train_path (preference records: offline DPO) and "
          "prompts_path (prompts whose sampled responses a reward scores: online DPO); got "
          f"train_path={self.train_path!r}, prompts_path={self.prompts_path!r}.")
    if self.prompts_path is not None:
      if not isinstance(self.prompts_path, str) or not self.prompts_path:
        raise ValueError(f"DPORunConfig.prompts_path={self.prompts_path!r} is invalid: give a "
                         "path.")
      check_reward_source(self)
      if self.eval_path is not None:
        raise ValueError(f"DPORunConfig.eval_path={self.eval_path!r} is invalid with "
                         "prompts_path: online DPO holds out no preference pairs; remove "
                         "eval_path.")
      if self.dpo.precompute_reference:
        raise ValueError("DPORunConfig.dpo.precompute_reference=True is invalid with "
                         "prompts_path: online DPO samples new pairs every step, so no reference "
                         "log-probs can be cached; set it to false.")
      if self.dpo.eval_fraction:
        raise ValueError(f"DPORunConfig.dpo.eval_fraction={self.dpo.eval_fraction} is invalid "
                         "with prompts_path: online DPO holds out no preference pairs; set it "
                         "to 0.")
    elif reward_given(self):
      field = next(f for f in ("reward_model_path", "reward_function", "rewards")
                   if getattr(self, f) not in (None, ()))
      raise ValueError(f"DPORunConfig.{field} is set with train_path: a reward scores the "
                       "sampled responses of online DPO only; give prompts_path instead of "
                       f"train_path, or remove {field}.")
    if self.reference_path is not None:
      if not isinstance(self.reference_path, str) or not self.reference_path:
        raise ValueError(f"DPORunConfig.reference_path={self.reference_path!r} is invalid: give "
                         "a path, or null.")
      if self.lora is not None:
        raise ValueError("DPORunConfig.reference_path is set with lora: a LoRA policy's "
                         "reference is its base weights (adapters off); set reference_path to "
                         "null, or lora to null.")

  def read_paths(self, prefix: str | None = None) -> list[PathField]:
    """The stage's paths (`StageRunConfig.read_paths`), the reference's folder, the prompts and
    the reward models."""
    prefix = prefix or type(self).__name__
    return [*super().read_paths(prefix), (f"{prefix}.reference_path", self.reference_path),
            (f"{prefix}.prompts_path", self.prompts_path),
            *((f"{prefix}.{field}", path) for field, path in reward_model_fields(self))]


def load_dpo_config(argv: Sequence[str]) -> DPORunConfig:
  """A `DPORunConfig` from at most one YAML/JSON file and `key=value` overrides."""
  return load_stage_config(DPORunConfig, argv)


def load_policy_and_reference(config: DPORunConfig, tokenizer: Any, mesh: Any
                              ) -> tuple[nnx.Module, nnx.Module | None]:
  """The policy (`model_path`; with `lora`, its adapters added) and the reference
  (`reference_path`, else None: the trainer's frozen copy of the policy or, with LoRA, its base
  weights), each in `dtype` compute with float32 parameters, read into their shards on `mesh`,
  the vocabulary grown to the tokenizer's when `resize_embeddings`."""

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
    add_lora(model, config.lora, rngs=nnx.Rngs(config.dpo.seed))
  return model, reference


def build_dpo_trainer(config: DPORunConfig) -> DPOTrainer | OnlineDPOTrainer:
  """Loads the policy, the reference (with `reference_path`), tokenizer and records of `config`
  and builds the trainer (resuming from the run folder); with `config.mesh` the models are read
  straight into their shards. With `prompts_path`: `build_online_dpo_trainer`."""
  config = resolve_model_paths(config)  # a Hub id -> its cached snapshot folder
  if config.prompts_path is not None:
    return build_online_dpo_trainer(config)
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

  model, reference = load_policy_and_reference(config, tokenizer, mesh)
  return DPOTrainer(c, model, train_data=train, eval_data=evaluation, tokenizer=tokenizer,
                    reference=reference, run_dir=config.run_dir,
                    run_options=config.run_options(), run_config=config, mesh=mesh)


def build_online_dpo_trainer(config: DPORunConfig) -> OnlineDPOTrainer:
  """Loads the policy, the reference (with `reference_path`), tokenizer, prompts and reward
  source of an online DPO run (`prompts_path`) and builds the `OnlineDPOTrainer` (resuming from
  the run folder). Before any weights load: the folders, the run folder's stage, the reward
  models' score heads and every prompt's length (the policy's context minus
  `dpo.sampling.max_new_tokens`) are checked."""
  config = resolve_model_paths(config)  # a Hub id -> its cached snapshot folder
  check_model_folder("DPORunConfig.model_path", config.model_path)
  if config.reference_path is not None:
    check_model_folder("DPORunConfig.reference_path", config.reference_path)
  config.check_export_target()
  check_run_mesh("DPORunConfig", config.mesh)  # (before loading any model)
  if multi_process():
    raise ValueError("DPORunConfig.prompts_path: online DPO runs in one process (not yet across "
                     "processes); run it as a single process, with a mesh of its devices.")
  check_run_folder_stage(config.run_dir, "dpo", field="DPORunConfig.run_dir")
  check_reward_models(config, stage="Online DPO")
  field = "DPORunConfig.prompts_path"
  path = check_data_path(config.prompts_path, name=field, suffixes=PROMPT_SUFFIXES,
                         formats=PROMPT_FORMATS)
  c = config.dpo
  model_config = load_config(config.model_path)
  budget = prompt_token_budget(model_config, c.sampling.max_new_tokens,
                               field="DPORunConfig.dpo.sampling.max_new_tokens",
                               fix="lower dpo.sampling.max_new_tokens")
  tokenizer = load_tokenizer(config.model_path, pad_token=config.pad_token,
                             add_pad_token=config.resize_embeddings,
                             extra_eos_ids=(*model_config.eos_token_ids,
                                            *c.sampling.stop_token_ids))
  prompts = read_prompts(
      path, tokenizer, name=field, seed=c.seed, max_tokens=budget,
      max_tokens_note=" (the policy's context minus dpo.sampling.max_new_tokens)",
      too_long_fix="shorten it or lower dpo.sampling.max_new_tokens", configurable_fields=False)
  mesh = None if config.mesh is None else make_mesh(config.mesh)
  model, reference = load_policy_and_reference(config, tokenizer, mesh)
  scorer, _ = build_scorer(config, tokenizer, dtype=DTYPES[config.dtype], mesh=mesh)
  return OnlineDPOTrainer(c, model, reward=scorer, prompts=prompts, tokenizer=tokenizer,
                          reference=reference, run_dir=config.run_dir,
                          run_options=config.run_options(), run_config=config, mesh=mesh)


ONLINE_SUMMARY = ("train/loss", "rewards/accuracies", "rewards/margins", "objective/scores",
                  "objective/scores_chosen", "objective/scores_margin", "objective/ties")
"""The last step's metrics in the summary of an online DPO run."""


def run_dpo(config: DPORunConfig) -> dict[str, Any]:
  """Trains (or resumes) the DPO run of `config`; exports the policy when the run is complete.

  Returns:
    `{"stage": "dpo", "run_dir", "step", "total_steps", "steps_run", "complete", "preempted",
    "export_dir" (None until complete), "adapter_dir" (the PEFT adapter folder once written,
    with `export_adapter_dir`), "cut_records" (records cut to max_length),
    "train/loss", "rewards/accuracies", "rewards/margins" (the last step's, when a step ran),
    "eval/loss", "eval/rewards/accuracies", "eval/rewards/margins" with a held-out split, and
    "time/reference_s" (seconds spent computing the reference's log-probs) with
    `dpo.precompute_reference`}`. Online DPO (`prompts_path`): "online": True and the last
    step's `ONLINE_SUMMARY` metrics instead of the evaluation's.
  """
  config = resolve_model_paths(config)  # a Hub id -> its cached snapshot folder
  enable_compilation_cache(config.compilation_cache_dir)  # before anything compiles
  trainer = build_dpo_trainer(config)
  online = isinstance(trainer, OnlineDPOTrainer)
  try:
    summary, finished = train_stage(
        trainer, config, stage="dpo",
        train_keys=ONLINE_SUMMARY if online else ("train/loss", "rewards/accuracies",
                                                   "rewards/margins"))
    summary["online"] = online
    if finished:
      if not online and trainer.eval_pairs is not None:
        metrics = trainer.evaluate()
        summary.update({k: metrics[k] for k in ("eval/loss", "eval/rewards/accuracies",
                                                "eval/rewards/margins")})
      summary["export_dir"] = str(trainer.export(config.export_path))
      logger.info("DPO policy written to %s.", config.export_path)
      summary["adapter_dir"] = write_adapter(
          config, trainer.model(), base_model=config.model_path, tokenizer=trainer.tokenizer)
    if not online and trainer.reference_seconds is not None:
      summary["time/reference_s"] = trainer.reference_seconds
    return summary
  finally:
    trainer.close()


__all__ = ["ONLINE_SUMMARY", "DPORunConfig", "build_dpo_trainer", "build_online_dpo_trainer",
           "load_dpo_config", "run_dpo"]
