"""Starting config files: `jax-ppo config {train,sft,reward,dpo,pipeline}` prints one.

    jax-ppo config train > run.yaml        # every RunConfig field at its default, documented
    jax-ppo train run.yaml run_dir=runs/ppo policy_path=models/sft prompts_path=prompts.jsonl \\
        reward_model_path=runs/reward/hf_model

`config_template(verb)` is the YAML of the verb's run config with every field at its default and
its documentation (the attribute docstrings, `jax_ppo.config_io.field_docs`) as a comment above
it. Fields without a default (`run_dir`, `policy_path`, ...) are written commented out under a
"REQUIRED" line, so the file loads as it is and a missing one is named by the verb's loader; the
reward source of a PPO run (exactly one of `reward_model_path`, `reward_function`, `rewards`) is
marked the same way. Read back by the verb's own loader with the required fields filled, the file
gives the same config as those fields alone. `key=value` overrides are applied before printing
(`jax-ppo config train preset=dialogue` prints the preset's values: values written in a file
override a preset's, so a preset named later would not change them).

`config_sections(cls)` names a run config's nested blocks (`ppo`, `ppo.sampling`, `run`, `mesh`,
...) for the verbs' `--help`.
"""

from __future__ import annotations

import dataclasses
import textwrap
import typing
from collections.abc import Sequence
from typing import Any

from jax_ppo.config_io import config_to_dict, documented_yaml, parse_override
from jax_ppo.runs.pipeline import PipelineEval
from jax_ppo.runs.stages import STAGE_CONFIGS, STAGE_LOADERS

VERBS = ("train", "sft", "reward", "dpo", "pipeline")
"""The `jax-ppo` verbs that read a config file, in the order `jax-ppo config` lists them."""
VERB_STAGES = {"train": "ppo", "sft": "sft", "reward": "reward", "dpo": "dpo"}
"""Verb -> the stage (`jax_ppo.runs.stages`) whose run config it reads."""
PLACEHOLDERS = {
    "run_dir": "runs/{stage}",
    "policy_path": "models/policy",
    "prompts_path": "data/prompts.jsonl",
    "model_path": "models/base",
    "train_path": "data/{stage}.jsonl",
    "out_dir": "runs/pipeline",
}
"""Example values of the fields without a default, written (commented out) in a template."""
REWARD_FIELDS = ("reward_model_path", "reward_function", "rewards")
"""The fields of `RunConfig` of which exactly one is set: the run's reward source."""
PIPELINE_DOCS = {
    "model_path": "Local Hugging Face folder (or a Hub id org/name in the local cache) of the "
                  "checkpoint SFT starts from (the reward model and PPO start from the SFT "
                  "export; without an sft section, from this).",
    "out_dir": "Each stage's run_dir is out_dir/<stage> (out_dir/sft, out_dir/reward, "
               "out_dir/ppo).",
    "sft": "The SFT stage (`jax-ppo sft`, SFTRunConfig): a mapping, or a config file path "
           "relative to this file; null skips the stage.",
    "reward": "The reward-model stage (`jax-ppo reward`, RewardRunConfig), as sft.",
    "ppo": "The PPO stage (`jax-ppo train`, RunConfig), as sft.",
    "eval": "Held-out prompts sampled and scored with the final PPO checkpoint (PipelineEval); "
            "null: none.",
}
"""The documentation of the top-level keys of a pipeline file (`jax_ppo.runs.pipeline`)."""
PIPELINE_WIRED = {
    "sft": ("run_dir", "model_path"),
    "reward": ("run_dir", "model_path", "policy_path"),
    "ppo": ("run_dir", "policy_path", "reward_model_path"),
}
"""Fields of each pipeline stage that the pipeline sets (`jax_ppo.runs.pipeline`): left out of
the pipeline template's sections."""
REQUIRED = "REQUIRED (no default): uncomment and fill in, or give {key}=... on the command line."


def required_fields(cls: type) -> tuple[str, ...]:
  """The `init` fields of the dataclass `cls` without a default, in field order."""
  return tuple(f.name for f in dataclasses.fields(cls) if f.init
               and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING)


