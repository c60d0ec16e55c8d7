"""The three RLHF stages from one YAML: SFT, then the reward model, then PPO.

A pipeline file names (or holds) one config per stage and how they connect::

  model_path: models/Qwen3-0.6B   # the checkpoint SFT starts from
  out_dir: runs/qwen3             # default run_dir of each stage: out_dir/sft, /reward, /ppo
  sft: sft.yaml                   # an SFTRunConfig: a file (relative to this one) or a mapping
  reward: reward.yaml             # a RewardRunConfig
  ppo: ppo_reward_model.yaml      # a RunConfig (`jax-ppo train`)
  eval:                           # optional: held-out prompts scored once PPO is complete
    prompts_path: data/heldout.jsonl
    temperature: null             # null: greedy; else sampled, `n` times per prompt

Wiring (it replaces what the stage's file says, so the stage files also work on their own with
`jax-ppo sft|reward|train`; a command-line override of the same key wins): `run_dir` is
`out_dir/<stage>`; `sft.model_path` is `model_path`; `reward.model_path` and
`reward.policy_path` are the SFT export (or `model_path` without an SFT stage); `ppo.policy_path`
is the SFT export (or `model_path`); `ppo.reward_model_path` is the reward stage's export unless
the PPO config names a `reward_function`. A stage set to null (or left out) is skipped.
Overrides are `key=value` with the stage's name first (`sft.sft.optimizer.learning_rate=1e-5`,
`reward.train_path=prefs.jsonl`, `ppo.ppo.total_updates=10`) or a top-level key
(`model_path=...`, `out_dir=...`).

`run_pipeline` runs the stages in order, each resuming its own run folder, and stops after a
stage that is not complete (`run.steps_per_run`/`run.updates_per_run`, or a preemption), so the
same command continues it. The PPO policy is exported to `<ppo run_dir>/hf_model` when PPO is done,
and with an `eval` section (`PipelineEval`; overrides `eval.n=4`) its final checkpoint samples
and scores the held-out prompts as `jax-ppo eval` does (`evaluate_run`): the metrics go into the
PPO summary and `<ppo run_dir>/eval/step_<N>.json`.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import pathlib
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import yaml

from jax_ppo.config_io import (
  apply_overrides,
  check_keys,
  config_from_dict,
  parse_override,
  read_config_file,
)
from jax_ppo.ppo.evaluation import check_eval_sampling
from jax_ppo.runs.paths import check_run_paths, resolved
from jax_ppo.runs.ppo import (
  check_prompts_file,
  evaluate_run,
  export_run,
  run_training,
)
from jax_ppo.runs.ppo_config import RunConfig, load_run_config
from jax_ppo.runs.reward import RewardRunConfig, load_reward_config, run_reward
from jax_ppo.runs.sft import SFTRunConfig, load_sft_config, run_sft
from jax_ppo.training.loop import CHECKPOINT_DIR

logger = logging.getLogger("jax_ppo.pipeline")

STAGES: dict[str, type] = {"sft": SFTRunConfig, "reward": RewardRunConfig, "ppo": RunConfig}
"""Pipeline section -> the config class of that stage."""
SECTIONS = (*STAGES, "eval")
"""Sections of a pipeline file, each overridden with `<section>.<key>=value`."""
TOP_LEVEL = ("model_path", "out_dir", *SECTIONS)
"""Keys of a pipeline file."""


@dataclasses.dataclass(frozen=True)
class PipelineEval:
  """The `eval` section: held-out prompts sampled and scored with the final PPO checkpoint.

  Attributes:
    prompts_path: held-out prompts (.txt or .jsonl, as `RunConfig.prompts_path`); checked when
      the pipeline loads, so a typo fails before any stage trains.
    temperature: None samples greedily; else the sampling temperature.
    n: samples per prompt (best-of-n); more than 1 needs a temperature.
    seed: sampling seed.
  """

  prompts_path: str = ""
  temperature: float | None = None
  n: int = 1
  seed: int = 0

  def __post_init__(self):
    if not isinstance(self.prompts_path, str) or not self.prompts_path:
      raise ValueError(f"eval.prompts_path={self.prompts_path!r} is invalid: give a held-out "
                       "prompts file (.txt or .jsonl), or leave the eval section out.")
    check_eval_sampling(self.n, self.temperature, n_field="eval.n",
                        temperature_field="eval.temperature")


def _split_overrides(overrides: Sequence[str], source: str) -> tuple[dict, dict[str, list[str]]]:
  top: dict[str, str] = {}
  per_stage: dict[str, list[str]] = {name: [] for name in SECTIONS}
  for text in overrides:
    key, value = parse_override(text)
    head, dot, rest = key.partition(".")
    if head in SECTIONS and dot:
      per_stage[head].append(f"{rest}={value}")
    elif head in ("model_path", "out_dir") and not dot:
      top[head] = yaml.safe_load(value) if value else None
    else:
      close = difflib.get_close_matches(head, TOP_LEVEL, n=1, cutoff=0.6)
      hint = f" Did you mean '{close[0]}'?" if close else ""
      raise ValueError(
          f"Override {text!r} for {source}: unknown key {key!r}.{hint} Write model_path=..., "
          "out_dir=..., or a stage key with the stage first: sft.<SFTRunConfig key>=..., "
          "reward.<RewardRunConfig key>=..., ppo.<RunConfig key>=..., eval.<key>=...."
      )
  return top, per_stage


def _section(pipeline: Mapping[str, Any], name: str, base: pathlib.Path,
             source: str) -> dict[str, Any] | None:
  value = pipeline.get(name)
  if value is None:
    return None
  if isinstance(value, str):
    path = pathlib.Path(value)
    if not path.is_absolute():
      path = base / path
    if not path.is_file():
      raise FileNotFoundError(f"{source}: {name}: {value!r} resolves to {str(path)!r}, which "
                              "does not exist; give a config file path relative to the pipeline "
                              "file, or an inline mapping.")
    data = read_config_file(path)
    check_keys(STAGES[name], data, source=f"Config file {str(path)!r} ({name} stage of {source})")
    return data
  if isinstance(value, Mapping):
    check_keys(STAGES[name], value, source=f"{source}, section {name!r}")
    return dict(value)
  raise ValueError(f"{source}: {name!r} must be a config file path or a mapping of "
                   f"{STAGES[name].__name__} keys (or null to skip the stage), got "
                   f"{type(value).__name__}.")


def _load_eval(value: Any, overrides: list[str], source: str) -> PipelineEval | None:
  """The `eval` section with its overrides (None when neither is given)."""
  if value is None and not overrides:
    return None
  value = {} if value is None else value
  where = f"{source}, section 'eval'"
  check_keys(PipelineEval, value, source=where)
  try:
    evaluation = config_from_dict(PipelineEval, apply_overrides(PipelineEval, value, overrides))
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None
  check_prompts_file(evaluation.prompts_path, field="eval.prompts_path")
  return evaluation


def _override_keys(overrides: Sequence[str]) -> set[str]:
  return {parse_override(o)[0].partition(".")[0] for o in overrides}


def _load(name: str, data: dict[str, Any], overrides: list[str], source: str):
  """The stage's config: `data` with `overrides` applied, loaded by the stage's own loader (so
  `ppo` presets apply as in `jax-ppo train`); errors say which stage."""
  try:
    apply_overrides(STAGES[name], data, overrides)  # errors name the override before anything
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, f"{name}.yaml")
      with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(data, f, sort_keys=False)
      loader = {"sft": load_sft_config, "reward": load_reward_config,
                "ppo": load_run_config}[name]
      return loader([path, *overrides])
  except ValueError as e:
    missing = "run_dir" in str(e) and "Missing required field" in str(e)
    hint = " (or set out_dir in the pipeline file)" if missing else ""
    raise ValueError(f"{source}, {name} stage: {e}{hint}") from None


def load_pipeline(argv: Sequence[str]) -> dict[str, Any]:
  """The stage configs of a pipeline file and overrides: `{"sft": SFTRunConfig | None,
  "reward": RewardRunConfig | None, "ppo": RunConfig | None, "eval": PipelineEval | None}`,
  wired as the module docstring says.

  Raises:
    ValueError / FileNotFoundError: naming the file, section or override, and the fix.
  """
  files = [a for a in argv if "=" not in a]
  overrides = [a for a in argv if "=" in a]
  if len(files) != 1:
    raise ValueError(f"Give exactly one pipeline file (YAML/JSON), got {files}; other arguments "
                     "are key=value.")
  source = f"Pipeline file {files[0]!r}"
  pipeline = read_config_file(files[0])
  for key in pipeline:
    if key not in TOP_LEVEL:
      close = difflib.get_close_matches(str(key), TOP_LEVEL, n=1, cutoff=0.6)
      hint = f" Did you mean '{close[0]}'?" if close else ""
      raise ValueError(f"{source}: unknown key {key!r}.{hint} Valid keys: "
                       f"{', '.join(TOP_LEVEL)}.")
  top, per_stage = _split_overrides(overrides, source)
  pipeline = {**pipeline, **top}
  base = pathlib.Path(files[0]).resolve().parent
  sections = {name: _section(pipeline, name, base, source) for name in STAGES}
  if all(s is None for s in sections.values()):
    raise ValueError(f"{source} names no stage; give at least one of sft, reward, ppo.")
  evaluation = _load_eval(pipeline.get("eval"), per_stage["eval"], source)
  if evaluation is not None and sections["ppo"] is None:
    raise ValueError(f"{source}: the eval section scores the PPO stage's final checkpoint; add "
                     "a ppo stage or remove eval.")
  model_path, out_dir = pipeline.get("model_path"), pipeline.get("out_dir")
  for key, value in (("model_path", model_path), ("out_dir", out_dir)):
    if value is not None and (not isinstance(value, str) or not value):
      raise ValueError(f"{source}: {key}={value!r} is invalid: give a path, or leave it out.")

  def defaults(name: str, values: dict[str, Any]) -> dict[str, Any]:
    data = dict(sections[name])
    overridden = _override_keys(per_stage[name])
    if out_dir is not None:
      values = {"run_dir": os.path.join(out_dir, name), **values}
    for key, value in values.items():
      if key not in overridden and value is not None:
        data[key] = value
    return data

  configs: dict[str, Any] = {name: None for name in STAGES}
  start = model_path
  if sections["sft"] is not None:
    configs["sft"] = _load("sft", defaults("sft", {"model_path": model_path}),
                           per_stage["sft"], source)
    start = str(configs["sft"].export_path)
  reward_model = None
  if sections["reward"] is not None:
    configs["reward"] = _load("reward", defaults(
        "reward", {"model_path": start, "policy_path": start}), per_stage["reward"], source)
    reward_model = str(configs["reward"].export_path)
  if sections["ppo"] is not None:
    values: dict[str, Any] = {"policy_path": start}
    ppo_keys = _override_keys(per_stage["ppo"])
    function = "reward_function" in ppo_keys or (
        sections["ppo"].get("reward_function") is not None and "reward_model_path" not in ppo_keys)
    if not function:
      values["reward_model_path"] = reward_model
    data = defaults("ppo", values)
    if "reward_function" in ppo_keys and "reward_model_path" not in ppo_keys:
      data["reward_model_path"] = None  # a reward function named on the command line replaces it
    configs["ppo"] = _load("ppo", data, per_stage["ppo"], source)
  configs["eval"] = evaluation
  try:
    check_pipeline_paths(configs)
  except ValueError as e:
    raise ValueError(f"{source}: {e}") from None
  return configs


def check_pipeline_paths(configs: Mapping[str, Any]) -> None:
  """Across stages: no stage writes over what another reads (each stage's config checks its
  own paths; `jax_ppo.runs.paths.check_run_paths`). The folders one stage exports for the next
  (the SFT and reward-model exports) are outputs, not inputs; every run folder, every export
  (PEFT adapter exports too) and the PPO export `<ppo run_dir>/hf_model` are checked against
  every other path the stages read, and no export may be or hold a stage's run folder.

  Raises:
    ValueError: naming the stages' fields (`sft.run_dir`, `reward.model_path`, ...) and paths.
  """
  run_dirs, exports, inputs = [], [], []
  for name in STAGES:
    config = configs.get(name)
    if config is None:
      continue
    run_dirs.append((f"{name}.run_dir", config.run_dir))
    exports.append((f"{name}.export_dir", str(config.export_path)) if name != "ppo" else
                   ("ppo.run_dir/hf_model", os.path.join(config.run_dir, "hf_model")))
    exports += config.adapter_exports(prefix=name)
    inputs += config.read_paths(prefix=name)
  handed = {resolved(path) for _, path in exports}
  inputs = [(field, path) for field, path in inputs
            if path is None or resolved(path) not in handed]
  check_run_paths(inputs=inputs, run_dirs=run_dirs, exports=exports)


def run_pipeline(
    configs: Mapping[str, Any], *, report: Callable[[dict[str, Any]], None] | None = None
) -> list[dict[str, Any]]:
  """Runs (or resumes) the stages of `load_pipeline` in order; returns one summary per stage
  run, each with "stage", "complete" and "seconds". Stops after a stage that is not complete."""
  summaries = []

  def done(summary: dict[str, Any], began: float) -> bool:
    summary["seconds"] = round(time.perf_counter() - began, 1)
    summaries.append(summary)
    if report is not None:
      report(summary)
    if not summary["complete"]:
      logger.info("Stage %s is not complete (step %s of %s); run the same command again to "
                  "continue.", summary["stage"], summary.get("step"), summary.get("total_steps"))
    return summary["complete"]

  for name, run in (("sft", run_sft), ("reward", run_reward)):
    if configs.get(name) is not None:
      began = time.perf_counter()
      if not done(run(configs[name]), began):
        return summaries
  config: RunConfig | None = configs.get("ppo")
  if config is not None:
    began = time.perf_counter()
    history = run_training(config)
    summary: dict[str, Any] = {"stage": "ppo", "run_dir": config.run_dir,
                               "updates_run": len(history),
                               "preempted": getattr(history, "preempted", None)}
    if history:
      last = history[-1]
      summary.update({k: float(last[k]) for k in ("objective/scores", "objective/kl")
                      if k in last})
    step = _latest_step(config.run_dir)
    summary["step"] = step
    summary["total_steps"] = config.ppo.total_updates
    summary["complete"] = step is not None and step >= config.ppo.total_updates and not (
        summary["preempted"])
    summary["export_dir"] = None
    if summary["complete"]:
      path, _ = export_run(config.run_dir, os.path.join(config.run_dir, "hf_model"))
      summary["export_dir"] = str(path)
      evaluation: PipelineEval | None = configs.get("eval")
      if evaluation is not None:
        result = evaluate_run(config.run_dir, evaluation.prompts_path,
                              temperature=evaluation.temperature, n=evaluation.n,
                              seed=evaluation.seed)
        summary["eval"] = {"step": result["step"], "out": result["out"], **result["metrics"]}
    done(summary, began)
  return summaries


def _latest_step(run_dir: str) -> int | None:
  """The newest committed checkpoint step of a run folder (Orbax names them by step)."""
  steps = [int(p.name) for p in (pathlib.Path(run_dir) / CHECKPOINT_DIR).glob("*")
           if p.name.isdigit()]
  return max(steps) if steps else None


__all__ = ["STAGES", "PipelineEval", "check_pipeline_paths", "load_pipeline", "run_pipeline"]
