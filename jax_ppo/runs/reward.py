"""Reward-model runs from one config file: `RewardRunConfig` and `run_reward` (`jax-ppo reward`).

The second RLHF stage on a user's own checkpoint: a local Hugging Face folder to start from
(usually the SFT stage's export: its trunk with a new score head, `load_scalar_model`), a file of
preference records (prompt, chosen, rejected, optional margin) and a `RewardModelConfig`.
`run_reward(config)` trains with `RewardModelTrainer` in `config.run_dir`; when the run is
complete it evaluates the held-out accuracy, sets the reward normalisation from samples of the SFT
policy (docs/rlhf_details.md item 16: gain and bias so that those samples score with mean 0 and
std 1) and writes a one-label `*ForSequenceClassification` folder to `config.export_path`, which
`RunConfig.reward_model_path` of the PPO stage reads. Running it again resumes.

Example config (YAML)::

  model_path: runs/sft/hf_model
  train_path: data/preferences.jsonl   # {"prompt": ..., "chosen": ..., "rejected": ...}
                                       # (text or chats: jax_ppo.data.preferences)
  run_dir: runs/reward
  reward: {batch_size: 16, num_epochs: 1, eval_fraction: 0.05, optimizer: {learning_rate: 1.0e-5}}

With `mesh` (e.g. `mesh.fsdp=-1`) the reward model is read straight into its shards and trains
on the mesh, and the normalisation's policy samples are drawn on the same mesh; a multi-process
job (`distributed`) needs a mesh over every process's devices. A run folder written before the
optimizer block existed (flat `reward.learning_rate`, ...) resumes: `jax_ppo.config_io.
migrate_keys` moves its keys (`RewardModelConfig.MOVED_KEYS`) when the saved config is compared.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_ppo.compile_cache import enable_compilation_cache
from jax_ppo.data.records import Record, preference_record, prompt_record
from jax_ppo.models import (
  add_lora,
  check_vocab_covers,
  encode_chat,
  from_pretrained,
  load_config,
  load_scalar_model,
  load_tokenizer,
  resize_token_embeddings,
)
from jax_ppo.parallel import host_rows
from jax_ppo.parallel.mesh import make_mesh
from jax_ppo.reward_model.config import RewardModelConfig
from jax_ppo.reward_model.trainer import RewardModelTrainer
from jax_ppo.rollout.config import SamplingConfig
from jax_ppo.rollout.sampler import Sampler
from jax_ppo.runs.common import (
  DTYPES,
  STAGE_OPERATIONAL_FIELDS,
  Records,
  StageRunConfig,
  check_model_folder,
  check_records_file,
  check_run_mesh,
  grow_vocab,
  load_stage_config,
  read_records,
  resolve_model_paths,
  train_stage,
)
from jax_ppo.runs.context import check_fits_context, prompt_token_budget
from jax_ppo.runs.paths import PathField
from jax_ppo.runs.run_folders import check_run_folder_stage

logger = logging.getLogger("jax_ppo.reward_run")

NORMALISATION_FIELDS = ("normalise", "policy_path", "normalise_prompts_path", "normalise_samples",
                        "normalise_max_new_tokens", "normalise_temperature")
"""Fields that only change the normalisation applied at export, not the trained checkpoints: they
may change between invocations of one run."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardRunConfig(StageRunConfig):
  """Everything `run_reward` needs; saved as `run_dir/config.yaml`. The record field names are
  `reward.prompt_field`, `reward.chosen_field`, `reward.rejected_field`, `reward.margin_field`."""

  reward: RewardModelConfig = dataclasses.field(default_factory=RewardModelConfig)
  """Reward-model hyperparameters (`jax_ppo.reward_model.config.RewardModelConfig`; its
  optimizer block is `reward.optimizer`)."""
  normalise: bool = True
  """Set the reward normalisation from samples of the SFT policy before exporting."""
  policy_path: str | None = None
  """Causal-LM folder (or cached Hub id `org/name`) whose samples set the normalisation; None:
  `model_path` (the SFT model the reward model starts from)."""
  normalise_prompts_path: str | None = None
  """Prompts sampled for the normalisation (.jsonl records with the prompt field, or .json);
  None: the prompts of `train_path`."""
  normalise_samples: int = 64
  """Prompts sampled (one response each) for the normalisation; fewer when there are fewer."""
  normalise_max_new_tokens: int = 48
  """Response length limit of those samples (use PPO's `ppo.sampling.max_new_tokens`)."""
  normalise_temperature: float = 1.0
  """Sampling temperature of those samples (use PPO's `ppo.sampling.temperature`)."""

  OPERATIONAL_FIELDS: ClassVar[tuple[str, ...]] = (*STAGE_OPERATIONAL_FIELDS,
                                                   *NORMALISATION_FIELDS)
  """The stage's operational fields and the normalisation settings: they may change on
  resume."""

  def __post_init__(self):
    super().__post_init__()

    def bad(field: str, fix: str):
      raise ValueError(f"RewardRunConfig.{field}={getattr(self, field)!r} is invalid: {fix}.")

    if not isinstance(self.reward, RewardModelConfig):
      raise ValueError(f"RewardRunConfig.reward must be a RewardModelConfig, got "
                       f"{type(self.reward).__name__}.")
    if not isinstance(self.normalise, bool):
      bad("normalise", "use true or false")
    if self.export_adapter_dir is not None:
      bad("export_adapter_dir", "a reward model's trained score head (and normalisation) is no "
                                "LoRA weight, so a PEFT adapter cannot carry it; remove "
                                "export_adapter_dir (export_dir holds the whole reward model)")
    for field in ("policy_path", "normalise_prompts_path"):
      value = getattr(self, field)
      if value is not None and (not isinstance(value, str) or not value):
        bad(field, "give a path, or null")
    for field in ("normalise_samples", "normalise_max_new_tokens"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        bad(field, "use an int >= 1")
    if not (isinstance(self.normalise_temperature, int | float)
            and self.normalise_temperature > 0):
      bad("normalise_temperature", "use a value > 0")

  def read_paths(self, prefix: str | None = None) -> list[PathField]:
    """The stage's paths (`StageRunConfig.read_paths`) and the normalisation's policy and
    prompts."""
    prefix = prefix or type(self).__name__
    return [*super().read_paths(prefix),
            *[(f"{prefix}.{f}", getattr(self, f))
              for f in ("policy_path", "normalise_prompts_path")]]


def load_reward_config(argv: Sequence[str]) -> RewardRunConfig:
  """A `RewardRunConfig` from at most one YAML/JSON file and `key=value` overrides."""
  return load_stage_config(RewardRunConfig, argv)


def _prompts(config: RewardRunConfig, train: Records) -> list[Any]:
  """Distinct prompts (strings or chats) for the normalisation samples, in file order."""
  c = config.reward
  if config.normalise_prompts_path is None:
    # A conversational record without a prompt chat: the turns its two conversations share.
    fields = (c.prompt_field, c.chosen_field, c.rejected_field)
    prompts = [preference_record(Record(place, r), fields, c.margin_field)["prompt"]
               for place, r in zip(train.places, train, strict=True)]
  else:
    records = read_records(config.normalise_prompts_path,
                           field="RewardRunConfig.normalise_prompts_path",
                           check=lambda r: prompt_record(r, c.prompt_field, option=False))
    # {"prompt": text} or {"messages": chat}: the prompt either way.
    prompts = [next(iter(prompt_record(Record(place, r), c.prompt_field, option=False).values()))
               for place, r in zip(records.places, records, strict=True)]
  distinct = {json.dumps(p, sort_keys=True): p for p in prompts}
  return list(distinct.values())[:config.normalise_samples]


def policy_samples(
    config: RewardRunConfig, prompts: list[Any], *, seed: int, reward_tokenizer: Any = None,
    mesh: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
  """Prompt + sampled response ids and attention mask `[N, S]` for the normalisation: one
  response per prompt from the policy (`policy_path`, default `model_path`), with the sampling
  settings of PPO (`normalise_max_new_tokens`, `normalise_temperature`).

  When the policy's tokenizer is the reward model's (`reward_tokenizer`; the usual case, both
  coming from the SFT folder), the sequences are the policy's own ids, left-padded prompt and
  response with its stop token (or cut at the length limit), exactly what PPO's
  `RewardModelScorer` scores. Otherwise the texts are re-tokenized by `reward_tokenizer`.

  With a `mesh` (the reward model's) the policy is read straight into its shards and sampled
  there (`Sampler(..., mesh=mesh)`); every process gets all `N` rows.
  """
  config = resolve_model_paths(config)
  path = config.policy_path or config.model_path
  check_model_folder("RewardRunConfig.policy_path" if config.policy_path else
                     "RewardRunConfig.model_path", path)
  eos = load_config(path).eos_token_ids
  tokenizer = load_tokenizer(path, pad_token=config.pad_token,
                             add_pad_token=config.resize_embeddings, extra_eos_ids=eos)
  policy = from_pretrained(path, dtype=DTYPES[config.dtype], param_dtype=jnp.float32, mesh=mesh)
  if config.resize_embeddings and len(tokenizer) > policy.config.vocab_size:
    resize_token_embeddings(policy, len(tokenizer))
  check_vocab_covers(tokenizer, policy.config)
  stop = tuple(dict.fromkeys(i for i in (tokenizer.eos_token_id, *eos)
                             if i is not None and i != tokenizer.pad_token_id))
  ids = [encode_chat(tokenizer, [p])[0] if isinstance(p, list) else
         list(tokenizer(p)["input_ids"]) for p in prompts]
  sampler = Sampler(policy, SamplingConfig(
      max_new_tokens=config.normalise_max_new_tokens, temperature=config.normalise_temperature,
      stop_token_ids=stop, pad_token_id=tokenizer.pad_token_id, truncate_prompts=True),
      mesh=mesh)
  # On a mesh a raw uint32 key (the same bits): JAX places an uncommitted raw key onto other
  # processes' devices (checking that every process passed the same), not a typed key.
  key = jax.random.key(seed) if mesh is None else jax.random.PRNGKey(seed)
  rollout = sampler(ids, key)
  if reward_tokenizer is None or tokenizer.get_vocab() == reward_tokenizer.get_vocab():
    return host_rows.gathered(rollout.sequence_ids), host_rows.gathered(rollout.attention_mask)
  rows = []
  for p_ids, p_mask, r_ids, r_mask in zip(
      *map(host_rows.gathered, (rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids,
                                rollout.response_mask)), strict=True):
    text = tokenizer.decode(np.concatenate([p_ids[p_mask > 0], r_ids[r_mask]]).tolist(),
                            skip_special_tokens=True)
    rows.append(list(reward_tokenizer(text)["input_ids"]) or [reward_tokenizer.pad_token_id])
  length = max(len(r) for r in rows)
  out_ids = np.full((len(rows), length), reward_tokenizer.pad_token_id or 0, np.int32)
  out_mask = np.zeros((len(rows), length), np.int32)
  for i, row in enumerate(rows):
    out_ids[i, :len(row)], out_mask[i, :len(row)] = row, 1
  return out_ids, out_mask


def build_reward_trainer(config: RewardRunConfig) -> RewardModelTrainer:
  """Loads the model (a new score head on a causal-LM folder, or a reward model's own head),
  tokenizer and records of `config` and builds the trainer (resuming from the run folder).

  Before any weights load, `run_dir` must not be another stage's run folder
  (`jax_ppo.runs.run_folders`), `reward.max_length` must fit the model's context and, with
  `normalise`, `normalise_max_new_tokens` must leave room for a prompt in the policy's
  (`max_position_embeddings`, `jax_ppo.runs.context`): one ValueError naming the field.
  """
  config = resolve_model_paths(config)  # a Hub id -> its cached snapshot folder
  check_model_folder("RewardRunConfig.model_path", config.model_path)
  check_run_folder_stage(config.run_dir, "reward", field="RewardRunConfig.run_dir")
  config.check_export_target()
  check_run_mesh("RewardRunConfig", config.mesh)  # (before loading any model)
  mesh = None if config.mesh is None else make_mesh(config.mesh)
  c = config.reward
  for field in ("train_path", "eval_path", "normalise_prompts_path"):
    if getattr(config, field) is not None:
      check_records_file(getattr(config, field), field=f"RewardRunConfig.{field}")

  def check(record: Record) -> None:  # (the trainer's checks, before any weights load)
    preference_record(record, (c.prompt_field, c.chosen_field, c.rejected_field),
                      c.margin_field, prefix="reward.")

  train = read_records(config.train_path, field="RewardRunConfig.train_path", check=check)
  evaluation = None if config.eval_path is None else read_records(
      config.eval_path, field="RewardRunConfig.eval_path", check=check)
  model_config = load_config(config.model_path)
  check_fits_context("RewardRunConfig.reward.max_length", c.max_length, model_config,
                     model_field="RewardRunConfig.model_path", model_path=config.model_path)
  if config.normalise:
    policy_field = "policy_path" if config.policy_path else "model_path"
    check_model_folder(f"RewardRunConfig.{policy_field}", config.policy_path or config.model_path)
    prompt_token_budget(load_config(config.policy_path or config.model_path),
                        config.normalise_max_new_tokens,
                        field="RewardRunConfig.normalise_max_new_tokens",
                        fix="lower normalise_max_new_tokens")
  eos = model_config.eos_token_ids
  tokenizer = load_tokenizer(config.model_path, pad_token=config.pad_token,
                             add_pad_token=config.resize_embeddings, extra_eos_ids=eos)
  model = load_scalar_model(config.model_path, seed=c.seed, dtype=DTYPES[config.dtype],
                            param_dtype=jnp.float32, mesh=mesh)
  grow_vocab(model, len(tokenizer), resize=config.resize_embeddings, what="reward model")
  check_vocab_covers(tokenizer, model.config)
  if config.lora is not None:
    add_lora(model, config.lora, rngs=nnx.Rngs(c.seed))
  trainer = RewardModelTrainer(c, model, train_data=train, eval_data=evaluation,
                               tokenizer=tokenizer, run_dir=config.run_dir,
                               run_options=config.run_options(), run_config=config, mesh=mesh)
  trainer.train_records = train
  return trainer


def run_reward(config: RewardRunConfig) -> dict[str, Any]:
  """Trains (or resumes) the reward-model run of `config`; when it is complete, normalises
  (`config.normalise`) and exports the model.

  Returns:
    `{"stage": "reward", "run_dir", "step", "total_steps", "steps_run", "complete",
    "preempted", "export_dir" (None until complete), "cut_records" (records cut to
    max_length), "train/loss", "train/accuracy" (the last step's, when a step ran),
    "eval/accuracy" and "eval/loss" (with a held-out split), and
    "normalisation" ({gain, bias, mean, std, samples}, when normalised)}`.
  """
  config = resolve_model_paths(config)  # a Hub id -> its cached snapshot folder
  enable_compilation_cache(config.compilation_cache_dir)  # before anything compiles
  trainer = build_reward_trainer(config)
  try:
    summary, finished = train_stage(trainer, config, stage="reward",
                                    train_keys=("train/loss", "train/accuracy"))
    if finished:
      if trainer.eval_pairs is not None:
        metrics = trainer.evaluate()
        summary.update({k: metrics[k] for k in ("eval/loss", "eval/accuracy")})
      if config.normalise:
        ids, mask = policy_samples(config, _prompts(config, trainer.train_records),
                                   seed=config.reward.seed, reward_tokenizer=trainer.tokenizer,
                                   mesh=trainer.mesh)
        summary["normalisation"] = trainer.normalise(input_ids=ids, attention_mask=mask)
      summary["export_dir"] = str(trainer.export(config.export_path))
      logger.info("Reward model written to %s.", config.export_path)
    return summary
  finally:
    trainer.close()


__all__ = [
    "NORMALISATION_FIELDS",
    "RewardRunConfig",
    "build_reward_trainer",
    "load_reward_config",
    "policy_samples",
    "run_reward",
]