def config_sections(cls: type, *, depth: int = 2) -> list[tuple[str, str]]:
  """`(dotted name, class name)` of the nested config blocks of the dataclass `cls` (fields
  whose type is a dataclass, or an Optional or a tuple of one), `depth` levels deep, in field
  order: e.g. `("ppo", "PPOConfig")`, `("ppo.sampling", "PPOSampling")`, `("mesh",
  "MeshConfig")`."""
  out: list[tuple[str, str]] = []
  hints = typing.get_type_hints(cls)
  for field in (f for f in dataclasses.fields(cls) if f.init):
    nested = _nested_dataclass(hints[field.name])
    if nested is None:
      continue
    out.append((field.name, nested.__name__))
    if depth > 1:
      out += [(f"{field.name}.{name}", kind)
              for name, kind in config_sections(nested, depth=depth - 1)]
  return out


def sections_help(verb: str) -> str:
  """The paragraph of a verb's `--help` that names its config sections."""
  if verb == "pipeline":
    stages = ", ".join(f"{name} ({STAGE_CONFIGS[VERB_STAGES[v]].__name__})" for name, v in
                       (("sft", "sft"), ("reward", "reward"), ("ppo", "train")))
    return (f"Config keys: model_path, out_dir; sections: {stages}, eval (PipelineEval); "
            "override a stage's key with the stage first (sft.sft.optimizer.learning_rate=1e-5). "
            "Print a documented starting file with: jax-ppo config pipeline.")
  cls = STAGE_CONFIGS[VERB_STAGES[verb]]
  names = ", ".join(f"{name} ({kind})" for name, kind in config_sections(cls))
  return (f"Config sections ({cls.__name__}; set a field with section.field=value): {names}. "
          f"Print every field with its documentation: jax-ppo config {verb}.")


def config_template(verb: str, overrides: Sequence[str] = ()) -> str:
  """The documented default config of `verb` ("train", "sft", "reward", "dpo" or "pipeline") as
  YAML,
  with `key=value` `overrides` applied (see the module doc).

  Raises:
    ValueError: an unknown verb, or an override the verb's loader refuses.
  """
  if verb not in VERBS:
    raise ValueError(f"unknown command {verb!r}: choose one of {', '.join(VERBS)}.")
  if verb == "pipeline":
    return _pipeline_template(overrides)
  stage = VERB_STAGES[verb]
  cls = STAGE_CONFIGS[stage]
  data, missing = _stage_data(stage, overrides)
  command = " ".join([f"jax-ppo {verb} {'run' if verb == 'train' else verb}.yaml",
                      *(f"{k}={_placeholder(k, stage)}" for k in missing)])
  notes = {k: REQUIRED.format(key=k) for k in missing}
  if stage == "ppo" and not _reward_given(overrides):
    command += " reward_model_path=runs/reward/hf_model"
    for key in REWARD_FIELDS:
      notes[key] = ("REQUIRED: exactly one reward source, reward_model_path, reward_function or "
                    "rewards.")
  prose = [f"`jax-ppo {verb}` config: {cls.__module__}.{cls.__name__}, every field at its "
           f"default (`jax-ppo config {verb}`). Fill in the fields marked REQUIRED (here, or as "
           "key=value on the command line), e.g.:"]
  header = _comment(prose) + _command(command)
  if stage == "ppo":
    header += _comment(["Values written here override a preset's: to start from a preset, print "
                        "it with `jax-ppo config train preset=NAME`."])
  ordered = {**dict.fromkeys(missing), **data}
  return "\n".join(header) + "\n" + documented_yaml(cls, ordered, commented=missing, notes=notes)


def _stage_data(stage: str, overrides: Sequence[str]) -> tuple[dict[str, Any], tuple[str, ...]]:
  """The plain config of `stage` loaded by its own loader from `overrides` (placeholders for
  the required fields they leave out, for the reward source of a PPO run and for a DPO run's
  data, `train_path`), and the required fields that hold a placeholder."""
  cls = STAGE_CONFIGS[stage]
  given = {parse_override(o)[0].split(".")[0] for o in overrides}
  missing = tuple(k for k in required_fields(cls) if k not in given)
  if stage == "dpo" and not given & {"train_path", "prompts_path"}:
    missing += ("train_path",)  # (or prompts_path and a reward: online DPO)
  fill = [f"{k}={_placeholder(k, stage)}" for k in missing]
  reward = stage == "ppo" and not _reward_given(overrides)
  if reward:  # only the syntax of a module reward is checked: nothing is imported
    fill.append("reward_function=placeholder.module:score")
  data = config_to_dict(STAGE_LOADERS[stage]([*overrides, *fill]))
  for key in missing:
    data[key] = _placeholder(key, stage)
  if reward:
    data["reward_function"] = None
  return data, missing


