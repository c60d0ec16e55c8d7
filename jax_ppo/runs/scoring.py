"""The reward source of a run config, shared by the runs that score sampled responses: PPO
(`RunConfig`) and online DPO (`DPORunConfig` with `prompts_path`).

A run names exactly one of `reward_model_path` (a one-label `*ForSequenceClassification`
folder), `reward_function` (a built-in or `package.module:function`,
`jax_ppo.rewards.specs`) and `rewards` (weighted `RewardSource`s). `check_reward_source`
validates those fields when the config is built, `check_reward_models` checks the reward-model
folders before any weights load, and `build_scorer` loads the models and builds the scorer
(`jax_ppo.rewards.scorers`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from jax_ppo.models import check_vocab_covers, has_score_head, load_scalar_model, load_tokenizer
from jax_ppo.rewards.scorers import CombinedScorer, RewardModelScorer
from jax_ppo.rewards.specs import (
  MODULE_REWARD,
  REWARD_FUNCTIONS,
  RewardSource,
  parse_reward_function,
  reward_function,
  reward_source_names,
)
from jax_ppo.runs.common import grow_vocab


def reward_given(config: Any) -> bool:
  """Whether any reward field of `config` is set."""
  return (config.reward_model_path is not None or config.reward_function is not None
          or bool(config.rewards))


def check_reward_source(config: Any) -> None:
  """Exactly one of `config`'s `reward_model_path`, `reward_function` and `rewards` is set, and
  it is well formed (a known or importable-looking function spec, `RewardSource`s with unique
  names); one ValueError naming the config class and the fields otherwise."""
  name = type(config).__name__
  given = [config.reward_model_path is not None, config.reward_function is not None,
           bool(config.rewards)]
  if sum(given) != 1:
    raise ValueError(
        f"{name} needs exactly one reward source: reward_model_path (a Hugging Face "
        "SequenceClassification folder), reward_function (one of "
        f"{', '.join(REWARD_FUNCTIONS)}, or {MODULE_REWARD}), or rewards (a list of "
        "{function or model_path, weight} sources); got "
        f"reward_model_path={config.reward_model_path!r}, "
        f"reward_function={config.reward_function!r}, rewards={list(config.rewards)!r}."
    )
  if not all(isinstance(r, RewardSource) for r in config.rewards):
    raise ValueError(f"{name}.rewards={config.rewards!r} is invalid: give a list of {{function "
                     "or model_path, weight, name}} mappings.")
  reward_source_names(config.rewards)
  if config.reward_function is not None:
    parse_reward_function(config.reward_function)
  if config.reward_model_path is not None and (not isinstance(config.reward_model_path, str)
                                               or not config.reward_model_path):
    raise ValueError(f"{name}.reward_model_path={config.reward_model_path!r} is invalid: give "
                     "a path.")


def reward_model_fields(config: Any) -> list[tuple[str, str]]:
  """`(field, path)` of every reward model of `config` (`reward_model_path`,
  `rewards[i].model_path`), fields without the class name."""
  models = [] if config.reward_model_path is None else [("reward_model_path",
                                                         config.reward_model_path)]
  return models + [(f"rewards[{i}].model_path", r.model_path)
                   for i, r in enumerate(config.rewards) if r.model_path is not None]


def check_reward_models(config: Any, *, stage: str) -> None:
  """Before any weights load: every reward model of `config` is a model folder with a trained
  scalar head (`score.weight`). A causal-LM checkpoint (e.g. the SFT export) would get a new,
  random head, and the run would train against random scores. `stage` names the run in the
  message ("PPO", "Online DPO").

  Raises:
    FileNotFoundError: a reward-model path that is not a model folder (no config.json).
    ValueError: one line naming the field, the path and the fix.
  """
  name = type(config).__name__
  for field, path in reward_model_fields(config):
    if not os.path.isfile(os.path.join(path, "config.json")):
      raise FileNotFoundError(
          f"{name}.{field}={path!r}: no Hugging Face model folder there (config.json is "
          "missing); give a local folder written by save_pretrained."
      )
    if not has_score_head(path):
      raise ValueError(
          f"{name}.{field}={path!r} is a causal-LM checkpoint without a score head (its "
          f"safetensors hold no score.weight): {stage} would train against the random scores of "
          "a new head; give a reward model (the export_dir of `jax-ppo reward`, or a one-label "
          "*ForSequenceClassification folder).")


def _has_tokenizer(path: str) -> bool:
  return any(os.path.exists(os.path.join(path, f))
             for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))


def reward_model_scorer(path: str, tokenizer: Any, *, dtype: Any, resize_embeddings: bool,
                        mesh: Any = None) -> tuple[Any, RewardModelScorer]:
  """Loads the reward model in `path` (and its tokenizer, when it has one) and its scorer;
  with a `mesh` its weights are read straight into their shards.

  Args:
    path: the reward model's folder.
    tokenizer: the policy's tokenizer (the scorer re-tokenizes when the reward model's own
      differs).
    dtype: the compute dtype.
    resize_embeddings: grow the reward model's vocabulary to its tokenizer's (a new pad token).
    mesh: load the weights into their shards on this mesh (None: one device).
  """
  reward_model = load_scalar_model(path, dtype=dtype, param_dtype=jnp.float32, mesh=mesh)
  # Its padding only fills masked slots: it may lack a pad token (then id 0 pads).
  reward_tokenizer = (load_tokenizer(path, add_pad_token=resize_embeddings, require_pad=False)
                      if _has_tokenizer(path) else None)
  reward_vocab = len(reward_tokenizer if reward_tokenizer is not None else tokenizer)
  grow_vocab(reward_model, reward_vocab, resize=resize_embeddings, what="reward model")
  scorer = RewardModelScorer(reward_model, policy_tokenizer=tokenizer,
                             reward_tokenizer=reward_tokenizer,
                             max_length=reward_model.config.max_position_embeddings)
  check_vocab_covers(reward_tokenizer if scorer.retokenize else tokenizer, reward_model.config)
  return reward_model, scorer


def build_scorer(config: Any, tokenizer: Any, *, dtype: Any, mesh: Any = None
                 ) -> tuple[Any, tuple[Any, RewardModelScorer] | None]:
  """The scorer of `config`'s reward source (`check_reward_source`): a `RewardModelScorer`, a
  reward function's scorer, or a `CombinedScorer` of `config.rewards`.

  Args:
    config: a run config with the reward fields and `resize_embeddings`.
    tokenizer: the policy's tokenizer.
    dtype: the reward models' compute dtype.
    mesh: the reward models load into their shards on this mesh (None: one device).

  Returns:
    `(scorer, first_model)`: `first_model` the `(reward model, scorer)` of the first reward
    model (PPO's critic may start from it), None without one.
  """
  load = lambda path: reward_model_scorer(  # noqa: E731
      path, tokenizer, dtype=dtype, resize_embeddings=config.resize_embeddings, mesh=mesh)
  if config.reward_model_path is not None:
    first = load(config.reward_model_path)
    return first[1], first
  if config.reward_function is not None:
    return reward_function(config.reward_function, tokenizer), None
  first = None
  sources: list[tuple[str, Any, float]] = []
  names: Sequence[str] = reward_source_names(config.rewards)
  for name, source in zip(names, config.rewards, strict=True):
    if source.model_path is not None:
      pair = load(source.model_path)
      first = first or pair
      sub = pair[1]
    else:
      sub = reward_function(source.function, tokenizer)
    sources.append((name, sub, source.weight))
  return CombinedScorer(sources), first


__all__ = [
    "build_scorer",
    "check_reward_models",
    "check_reward_source",
    "reward_given",
    "reward_model_fields",
    "reward_model_scorer",
]
