"""Training runs from one config file: `RunConfig`, `run_training`, evaluation and export.

A run is described by a frozen `RunConfig` (`jax_ppo.runs.ppo_config`: YAML/JSON file +
`key=value` overrides, see `load_run_config`): Hugging Face folders for the policy and the reward
model (or a built-in programmatic reward), a prompts file, the `PPOConfig`, and the run folder with
its logging and checkpoint settings. `run_training(config)` builds every object and trains; running
it again on the same run folder resumes from the latest checkpoint. `evaluate_run` and `export_run`
read a run folder written by `run_training`. The command line (`jax_ppo.cli`, `jax-ppo`) is a thin
layer over these functions.

Defaults follow docs/rlhf_details.md: PAD comes from the tokenizer (distinct from EOS, item 1), the
stop tokens default to the tokenizer's and the model's EOS ids, the critic is initialised from the
reward model when there is one (item 15), else it is a zero-initialised value head on the policy.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jax_ppo.compile_cache import enable_compilation_cache
from jax_ppo.data.files import PROMPT_FORMATS, PROMPT_SUFFIXES, check_data_path, read_prompts
from jax_ppo.data.prompts import PromptDataset
from jax_ppo.models import (
  add_lora,
  check_vocab_covers,
  from_pretrained,
  has_score_head,
  load_config,
  load_scalar_model,
  load_tokenizer,
  set_remat,
  value_model_from_reward_model,
)
from jax_ppo.parallel.distributed import barrier, is_main_process, multi_process
from jax_ppo.parallel.placement import make_placement
from jax_ppo.ppo.evaluation import HeldOutEval, check_eval_sampling, evaluate_prompts
from jax_ppo.ppo.presets import check_against_guide
from jax_ppo.ppo.trainer import PPOTrainer
from jax_ppo.rewards.specs import reward_source_names
from jax_ppo.runs.common import (
  DTYPES,
  check_adapter_vocab,
  check_run_mesh,
  grow_vocab,
  resolve_model_paths,
  write_adapter,
)
from jax_ppo.runs.context import prompt_token_budget
from jax_ppo.runs.paths import check_run_paths
from jax_ppo.runs.ppo_config import RunConfig, saved_run_config
from jax_ppo.runs.run_folders import check_run_folder_stage
from jax_ppo.runs.scoring import build_scorer, check_reward_models
from jax_ppo.training.export import (
  ADAPTER_MARKER,
  MODEL_MARKER,
  check_export_target,
  export_adapter,
)

logger = logging.getLogger("jax_ppo.run")


# ---- prompts -------------------------------------------------------------------------------------


def check_prompts_file(path: str | os.PathLike, *, field: str) -> pathlib.Path:
  """The prompts file or folder as a path; FileNotFoundError/ValueError naming `field` when
  unusable (see `jax_ppo.data.files.check_data_path`)."""
  return check_data_path(path, name=field, suffixes=PROMPT_SUFFIXES, formats=PROMPT_FORMATS)


def load_prompts(
    path: str | os.PathLike,
    tokenizer: Any,
    *,
    seed: int = 0,
    field: str = "RunConfig.prompts_path",
    max_tokens: int | None = None,
    lazy: bool = False,
    too_long_fix: str = "shorten it or lower ppo.sampling.max_new_tokens",
) -> PromptDataset:
  """Reads and tokenizes prompts: a .txt file (one per line), or a .jsonl or .parquet file or a
  local `datasets` folder with "prompt" or "messages" records (`jax_ppo.data.read_prompts`).

  Args:
    path: the file (UTF-8) or folder.
    tokenizer: the policy's tokenizer (its chat template renders "messages").
    seed: shuffling seed of the dataset.
    field: how error messages name the path (the config field or the CLI flag).
    max_tokens: the longest prompt allowed (the policy's context `max_position_embeddings` minus
      `max_new_tokens`); None does not check.
    lazy: tokenize each prompt when a batch first reads it (`PromptDataset.lazy`): what each
      process of a multi-process run does, so that it tokenizes only its own rows; a prompt
      too long or empty is then reported when its batch comes.
    too_long_fix: the fix a too-long prompt's error gives (`jax-ppo eval` cannot change the
      run's `max_new_tokens`).

  Raises:
    FileNotFoundError / ValueError: naming `field`, the file, the line (or row) and the fix: no
      prompts, bytes that are not UTF-8, invalid JSON, a record without "prompt"/"messages", an
      empty prompt, or a prompt longer than `max_tokens`.
  """
  return read_prompts(
      check_prompts_file(path, field=field), tokenizer, name=field, seed=seed,
      max_tokens=max_tokens,
      max_tokens_note=" (the policy's context minus ppo.sampling.max_new_tokens)",
      too_long_fix=too_long_fix, configurable_fields=False, lazy=lazy)


def _check_folder(field: str, path: str | None) -> None:
  if path is not None and not os.path.isfile(os.path.join(path, "config.json")):
    raise FileNotFoundError(
        f"RunConfig.{field}={path!r}: no Hugging Face model folder there (config.json is "
        "missing); give a local folder written by save_pretrained."
    )


def check_scalar_heads(config: RunConfig, *, critic: bool = True) -> None:
  """Before any weights load: every reward model of `config` holds a trained scalar head, and so
  does the value model unless `value_model_new_head` says a new head is meant.

  A folder without `score.weight` is a causal-LM checkpoint (e.g. the SFT export):
  `load_scalar_model` would give it a new, random head, so PPO would train against random scores
  (a reward model: always refused) or start the critic from an untrained head (a value model:
  allowed with `RunConfig.value_model_new_head=true`, e.g. a critic from the SFT policy).

  Args:
    config: the run.
    critic: also check `value_model_path` (when the run has a critic); False for a run folder
      that is only evaluated or exported (its critic comes from the checkpoint).

  Raises:
    FileNotFoundError: a reward model path that is not a model folder (no config.json).
    ValueError: one line naming the field, the path and the fix.
  """
  check_reward_models(config, stage="PPO")
  path = config.value_model_path
  if (critic and config.ppo.uses_critic and path is not None and not config.value_model_new_head
      and not has_score_head(path)):
    raise ValueError(
        f"RunConfig.value_model_path={path!r} is a causal-LM checkpoint without a score head (its "
        "safetensors hold no score.weight); set value_model_new_head=true to start the critic "
        "from its trunk with a new value head (e.g. from the SFT policy), or give a value or "
        "reward model (a folder with score.weight).")


def policy_tokenizer(config: RunConfig) -> Any:
  """The policy's tokenizer as the run uses it (its pad token, PAD never a stop id: neither the
  tokenizer's EOS, the model's nor a configured one); reads no weights."""
  policy_eos = load_config(config.policy_path).eos_token_ids
  return load_tokenizer(
      config.policy_path, pad_token=config.pad_token, add_pad_token=config.resize_embeddings,
      extra_eos_ids=(*policy_eos, *config.ppo.sampling.stop_token_ids),
  )


# ---- building and running ------------------------------------------------------------------------


def build_trainer(
    config: RunConfig, *, open_run: bool = True, prompts: PromptDataset | None = None
) -> PPOTrainer:
  """Loads the models, tokenizer and prompts of `config` and builds the trainer.

  Before any weights load: the run folder is not another stage's (`jax_ppo.runs.run_folders`),
  the reward and value models hold a scalar head (`check_scalar_heads`), and the prompts (and
  the held-out prompts of `eval_path`) fit the policy's context with
  `ppo.sampling.max_new_tokens` (`jax_ppo.runs.context`).

  Args:
    config: the run.
    open_run: attach `config.run_dir` (logs, checkpoints, resume) and the evaluation of
      `config.eval_path` during training; False builds a bare trainer (for evaluation or export,
      which restore with `load_checkpoint`).
    prompts: use these prompts instead of reading `config.prompts_path`.
  """
  config = resolve_model_paths(config)  # a Hub id -> its cached snapshot folder
  for field in ("policy_path", "reward_model_path", "value_model_path", "reference_path"):
    _check_folder(field, getattr(config, field))
  if open_run:
    check_run_folder_stage(config.run_dir, "ppo", field="RunConfig.run_dir")
    config.check_adapter_export_target()
  check_scalar_heads(config, critic=open_run)
  if prompts is None:
    check_prompts_file(config.prompts_path, field="RunConfig.prompts_path")
  if open_run and config.eval_path is not None:
    check_prompts_file(config.eval_path, field="RunConfig.eval_path")
  dtype = DTYPES[config.dtype]
  check_run_mesh("RunConfig", config.mesh)  # (before loading any model)
  p = config.placement
  if multi_process() and (p.split_roles or p.policy_devices is not None):
    raise ValueError(
        "RunConfig.placement: roles on sub-meshes of their own are single-process only (not yet "
        "run across processes); in a multi-process job leave placement.policy_devices, "
        "placement.reference, placement.reward and placement.critic unset, so every role shares "
        "RunConfig.mesh.")
  placement = None if config.mesh is None else make_placement(config.placement, config.mesh)
  mesh = None if placement is None else placement.policy
  reward_mesh = None if placement is None else placement.reward  # reward models load there
  tokenizer = policy_tokenizer(config)
  # (before any weights load: a prompt too long for the context is refused)
  read_eval = open_run and config.eval_path is not None
  if prompts is None or read_eval:
    budget = prompt_token_budget(load_config(config.policy_path),
                                 config.ppo.sampling.max_new_tokens)
  if prompts is None:
    prompts = load_prompts(config.prompts_path, tokenizer, seed=config.ppo.seed,
                           max_tokens=budget,
                           lazy=multi_process())  # (several processes: each its own rows)
  evaluation = None
  if read_eval:  # (every process reads every held-out prompt)
    evaluation = HeldOutEval(
        prompts=load_prompts(config.eval_path, tokenizer, field="RunConfig.eval_path",
                             max_tokens=budget).prompts,
        every=config.eval_every, n=config.eval_n, temperature=config.eval_temperature,
        seed=config.eval_seed)
  policy = from_pretrained(config.policy_path, dtype=dtype, param_dtype=jnp.float32,
                           remat=config.remat, mesh=mesh)
  grow_vocab(policy, len(tokenizer), resize=config.resize_embeddings, what="policy")
  check_vocab_covers(tokenizer, policy.config)
  if open_run:
    check_adapter_vocab(config, policy, config.policy_path, field="RunConfig.policy_path")
  if config.lora is not None:
    add_lora(policy, config.lora, rngs=nnx.Rngs(config.ppo.seed))
  reference = None
  if config.reference_path is not None:  # loaded like the policy (the trainer places it)
    reference = from_pretrained(config.reference_path, dtype=dtype, param_dtype=jnp.float32,
                                mesh=None if placement is None else placement.reference)
    grow_vocab(reference, len(tokenizer), resize=config.resize_embeddings, what="reference")
  stop_ids = config.ppo.sampling.stop_token_ids or tuple(dict.fromkeys(
      i for i in (tokenizer.eos_token_id, *policy.config.eos_token_ids)
      if i is not None and i != tokenizer.pad_token_id
  ))
  outside = [i for i in stop_ids if not 0 <= i < policy.config.vocab_size]
  if outside:
    raise ValueError(
        f"RunConfig.ppo.sampling.stop_token_ids={tuple(stop_ids)}: id(s) {outside} are outside "
        f"the policy's vocabulary of {policy.config.vocab_size} tokens; give ids of its tokenizer."
    )
  ppo = dataclasses.replace(config.ppo, sampling=dataclasses.replace(
      config.ppo.sampling, pad_token_id=tokenizer.pad_token_id, stop_token_ids=tuple(stop_ids)))

  value_model = None
  # (first_model: the (reward model, scorer) of the first reward model, the critic's start)
  scorer, first_model = build_scorer(config, tokenizer, dtype=dtype, mesh=reward_mesh)
  if first_model is not None and ppo.uses_critic and config.value_model_path is None:
    reward_model, rm_scorer = first_model
    if rm_scorer.retokenize:
      logger.warning("The reward model has its own tokenizer, so the critic cannot start as "
                     "its copy; using a value head on the policy (or set value_model_path).")
    else:
      value_model = value_model_from_reward_model(reward_model)
  if config.value_model_path is not None:
    if ppo.uses_critic:
      if config.value_model_new_head and has_score_head(config.value_model_path):
        logger.info("value_model_new_head: the score head of %s is replaced by a new one.",
                    config.value_model_path)
      value_model = load_scalar_model(config.value_model_path, dtype=dtype,
                                      param_dtype=jnp.float32,
                                      head_init="reward" if config.value_model_new_head else None,
                                      mesh=None if placement is None else placement.critic)
      grow_vocab(value_model, len(tokenizer), resize=config.resize_embeddings, what="value model")
      check_vocab_covers(tokenizer, value_model.config)
    else:
      logger.warning("value_model_path is ignored: advantage_mode=%r has no critic.",
                     ppo.advantage_mode)
  if value_model is not None:  # the critic trains too: same remat as the policy
    set_remat(value_model, config.remat)
  return PPOTrainer(
      ppo, policy, reward=scorer, prompts=prompts, tokenizer=tokenizer, value_model=value_model,
      reference=reference, reference_field="RunConfig.reference_path",
      run_dir=config.run_dir if open_run else None, run_options=config.run_options(),
      monitor=config.monitor, evaluation=evaluation,
      run_config=config, mesh=mesh, placement=placement,
  )


def guide_advice(config: RunConfig) -> list[str]:
  """Checks `config.ppo` against the hyperparameter guide and logs each piece of advice.

  Runs at the start of `run_training` (docs: `jax_ppo.ppo.presets.check_against_guide`);
  advice is a warning, never an error: out-of-range values may be deliberate.

  Returns:
    The advice lines (empty when every value is in its recommended range).
  """
  advice = check_against_guide(config.ppo, lora=config.lora is not None)
  for line in advice:
    logger.warning("Hyperparameter guide: %s", line)
  if advice:
    logger.warning("Hyperparameter guide: %d value(s) outside the recommended ranges (see "
                   "jax_ppo.ppo.presets.format_guide()); training goes on.", len(advice))
  return advice


def run_training(config: RunConfig) -> list[dict[str, float]]:
  """Trains (or resumes) the run described by `config`; returns the metrics of each update.

  Runs `config.run.updates_per_run` updates (default: to `ppo.total_updates`), checkpointing into
  `config.run_dir`; calling it again with the same configuration continues the run. SIGTERM or
  SIGINT during training saves a checkpoint and returns early: the returned history's
  `preempted` then names the signal (see `jax_ppo.training.loop`). With
  `config.export_adapter_dir`, an invocation that ends with the run complete (not preempted)
  writes the policy's LoRA adapters there as a PEFT adapter folder (`write_adapter`).
  """
  config = resolve_model_paths(config)  # a Hub id -> its cached snapshot folder
  enable_compilation_cache(config.compilation_cache_dir)  # before anything compiles
  guide_advice(config)
  trainer = build_trainer(config)
  try:
    if trainer.step_count >= config.ppo.total_updates:
      logger.info("%s is complete (step %d of %d); nothing to do.", config.run_dir,
                  trainer.step_count, config.ppo.total_updates)
    history = trainer.train(config.run.updates_per_run)
    if (trainer.step_count >= config.ppo.total_updates
        and not getattr(history, "preempted", None)):
      write_adapter(config, trainer.policy_model(), base_model=config.policy_path,
                    tokenizer=trainer.tokenizer)
    return history
  finally:
    trainer.close()


def _bare_trainer(config: RunConfig) -> PPOTrainer:
  # The dataset is never used (no training): the training prompts file need not exist anymore.
  return build_trainer(config, open_run=False, prompts=PromptDataset([[0]]))


def evaluate_run(
    run_dir: str | os.PathLike,
    prompts_path: str | os.PathLike,
    *,
    temperature: float | None = None,
    n: int = 1,
    step: int | None = None,
    seed: int = 0,
    out: str | os.PathLike | None = None,
) -> dict[str, Any]:
  """Samples and scores held-out prompts with a checkpoint of a run (item 20).

  Every prompt is sampled `n` times (`jax_ppo.ppo.evaluation.evaluate_prompts`, which also
  logs these metrics during training with `RunConfig.eval_path`). The metrics (`eval/...`, see
  `jax_ppo.ppo.eval_metrics`) are: `score_mean` and `score_std` over all samples, `best_of_n`
  (the best of each prompt's `n` scores, averaged over prompts; equal to `score_mean` when `n`
  is 1), `kl` (sum over response tokens of log pi - log pi_ref, mean over samples), `entropy`,
  `response_length` (tokens), `distinct_1` and `distinct_2` (unique / all word n-grams over all
  responses),
  `repetition_rate` (fraction of a response's word bigrams that repeat one in it, mean) and `n`;
  with `RunConfig.rewards`, also `reward/<name>`, each source's mean raw score (and each sample's
  raw scores under "rewards").

  Args:
    run_dir: the run folder.
    prompts_path: held-out prompts (.txt or .jsonl, as `RunConfig.prompts_path`).
    temperature: None samples greedily (then `n` must be 1: greedy samples are identical).
    n: samples per prompt for best-of-n.
    step: the checkpoint; None uses the latest.
    seed: sampling seed (temperature > 0).
    out: JSON file written; default `run_dir/eval/step_<step>.json`. A path that is or lies
      inside one the run read (its models, the prompts) is refused (`jax_ppo.runs.paths`).

  Returns:
    `{"run_dir", "step", "prompts_path", "greedy", "temperature", "n", "reward", "metrics",
    "samples", "out"}` (also the content of `out`, without "out"); each sample is
    `{prompt_index, prompt, response, reward, length, kl}`.

  Several processes (called by every process of a job that joined `jax.distributed`): every
  process samples and scores, each gathering the scores and samples; process 0 writes `out`.
  """
  check_eval_sampling(n, temperature, n_field="--n", temperature_field="--temperature")
  check_run_folder_stage(run_dir, "ppo", field="--run-dir", verb="jax-ppo eval")
  config = resolve_model_paths(saved_run_config(run_dir))
  check_prompts_file(prompts_path, field="--prompts")
  if out is not None:  # (the default, run_dir/eval/step_N.json, is the run's own)
    check_run_paths(inputs=[("--prompts", prompts_path), *config.read_paths()],
                    run_dirs=[("--out", out)])
  # Before any weights load: the prompts fit the policy's context with the run's response limit.
  budget = prompt_token_budget(
      load_config(config.policy_path), config.ppo.sampling.max_new_tokens,
      fix=f"the run in {str(run_dir)!r} was trained with it, so give RunConfig.policy_path's "
          "config.json back the context it had")
  prompts = load_prompts(prompts_path, policy_tokenizer(config), field="--prompts",
                         max_tokens=budget,
                         too_long_fix="shorten it (the run's ppo.sampling.max_new_tokens is "
                                      "fixed by its training)")
  trainer = _bare_trainer(config)
  step = trainer.load_checkpoint(run_dir, step=step)
  metrics, samples = evaluate_prompts(trainer, prompts.prompts, n=n, temperature=temperature,
                                      seed=seed)
  if config.rewards:
    reward = [{"name": name, "weight": r.weight, "source": r.function or r.model_path}
              for name, r in zip(reward_source_names(config.rewards), config.rewards, strict=True)]
  else:
    reward = config.reward_model_path or config.reward_function
  result = {
      "run_dir": str(run_dir), "step": step, "prompts_path": str(prompts_path),
      "greedy": temperature is None, "temperature": temperature, "n": n, "reward": reward,
      "metrics": metrics, "samples": samples,
  }
  out = pathlib.Path(out) if out is not None else pathlib.Path(run_dir) / "eval" / (
      f"step_{step}.json")
  if is_main_process():  # (several processes: every one evaluated; process 0 writes)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
  barrier(f"evaluate_run {out}")
  return {**result, "out": str(out)}


def export_run(
    run_dir: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None, dtype=None,
    adapter: bool = False,
) -> tuple[pathlib.Path, int]:
  """Writes a checkpoint's policy (LoRA merged, no value head) and tokenizer as a HF folder; with
  `adapter`, the policy's LoRA adapters and the tokenizer as a PEFT adapter folder instead
  (`jax_ppo.training.export.export_adapter`, loadable by `peft.PeftModel.from_pretrained` on the
  run's starting policy).

  The export is atomic and replaces an earlier export of its kind at `out`
  (`jax_ppo.training.export`); `out` that is, contains or lies inside a path the run read (its
  policy, reward or value model, prompts), or that is or contains `run_dir`, is refused before
  anything loads (`jax_ppo.runs.paths`), as is a non-empty `out` folder that holds no model (no
  adapter). With `adapter`, a run without LoRA is refused before anything loads, and one whose
  vocabulary grew (`resize_embeddings`) once the policy is built. Several processes: every
  process calls it; process 0 writes (`PPOTrainer.export`).

  Returns:
    `(folder, step)`.
  """
  check_run_folder_stage(run_dir, "ppo", field="--run-dir", verb="jax-ppo export")
  config = resolve_model_paths(saved_run_config(run_dir))
  if adapter and config.lora is None:
    raise ValueError(f"--adapter: the run in {str(run_dir)!r} trained no LoRA adapters "
                     "(RunConfig.lora is null); export the merged model without --adapter.")
  check_run_paths(inputs=config.read_paths(), run_dirs=[("--run-dir", run_dir)],
                  exports=[("--out", out)])
  check_export_target(out, field="--out", marker=ADAPTER_MARKER if adapter else MODEL_MARKER)
  trainer = _bare_trainer(config)
  step = trainer.load_checkpoint(run_dir, step=step)
  if not adapter:
    return trainer.export(out, dtype=dtype), step
  policy, base = trainer.policy_model(), load_config(config.policy_path).vocab_size
  if policy.config.vocab_size != base:
    raise ValueError(
        f"--adapter: the run grew the vocabulary of RunConfig.policy_path={config.policy_path!r} "
        f"from {base} to {policy.config.vocab_size} ids (resize_embeddings), and a PEFT adapter "
        "holds only the LoRA matrices, not the new embedding rows; export the merged model "
        "without --adapter.")
  return export_adapter(policy, out, base_model=config.policy_path, tokenizer=trainer.tokenizer,
                        dtype=dtype, field="--out"), step


__all__ = [
    "build_trainer",
    "check_prompts_file",
    "check_scalar_heads",
    "evaluate_run",
    "export_run",
    "guide_advice",
    "load_prompts",
    "policy_tokenizer",
    "run_training",
]
