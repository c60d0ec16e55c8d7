"""`jax-ppo config {train,sft,reward,dpo,pipeline}` (jax_ppo.runs.templates): the printed YAML loads
back with the verb's own loader to the default config once the REQUIRED fields are filled, every
field's documentation is a comment, `--help` names the config sections, and a bad verb is one
line. One slow test trains from the printed file on a tiny local checkpoint."""

import dataclasses
import json
import re
import typing

import pytest
import yaml

from jax_ppo.cli import main
from jax_ppo.config_io import field_docs
from jax_ppo.models import LoRAConfig
from jax_ppo.parallel.mesh import MeshConfig
from jax_ppo.runs.dpo import DPORunConfig, load_dpo_config
from jax_ppo.runs.pipeline import load_pipeline
from jax_ppo.runs.ppo_config import RunConfig, load_run_config
from jax_ppo.runs.reward import RewardRunConfig, load_reward_config
from jax_ppo.runs.sft import SFTRunConfig, load_sft_config
from jax_ppo.runs.templates import (
  PIPELINE_WIRED,
  config_sections,
  config_template,
  required_fields,
)

REQUIRED = {
    "train": {"run_dir": "r/ppo", "policy_path": "m/policy", "prompts_path": "p.jsonl",
              "reward_model_path": "m/rm"},
    "sft": {"run_dir": "r/sft", "model_path": "m/base", "train_path": "sft.jsonl"},
    "reward": {"run_dir": "r/rm", "model_path": "m/base", "train_path": "prefs.jsonl"},
    "dpo": {"run_dir": "r/dpo", "model_path": "m/base", "train_path": "prefs.jsonl"},
}
LOADERS = {"train": load_run_config, "sft": load_sft_config, "reward": load_reward_config,
           "dpo": load_dpo_config}
CLASSES = {"train": RunConfig, "sft": SFTRunConfig, "reward": RewardRunConfig,
           "dpo": DPORunConfig}


def _write(tmp_path, text: str, name: str = "run.yaml") -> str:
  path = tmp_path / name
  path.write_text(text)
  return str(path)


def _argv(fields: dict[str, str]) -> list[str]:
  return [f"{k}={v}" for k, v in fields.items()]


def _comment_text(text: str) -> str:
  """Every comment of a YAML text, joined, whitespace collapsed."""
  comments = [line.split("# ", 1)[1] for line in text.splitlines() if "# " in line]
  return " ".join(" ".join(comments).split())


@pytest.mark.parametrize("verb", ["train", "sft", "reward", "dpo"])
def test_printed_config_loads_back_to_the_defaults(verb, tmp_path):
  path = _write(tmp_path, config_template(verb))
  loaded = LOADERS[verb]([path, *_argv(REQUIRED[verb])])
  assert loaded == LOADERS[verb](_argv(REQUIRED[verb]))
  assert loaded == CLASSES[verb](**{k: v for k, v in REQUIRED[verb].items()})


@pytest.mark.parametrize("verb", ["train", "sft", "reward", "dpo"])
def test_required_fields_are_commented_out_and_marked(verb, tmp_path):
  text = config_template(verb)
  data = yaml.safe_load(text)
  for key in required_fields(CLASSES[verb]):
    assert key not in data
    assert re.search(rf"^# REQUIRED.*\n(#.*\n)*# {key}: \S+$", text, re.M), key
  with pytest.raises(ValueError, match="run_dir"):
    LOADERS[verb]([_write(tmp_path, text)])


def test_train_needs_a_reward_source_and_says_so(tmp_path):
  path = _write(tmp_path, config_template("train"))
  fields = {k: v for k, v in REQUIRED["train"].items() if k != "reward_model_path"}
  with pytest.raises(ValueError, match="exactly one reward source"):
    load_run_config([path, *_argv(fields)])
  text = config_template("train")
  for key in ("reward_model_path", "reward_function", "rewards"):
    assert re.search(rf"^# REQUIRED: exactly one reward source.*\n(#.*\n)*{key}: ", text, re.M)
  config = load_run_config([path, *_argv(fields), "reward_function=pkg.mod:fn"])
  assert config.reward_function == "pkg.mod:fn" and config.reward_model_path is None


@pytest.mark.parametrize("verb", ["train", "sft", "reward", "dpo"])
def test_every_field_documentation_is_a_comment(verb):
  text = _comment_text(config_template(verb))
  classes = [CLASSES[verb], *(c for c in _nested_classes(CLASSES[verb]))]
  checked = 0
  for cls in classes:
    for name, doc in field_docs(cls).items():
      assert doc, f"{cls.__name__}.{name} has no documentation"
      assert doc in text, f"{cls.__name__}.{name}"
      checked += 1
  assert checked > 50


def _nested_classes(cls):
  """The dataclasses of `cls`'s nested config fields (Optional ones too), recursively."""
  hints = typing.get_type_hints(cls)
  for name in field_docs(cls):
    for nested in (hints[name], *typing.get_args(hints[name])):
      if (dataclasses.is_dataclass(nested) and isinstance(nested, type)
          and nested.__name__ not in ("RewardSource", "RoleMesh")):  # null: no block printed
        yield nested
        yield from _nested_classes(nested)