def _pipeline_template(overrides: Sequence[str]) -> str:
  """`config_template("pipeline")`: the top-level keys, and each stage as an inline section
  without the fields the pipeline sets."""
  if overrides:
    raise ValueError("`jax-ppo config pipeline` takes no key=value overrides; edit the printed "
                     "file, or print a stage's config with `jax-ppo config train|sft|reward`.")
  lines = _comment([
      "`jax-ppo pipeline` config: SFT, then the reward model, then PPO (jax_ppo.runs.pipeline), "
      "each stage at its defaults (`jax-ppo config pipeline`). Fill in the fields marked REQUIRED "
      "(here, or as key=value on the command line, a stage's key with the stage first), e.g.:"])
  lines += _command("jax-ppo pipeline pipeline.yaml model_path=models/base out_dir=runs/pipeline "
                    "sft.train_path=data/sft.jsonl reward.train_path=data/reward.jsonl "
                    "ppo.prompts_path=data/prompts.jsonl")
  lines += _comment(["The pipeline sets each stage's run_dir (out_dir/<stage>), the model it "
                     "starts from and the reward model PPO reads; a stage's key=value override "
                     "wins."])
  for key in ("model_path", "out_dir"):
    lines += _comment([REQUIRED.format(key=key), PIPELINE_DOCS[key]])
    lines.append(f"# {key}: {PLACEHOLDERS[key]}")
  for name, verb in (("sft", "sft"), ("reward", "reward"), ("ppo", "train")):
    stage = VERB_STAGES[verb]
    cls = STAGE_CONFIGS[stage]
    data, _ = _stage_data(stage, ())
    wired = PIPELINE_WIRED[name]
    required = tuple(k for k in required_fields(cls) if k not in wired)
    data = {k: v for k, v in data.items() if k not in wired}
    notes = {k: f"REQUIRED (no default): uncomment and fill in, or give {name}.{k}=... on the "
                "command line." for k in required}
    lines += _comment([PIPELINE_DOCS[name], f"Set by the pipeline: {', '.join(wired)}."])
    lines.append(f"{name}:")
    text = documented_yaml(cls, {**dict.fromkeys(required), **data}, commented=required,
                           notes=notes, width=98)
    lines += [f"  {line}" for line in text.splitlines()]
  lines += _comment([PIPELINE_DOCS["eval"]])
  lines.append("eval: null")
  example = documented_yaml(PipelineEval, {"prompts_path": "data/heldout.jsonl",
                                           "temperature": None, "n": 1, "seed": 0}, width=98)
  lines.append("# eval:  # to set it, uncomment this block instead of the line above")
  lines += [f"#   {line}" for line in example.splitlines()]
  return "\n".join(lines) + "\n"


def _comment(texts: Sequence[str]) -> list[str]:
  return [line for text in texts for line in textwrap.wrap(
      text, width=98, initial_indent="# ", subsequent_indent="# ", break_long_words=False)]


def _command(command: str) -> list[str]:
  """A shell command as comment lines of at most 100 characters, continued with backslashes."""
  lines, line = [], "#  "
  for word in command.split():
    if len(line) + len(word) + 3 > 100:
      lines.append(line + " \\")
      line = "#     "
    line += " " + word
  return [*lines, line]


def _placeholder(key: str, stage: str) -> str:
  return PLACEHOLDERS[key].format(stage=stage)


def _reward_given(overrides: Sequence[str]) -> bool:
  return any(parse_override(o)[0].split(".")[0] in REWARD_FIELDS for o in overrides)


def _nested_dataclass(tp: Any) -> type | None:
  """The dataclass of a field type: a dataclass, an Optional of one, or a `tuple[D, ...]`."""
  args = [a for a in typing.get_args(tp) if a is not type(None) and a is not Ellipsis]
  for candidate in (tp, *args):
    if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
      return candidate
  return None


__all__ = [
    "PIPELINE_DOCS",
    "PIPELINE_WIRED",
    "PLACEHOLDERS",
    "REWARD_FIELDS",
    "VERBS",
    "VERB_STAGES",
    "config_sections",
    "config_template",
    "required_fields",
    "sections_help",
]
