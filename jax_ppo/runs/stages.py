"""Which stage a run config describes: PPO (`jax-ppo train`), SFT (`jax-ppo sft`), the reward
model (`jax-ppo reward`) or DPO (`jax-ppo dpo`), for the commands that read any of them
(`jax-ppo plan --stage`, `jax-ppo config`).

A config file does not name its stage. Its top-level keys tell PPO (`policy_path`,
`prompts_path`, `ppo`) from the offline stages (`model_path`, `train_path`), and an `sft` or
`reward` block tells those two apart, but a file holding only the keys they share (`model_path`,
`train_path`, `run_dir`, `lora`, `mesh`, ...) is a valid config of both. So the command names the
stage (`--stage`, default `ppo`), and `check_stage` refuses, in one line, a file whose keys are
not all fields of that stage's config, naming the keys and the stage(s) the file does fit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jax_ppo.config_io import parse_override, read_config_file
from jax_ppo.runs.dpo import DPORunConfig, load_dpo_config
from jax_ppo.runs.ppo_config import RunConfig, load_run_config
from jax_ppo.runs.reward import RewardRunConfig, load_reward_config
from jax_ppo.runs.run_folders import STAGE_COMMANDS
from jax_ppo.runs.sft import SFTRunConfig, load_sft_config

STAGES = ("ppo", "sft", "reward")
"""The stages `jax-ppo plan --stage` plans and `check_stage` tells apart. DPO (`jax-ppo dpo`) has
a run config below (for `jax-ppo config dpo`) but no plan yet, so it is not one of them."""
STAGE_CONFIGS = {"ppo": RunConfig, "sft": SFTRunConfig, "reward": RewardRunConfig,
                 "dpo": DPORunConfig}
"""Stage -> its run-config class."""
STAGE_LOADERS = {"ppo": load_run_config, "sft": load_sft_config, "reward": load_reward_config,
                 "dpo": load_dpo_config}
"""Stage -> the loader of its run config from a file and `key=value` overrides."""


def top_level_keys(cls: type) -> frozenset[str]:
  """The top-level keys a config file of `cls` may hold: its fields and the old flat keys its
  `MOVED_KEYS` still accept (and refuse with a message naming the new place)."""
  fields = {f.name for f in dataclasses.fields(cls)}
  moved = {key.split(".")[0] for key in getattr(cls, "MOVED_KEYS", {})}
  return frozenset(fields | moved)


def argv_keys(argv: Sequence[str]) -> list[str]:
  """The top-level keys of a config's arguments: the file's (at most one, read here) and the
  first part of every `key=value` override, in order, without repeats."""
  files = [a for a in argv if "=" not in a]
  if len(files) > 1:
    raise ValueError(f"Give at most one config file, got {files}; other arguments are key=value.")
  keys = list(read_config_file(files[0])) if files else []
  keys += [parse_override(a)[0].split(".")[0] for a in argv if "=" in a]
  return list(dict.fromkeys(str(k) for k in keys))


def stages_fitting(argv: Sequence[str]) -> tuple[str, ...]:
  """The stages whose run config knows every top-level key of `argv` (a file and overrides)."""
  keys = set(argv_keys(argv))
  return tuple(s for s in STAGES if keys <= top_level_keys(STAGE_CONFIGS[s]))


def check_stage(stage: str, argv: Sequence[str]) -> None:
  """Nothing when every top-level key of `argv` is a field of `stage`'s run config; otherwise a
  ValueError in one line naming the foreign keys and the stage(s) whose config the file is.

  Raises:
    ValueError: an unknown `stage`, or a config of another kind.
  """
  if stage not in STAGES:
    raise ValueError(f"stage {stage!r} is unknown: choose one of {list(STAGES)}.")
  keys = argv_keys(argv)
  foreign = [k for k in keys if k not in top_level_keys(STAGE_CONFIGS[stage])]
  if not foreign:
    return
  fits = stages_fitting(argv)
  name = STAGE_CONFIGS[stage].__name__
  if fits:
    kinds = " or ".join(f"a `{STAGE_COMMANDS[s]}` config ({STAGE_CONFIGS[s].__name__}; give "
                        f"--stage {s})" for s in fits)
    raise ValueError(f"the config is not a `{STAGE_COMMANDS[stage]}` config ({name} has no "
                     f"field {', '.join(map(repr, foreign))}): it is {kinds}.")
  raise ValueError(f"the config is not a `{STAGE_COMMANDS[stage]}` config: {name} has no field "
                   f"{', '.join(map(repr, foreign))}, and no stage's config has all of its keys "
                   f"({', '.join(map(repr, keys))}).")


def load_stage_run_config(stage: str, argv: Sequence[str]
                          ) -> RunConfig | SFTRunConfig | RewardRunConfig | DPORunConfig:
  """The run config of `stage` from at most one file and `key=value` overrides, after
  `check_stage` (so a config of another kind is one line naming its kind, not an unknown key)."""
  check_stage(stage, argv)
  return STAGE_LOADERS[stage](argv)


__all__ = [
    "STAGES",
    "STAGE_CONFIGS",
    "STAGE_LOADERS",
    "argv_keys",
    "check_stage",
    "load_stage_run_config",
    "stages_fitting",
    "top_level_keys",
]