def test_a_commented_block_uncommented_loads_its_defaults(tmp_path):
  text = config_template("train")
  for key in ("lora", "mesh"):
    lines = text.splitlines()
    start = lines.index(f"# {key}:  # to set it, uncomment this block instead of the line above")
    end = start + 1
    while lines[end].startswith("#   "):
      end += 1
    block = [line[2:] for line in lines[start:end]]
    text = "\n".join([*lines[:start - 1], *block, *lines[end:]]) + "\n"
  config = load_run_config([_write(tmp_path, text), *_argv(REQUIRED["train"])])
  assert config.lora == LoRAConfig() and config.mesh == MeshConfig()


def test_overrides_are_applied_before_printing_so_a_preset_survives(tmp_path):
  text = config_template("train", ["preset=dialogue", "ppo.total_updates=7"])
  path = _write(tmp_path, text)
  expected = load_run_config(["preset=dialogue", "ppo.total_updates=7",
                              *_argv(REQUIRED["train"])])
  assert load_run_config([path, *_argv(REQUIRED["train"])]) == expected
  assert expected != load_run_config(_argv(REQUIRED["train"]))


def test_pipeline_template_loads_to_the_stage_defaults(tmp_path):
  path = _write(tmp_path, config_template("pipeline"), "pipeline.yaml")
  out = tmp_path / "out"
  configs = load_pipeline([path, "model_path=m/base", f"out_dir={out}",
                           "sft.train_path=sft.jsonl", "reward.train_path=prefs.jsonl",
                           "ppo.prompts_path=p.jsonl"])
  sft = load_sft_config(["model_path=m/base", f"run_dir={out}/sft", "train_path=sft.jsonl"])
  start = str(sft.export_path)
  reward = load_reward_config([f"model_path={start}", f"policy_path={start}",
                               f"run_dir={out}/reward", "train_path=prefs.jsonl"])
  ppo = load_run_config([f"policy_path={start}", f"run_dir={out}/ppo", "prompts_path=p.jsonl",
                         f"reward_model_path={reward.export_path}"])
  assert (configs["sft"], configs["reward"], configs["ppo"]) == (sft, reward, ppo)
  assert configs["eval"] is None
  data = yaml.safe_load(config_template("pipeline"))
  for stage, wired in PIPELINE_WIRED.items():
    assert not set(wired) & set(data[stage])


def test_config_sections_name_the_nested_blocks():
  names = dict(config_sections(RunConfig))
  assert {"ppo", "ppo.sampling", "ppo.optimizer", "run", "mesh", "lora", "distributed",
          "monitor", "placement"} <= set(names)
  assert names["mesh"] == "MeshConfig"
  assert {"sft", "sft.optimizer", "run", "mesh"} <= dict(config_sections(SFTRunConfig)).keys()


def test_cli_config_prints_the_template(capsys):
  assert main(["config", "sft"]) == 0
  assert capsys.readouterr().out == config_template("sft")


def test_cli_config_bogus_is_one_line(capsys):
  assert main(["config", "bogus"]) == 2
  captured = capsys.readouterr()
  assert captured.out == ""
  assert captured.err.count("\n") == 1
  assert "bogus" in captured.err and "train, sft, reward, dpo, pipeline" in captured.err


@pytest.mark.parametrize("verb, sections", [
    ("train", ["ppo (PPOConfig)", "ppo.sampling", "mesh (MeshConfig)", "run (PPORunFolder)",
               "lora (LoRAConfig)"]),
    ("sft", ["sft (SFTConfig)", "run (StageRunFolder)", "mesh"]),
    ("reward", ["reward (RewardModelConfig)", "mesh"]),
    ("pipeline", ["sft (SFTRunConfig)", "ppo (RunConfig)", "eval (PipelineEval)"]),
])
def test_help_names_the_config_sections(verb, sections, capsys):
  with pytest.raises(SystemExit):
    main([verb, "--help"])
  text = " ".join(capsys.readouterr().out.split())
  for section in sections:
    assert section in text
  assert f"jax-ppo config {verb}" in text


@pytest.mark.slow
def test_train_runs_from_the_printed_file(tmp_path, capsys):
  """`jax-ppo config train > run.yaml && jax-ppo train run.yaml policy_path=...` on a tiny
  local checkpoint."""
  pytest.importorskip("torch", reason="torch builds the tiny Hugging Face models")
  pytest.importorskip("transformers")
  from tests.tiny_hf_run import make_checkpoint, make_reward_checkpoint, write_data

  assert main(["config", "train"]) == 0
  path = _write(tmp_path, capsys.readouterr().out)
  data = write_data(tmp_path)
  argv = ["train", path, f"policy_path={make_checkpoint(tmp_path)}",
          f"prompts_path={data['prompts']}", f"run_dir={tmp_path / 'run'}",
          f"reward_model_path={make_reward_checkpoint(tmp_path)}",
          "ppo.batch_size=4", "ppo.num_minibatches=2", "ppo.ppo_epochs=1",
          "ppo.sampling.max_new_tokens=4", "ppo.total_updates=1", "run.progress=false",
          "run.plots=false", "run.tensorboard=false", "compilation_cache_dir=null"]
  assert main(argv) == 0, capsys.readouterr().err
  summary = json.loads(capsys.readouterr().out.splitlines()[-1])
  assert summary["step"] == 1 and summary["updates_run"] == 1
