"""Tests of jax_ppo.config_io: YAML/JSON round trips, `key=value` overrides (nested, tuples,
Optional, YAML quirks) and errors that name the offending key."""

from __future__ import annotations

import dataclasses
import enum
import json
import pathlib
import typing
from typing import Literal

import pytest
import yaml

from jax_ppo.config_io import (
  apply_overrides,
  config_from_argv,
  config_from_dict,
  config_to_dict,
  documented_yaml,
  field_docs,
  load_config,
  migrate_keys,
  override_config,
  parse_override,
  read_config_file,
  save_config,
  with_defaults,
)
from jax_ppo.rollout.config import SamplingConfig


class Mode(enum.Enum):
  FAST = "fast"
  SLOW = "slow"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inner:
  dim: int = 8
  """Width."""
  dropout: float = 0.0
  """Dropout rate."""
  names: tuple[str, ...] = ("a",)
  """Some names."""

  def __post_init__(self):
    if self.dim < 1:
      raise ValueError(f"Inner.dim={self.dim} is invalid: use an int >= 1.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
  temperature: float = 1.0
  """Temperature."""
  stop_token_ids: tuple[int, ...] = ()
  """Stop ids."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outer:
  name: str = "run"
  """Run name."""
  learning_rate: float = 1e-6
  """Learning rate."""
  batch_size: int = 64
  """Batch size."""
  use_lora: bool = False
  """LoRA flag."""
  target_kl: float | None = None
  """Optional target."""
  seeds: tuple[int, ...] = (0,)
  """Variable-length tuple."""
  pair: tuple[int, float] = (1, 2.0)
  """Fixed-length tuple."""
  buckets: list[int] = dataclasses.field(default_factory=lambda: [1, 2])
  """A list."""
  weights: dict[str, float] = dataclasses.field(default_factory=dict)
  """A mapping."""
  mode: Mode = Mode.FAST
  """An enum."""
  kind: Literal["ppo", "grpo"] = "ppo"
  """A literal."""
  out_dir: pathlib.Path = pathlib.Path("runs")
  """A path."""
  inner: Inner = dataclasses.field(default_factory=Inner)
  """Nested config."""
  sampling: Sampling | None = None
  """Optional nested config."""
  derived: int = dataclasses.field(init=False, default=0)
  """Derived value, never saved."""

  def __post_init__(self):
    object.__setattr__(self, "derived", 2 * self.batch_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Required:
  seed: int
  """No default."""
  name: str = "x"
  """Has a default."""


NON_DEFAULT = Outer(
    name="123",
    learning_rate=3e-6,
    batch_size=32,
    use_lora=True,
    target_kl=6.0,
    seeds=(1, 2, 3),
    pair=(4, 0.5),
    buckets=[8],
    weights={"a": 1.0, "b": -2.5},
    mode=Mode.SLOW,
    kind="grpo",
    out_dir=pathlib.Path("/tmp/run 1"),
    inner=Inner(dim=16, dropout=0.1, names=("x", "y")),
    sampling=Sampling(temperature=0.7, stop_token_ids=(50256,)),
)


# ---- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("filename", ["config.yaml", "config.yml", "config.json"])
@pytest.mark.parametrize("config", [Outer(), NON_DEFAULT], ids=["defaults", "non_default"])
def test_round_trip_through_files(tmp_path, filename, config):
  path = save_config(config, tmp_path / "run" / filename)
  assert path == tmp_path / "run" / filename
  loaded = load_config(Outer, path)
  assert loaded == config
  assert isinstance(loaded.seeds, tuple) and isinstance(loaded.inner.names, tuple)
  assert loaded.derived == 2 * config.batch_size


def test_save_into_a_run_folder_writes_plain_yaml(tmp_path):
  path = save_config(NON_DEFAULT, tmp_path)
  assert path == tmp_path / "config.yaml"
  text = path.read_text()
  assert text.startswith("# test_config_io.Outer\n") or text.startswith("# tests.test_config_io")
  data = yaml.safe_load(text)
  assert data["seeds"] == [1, 2, 3] and data["inner"]["names"] == ["x", "y"]
  # draccus writes an enum by name; reading takes a name or a value (`mode=slow` below).
  assert data["mode"] == "SLOW" and data["out_dir"] == "/tmp/run 1" and data["name"] == "123"
  assert "derived" not in data
  assert list(data) == [f.name for f in dataclasses.fields(Outer) if f.init]  # field order kept
  assert load_config(Outer, tmp_path) == NON_DEFAULT  # a directory means its config.yaml


def test_json_file_is_plain_json(tmp_path):
  path = save_config(NON_DEFAULT, tmp_path / "c.json")
  assert json.loads(path.read_text()) == config_to_dict(NON_DEFAULT)


def test_config_to_dict_and_back():
  data = config_to_dict(NON_DEFAULT)
  assert data["pair"] == [4, 0.5] and data["sampling"] == {
      "temperature": 0.7,
      "stop_token_ids": [50256],
  }
  assert config_from_dict(Outer, data) == NON_DEFAULT
  assert config_from_dict(Outer, {}) == Outer()


def test_round_trip_of_a_library_config(tmp_path):
  config = SamplingConfig(temperature=0.7, stop_token_ids=(2, 7), pad_token_id=0, n_samples=4)
  assert load_config(SamplingConfig, save_config(config, tmp_path / "s.yaml")) == config
  assert load_config(SamplingConfig, None, ["prompt_buckets=[16,32]"]).prompt_buckets == (16, 32)


def test_round_trip_of_the_trainer_config(tmp_path):
  from jax_ppo.ppo.config import PPOConfig

  overrides = ["optimizer.learning_rate=1e-6", "sampling.stop_token_ids=[50256]",
               "target_kl=null", "lam=1"]
  config = load_config(PPOConfig, None, overrides)
  assert config.sampling.stop_token_ids == (50256,) and config.lam == 1.0
  assert load_config(PPOConfig, save_config(config, tmp_path)) == config


def test_file_values_and_missing_fields(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_text("learning_rate: 3e-6\ninner:\n  dim: 4\nsampling:\n  temperature: 0.5\n")
  config = load_config(Outer, path)
  assert config.learning_rate == 3e-6  # YAML 1.1 reads "3e-6" as a string
  assert config.inner == Inner(dim=4) and config.sampling == Sampling(temperature=0.5)
  assert config.batch_size == 64
  (tmp_path / "empty.yaml").write_text("")
  assert load_config(Outer, tmp_path / "empty.yaml") == Outer()


# ---- overrides -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, field, expected",
    [
        ("learning_rate=3e-6", "learning_rate", 3e-6),
        ("learning_rate=1", "learning_rate", 1.0),
        ("use_lora=true", "use_lora", True),
        ("target_kl=6", "target_kl", 6.0),
        ("target_kl=null", "target_kl", None),
        ("seeds=[1, 2]", "seeds", (1, 2)),
        ("seeds=[]", "seeds", ()),
        ("pair=[3, 4.5]", "pair", (3, 4.5)),
        ("buckets=[4]", "buckets", [4]),
        ("weights={a: 1, b: 2.5}", "weights", {"a": 1.0, "b": 2.5}),
        ("name=123", "name", "123"),
        ("name=yes", "name", "yes"),
        ("name=a: b", "name", "a: b"),
        ("name=", "name", ""),
        ("mode=slow", "mode", Mode.SLOW),
        ("mode=SLOW", "mode", Mode.SLOW),
        ("kind=grpo", "kind", "grpo"),
        ("out_dir=/tmp/x", "out_dir", pathlib.Path("/tmp/x")),
    ],
)
def test_override_values(override, field, expected):
  assert getattr(load_config(Outer, None, [override]), field) == expected


def test_nested_overrides():
  config = load_config(
      Outer,
      None,
      ["inner.dim=32", "inner.names=[p, q]", "sampling.stop_token_ids=[1,2]", "inner.dim=33"],
  )
  assert config.inner == Inner(dim=33, names=("p", "q"))  # the later override wins
  assert config.sampling == Sampling(stop_token_ids=(1, 2))  # created from None
  assert load_config(Outer, None, ["sampling=null"]).sampling is None
  replaced = load_config(Outer, None, ["inner={dim: 2}"])
  assert replaced.inner == Inner(dim=2)


def test_overrides_apply_on_top_of_the_file(tmp_path):
  path = save_config(NON_DEFAULT, tmp_path / "c.yaml")
  config = load_config(Outer, path, ["inner.dropout=0.3", "seeds=[9]"])
  assert config == dataclasses.replace(
      NON_DEFAULT, inner=dataclasses.replace(NON_DEFAULT.inner, dropout=0.3), seeds=(9,)
  )


def test_apply_overrides_keeps_values_plain_and_does_not_mutate():
  data = {"inner": {"dim": 4}}
  out = apply_overrides(Outer, data, ["inner.names=[a]", "name=7"])
  assert out == {"inner": {"dim": 4, "names": ["a"]}, "name": "7"}
  assert data == {"inner": {"dim": 4}}
  with pytest.raises(TypeError, match="sequence"):
    apply_overrides(Outer, {}, "name=x")


def test_parse_override():
  assert parse_override(" inner.dim = 3 ") == ("inner.dim", "3")
  assert parse_override("expr=a=b") == ("expr", "a=b")


def test_override_config_and_argv(tmp_path):
  assert override_config(NON_DEFAULT, ["batch_size=8"]) == dataclasses.replace(
      NON_DEFAULT, batch_size=8
  )
  path = save_config(NON_DEFAULT, tmp_path / "c.yaml")
  config = config_from_argv(Outer, [str(path), "batch_size=8"])
  assert config == dataclasses.replace(NON_DEFAULT, batch_size=8)
  assert config_from_argv(Outer, ["inner.dim=2"]).inner.dim == 2
  with pytest.raises(ValueError, match="at most one config file"):
    config_from_argv(Outer, [str(path), str(path)])


# ---- errors name the key -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["learning_rat=1e-6"], r"'learning_rat' for Outer\. Did you mean 'learning_rate'\?"),
        (["zzz=1"], r"Unknown config key 'zzz' for Outer\. Valid keys: name, learning_rate"),
        (["inner.dimm=3"], r"'inner\.dimm' for Inner\. Did you mean 'dim'\?"),
        (["sampling.temprature=1"], r"'sampling\.temprature' for Sampling\. Did you mean"),
        (["derived=3"], r"Unknown config key 'derived'"),
        (["batch_size=abc"], r"'batch_size' \(Outer\.batch_size\) in override 'batch_size=abc'"),
        (["batch_size=2.5"], r"'batch_size' \(Outer\.batch_size\).*'2\.5' into an int"),
        (["batch_size=1e2"], r"'batch_size' \(Outer\.batch_size\).*'1e2' into an int"),
        (["batch_size=true"], r"'batch_size'.*expected int, got True \(bool\)"),
        (["learning_rate=fast"], r"'learning_rate'.*'fast' into a float; expected float\.$"),
        (["use_lora=maybe"], r"'use_lora'.*'maybe' into a bool; expected bool\.$"),
        (["seeds=[1, x]"], r"'seeds'.*item 1: Couldn't parse 'x' into an int"),
        (["seeds=3"], r"'seeds'.*expected a list \(tuple\[int, \.\.\.\]\), got 3"),
        (["pair=[1]"], r"'pair'.*Expected 2 items, got 1; expected tuple\[int, float\]"),
        (["kind=sac"], r"'kind'.*'sac' .*into one of: ppo, grpo"),
        (["mode=medium"], r"'mode'.*'medium'.*expected Mode\.$"),
        (["target_kl=high"], r"'target_kl'.*'high' into a float; expected float \| None"),
        (["weights={a: x}"], r"'weights'.*item a: Couldn't parse 'x' into a float"),
        (["inner.dim=x"], r"'inner\.dim' \(Inner\.dim\).*'x' into an int; expected int\.$"),
        (["inner.dim=0"], r"Inner\.dim=0 is invalid"),
        (["inner={dimm: 2}"], r"'inner\.dimm' for Inner\. Did you mean 'dim'"),
        (["batch_size.x=1"], r"Outer\.batch_size has type int, not a nested config"),
        (["seeds=[1"], r"'seeds'.*cannot parse '\[1' as YAML"),
        (["no_equals_sign"], r"Invalid override 'no_equals_sign': write key=value"),
        (["=3"], r"Invalid override '=3'"),
        (["inner..dim=3"], r"Invalid override"),
    ],
)
def test_override_errors_name_the_key(overrides, pattern):
  with pytest.raises(ValueError, match=pattern):
    load_config(Outer, None, overrides)


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("learning_rat: 1e-6\n", r"Did you mean 'learning_rate'"),
        ("inner:\n  dim: x\n", r"'inner\.dim' \(Inner\.dim\): Couldn't parse 'x' into an int"),
        ("inner: 3\n", r"'inner' \(Outer\.inner\): expected a mapping of Inner fields, got 3"),
        ("sampling:\n  stop_token_ids: [1, b]\n",
         r"'sampling\.stop_token_ids\.1' \(Sampling\.stop_token_ids\): Couldn't parse 'b'"),
        ("name: 123\n", r"'name' \(Outer\.name\): expected str, got 123 \(int\)"),
        ("name: null\n", r"'name' \(Outer\.name\): expected str, got null"),
        ("batch_size: true\n", r"'batch_size' \(Outer\.batch_size\): expected int, got True"),
        ("sampling: [1]\n", r"'sampling'.*expected a mapping of Sampling fields, got \[1\]"),
        ("- 1\n- 2\n", r"must hold a mapping of field names, got list"),
    ],
)
def test_file_errors_name_the_key(tmp_path, text, pattern):
  path = tmp_path / "c.yaml"
  path.write_text(text)
  with pytest.raises(ValueError, match=pattern):
    load_config(Outer, path)


def test_unknown_keys_in_a_file_name_the_file(tmp_path):
  path = tmp_path / "c.yaml"
  path.write_text("inner:\n  dimm: 2\n")
  with pytest.raises(ValueError, match=rf"^Config file '{path}': Unknown config key 'inner\.dimm' "
                                       r"for Inner\. Did you mean 'dim'\?"):
    load_config(Outer, path)
  # An override that fixes nothing does not hide the file's mistake.
  with pytest.raises(ValueError, match="Config file .*'inner.dimm'"):
    load_config(Outer, path, ["inner.dim=3"])


def test_missing_required_key():
  with pytest.raises(ValueError, match=r"Required: Missing required field\(s\) `seed`"):
    load_config(Required)
  assert load_config(Required, None, ["seed=3"]) == Required(seed=3)


def test_file_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.yaml"):
    load_config(Outer, tmp_path / "nope.yaml")
  bad = tmp_path / "c.toml"
  bad.write_text("x = 1")
  with pytest.raises(ValueError, match="unsupported suffix '.toml'"):
    read_config_file(bad)
  with pytest.raises(ValueError, match="unsupported suffix '.txt'"):
    save_config(Outer(), tmp_path / "c.txt")
  with pytest.raises(TypeError, match="dataclass instance"):
    config_to_dict(Outer)
  with pytest.raises(TypeError, match="dataclass type"):
    config_from_dict(Outer(), {})


@pytest.mark.parametrize(
    "name, content, pattern",
    [
        ("c.yaml", b"seed: 1\ninner:\n  dim: 2\n   names: [a]\n",
         r"c.yaml', line 4, column 9: invalid YAML \(mapping values are not allowed here\)\.$"),
        ("c.yaml", b"seeds: [1, 2\nlr: 3\n",
         r"c.yaml', line 2, column 3: invalid YAML \(while parsing a flow sequence expected ',' "
         r"or '\]', but got ':'\)\.$"),
        ("c.yml", b"name: \"unterminated\n", r"c.yml', line 2, column 1: invalid YAML"),
        ("c.yaml", b"\tseed: 1\n", r"c.yaml', line 1, column 1: invalid YAML \(.*'\\t' that cannot "
         r"start any token\)"),
        ("c.json", b'{"seed": 1,\n  "lr": }\n',
         r"c.json', line 2, column 9: invalid JSON \(Expecting value\)\.$"),
        ("c.yaml", b"seed: 1\nname: caf\xe9\n", r"c.yaml', line 2, column 10: not valid UTF-8"),
    ],
)
def test_syntax_errors_give_file_line_and_column_in_one_line(tmp_path, name, content, pattern):
  path = tmp_path / name
  path.write_bytes(content)
  with pytest.raises(ValueError, match=pattern) as info:
    read_config_file(path)
  message = str(info.value)
  assert "\n" not in message and message.startswith(f"Config file '{path}'")
  assert info.value.__cause__ is None and info.value.__suppress_context__  # no chained traceback


# ---- the stage configs ---------------------------------------------------------------------------


def _stage_configs() -> list:
  """One non-default instance of every config a stage saves into its run folder."""
  from jax_ppo.models import LoRAConfig
  from jax_ppo.ppo.config import PPOConfig, PPOOptimizer, PPOSampling
  from jax_ppo.ppo.monitor import MonitorConfig
  from jax_ppo.quickstart.config import smoke
  from jax_ppo.reward_model import RewardModelConfig, RewardModelOptimizer
  from jax_ppo.rewards.specs import RewardSource
  from jax_ppo.runs.common import PPORunFolder, StageRunFolder
  from jax_ppo.runs.ppo_config import RunConfig
  from jax_ppo.runs.reward import RewardRunConfig
  from jax_ppo.runs.sft import SFTRunConfig
  from jax_ppo.sft import SFTConfig, SFTOptimizer

  return [
      RunConfig(
          policy_path="models/policy", prompts_path="data/prompts.jsonl", run_dir="runs/ppo",
          ppo=PPOConfig(optimizer=PPOOptimizer(learning_rate=3e-6),
                        sampling=PPOSampling(stop_token_ids=(2, 7)), target_kl=None),
          rewards=(RewardSource(model_path="runs/rm", weight=1.0),
                   RewardSource(function="length", weight=-0.1, name="len")),
          lora=LoRAConfig(rank=4, targets=("q", "v")), dtype="bfloat16", pad_token="<unk>",
          run=PPORunFolder(wandb_init={"project": "rlhf", "tags": ["a", "b"]}, updates_per_run=3),
          monitor=MonitorConfig(kl_threshold=0.2, kl_length_key=None),
      ),
      SFTRunConfig(model_path="m", train_path="sft.jsonl", run_dir="runs/sft",
                   run=StageRunFolder(steps_per_run=2),
                   sft=SFTConfig(optimizer=SFTOptimizer(learning_rate=1e-5), packing=True,
                                 total_steps=40),
                   lora=LoRAConfig(rank=2)),
      RewardRunConfig(model_path="m", train_path="prefs.json", run_dir="runs/rm",
                      policy_path="runs/sft/hf_model", normalise=False,
                      reward=RewardModelConfig(
                          batch_size=4, gradient_accumulation_steps=2,
                          optimizer=RewardModelOptimizer(max_grad_norm=None, learning_rate=3e-5))),
      smoke(seed=3, kl_coef=0.05),
  ]


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_every_stage_config_round_trips_through_its_run_folder_file(tmp_path, suffix):
  from jax_ppo.runs.ppo_config import RunConfig, load_run_config, saved_run_config

  for config in _stage_configs():
    path = save_config(config, tmp_path / f"{type(config).__name__}{suffix}")
    assert load_config(type(config), path) == config, type(config).__name__
    assert config_from_dict(type(config), json.loads(json.dumps(config_to_dict(config)))) == (
        config)
    if isinstance(config, RunConfig):
      assert load_run_config([str(path)]) == config
      save_config(config, tmp_path)
      assert saved_run_config(tmp_path) == config


@pytest.mark.parametrize(
    "text, overrides, pattern",
    [
        ("rewards: [{functoin: length}]\n", [],
         r"^Config file '.*': Unknown config key 'rewards\.0\.functoin' for RewardSource\. Did "
         r"you mean 'function'\?"),
        ("rewards: [{function: length, weight: heavy}]\n", [],
         r"^Config key 'rewards\.0\.weight' \(RewardSource\.weight\): Couldn't parse 'heavy' into "
         r"a float; expected float\.$"),
        ("rewards: [{weight: 1}]\n", [], r"^RewardSource needs exactly one of function"),
        ("reward_function: length\nlora: {rank: x}\n", [],
         r"^Config key 'lora\.rank' \(LoRAConfig\.rank\): Couldn't parse 'x' into an int; "
         r"expected int\.$"),
        ("reward_function: length\n", ["lora.rank=x"],
         r"^Config key 'lora\.rank' \(LoRAConfig\.rank\) in override 'lora\.rank=x': Couldn't "
         r"parse 'x' into an int; expected int\.$"),
        ("reward_function: length\n", ["lora.rnak=4"],
         r"^Unknown config key 'lora\.rnak' for LoRAConfig\. Did you mean 'rank'\?"),
        ("reward_function: length\n", ["rewards=[{function: length, weight: x}]"],
         r"^Config key 'rewards' \(RunConfig\.rewards\) in override .*: item 0\.weight: Couldn't "
         r"parse 'x' into a float; expected float\.$"),
        ("reward_function: length\n", ["monitor.kl_threshold=true"],
         r"^Config key 'monitor\.kl_threshold' \(MonitorConfig\.kl_threshold\) in override .*: "
         r"expected float, got True \(bool\)\.$"),
        ("reward_function: length\nppo: {batch_size: 0}\n", [], r"^PPOConfig\.batch_size=0 is "
         r"invalid"),
    ],
)
def test_stage_config_errors_are_one_line_naming_the_key(tmp_path, text, overrides, pattern):
  from jax_ppo.runs.ppo_config import RunConfig

  path = tmp_path / "run.yaml"
  path.write_text("policy_path: p\nprompts_path: q.txt\nrun_dir: r\n" + text)
  with pytest.raises(ValueError, match=pattern) as info:
    load_config(RunConfig, path, overrides)
  assert "\n" not in str(info.value)


# ---- resuming a run written by an older version --------------------------------------------------


def test_with_defaults_fills_in_what_an_older_version_did_not_save():
  saved = {"seed": 1, "gone": 3, "inner": {"dim": 2}, "sampling": {"temperature": 0.5}}
  filled = with_defaults(Outer, saved)
  assert filled["inner"] == {"dim": 2, "dropout": 0.0, "names": ["a"]}
  assert filled["sampling"] == {"temperature": 0.5, "stop_token_ids": []}
  assert filled["batch_size"] == 64 and filled["mode"] == "FAST" and filled["gone"] == 3
  assert "derived" not in filled and "seed" not in with_defaults(Required, {})  # no default
  assert saved == {"seed": 1, "gone": 3, "inner": {"dim": 2}, "sampling": {"temperature": 0.5}}


def test_a_missing_saved_field_at_todays_default_is_unchanged():
  from jax_ppo.checkpoint import CheckpointConfigMismatch, check_config
  from jax_ppo.runs.ppo_config import RunConfig

  config = _stage_configs()[0]
  saved = config_to_dict(config)
  del saved["resize_embeddings"], saved["ppo"]["clip_eps"], saved["lora"]["alpha"]  # added later
  del saved["rewards"][1]["weight"]
  assert with_defaults(RunConfig, saved)["rewards"][1] == {"function": "length", "model_path": None,
                                                           "weight": 1.0, "name": "len"}
  saved["rewards"][1]["weight"] = -0.1
  now = config_to_dict(config)
  check_config(saved, now, where="runs/ppo", config_type=RunConfig)
  with pytest.raises(CheckpointConfigMismatch):  # compared as plain dicts they differ
    check_config(saved, now, where="runs/ppo")
  # A value other than today's default is a change; so is a section the old run did not have.
  changed = dataclasses.replace(config, resize_embeddings=True)
  with pytest.raises(CheckpointConfigMismatch, match=r"resize_embeddings: saved False, now True"):
    check_config(saved, config_to_dict(changed), where="runs/ppo", config_type=RunConfig)
  del saved["lora"]
  with pytest.raises(CheckpointConfigMismatch, match=r"lora: saved None, now"):
    check_config(saved, now, where="runs/ppo", config_type=RunConfig)


def test_a_checkpoint_saved_before_a_field_was_added_resumes(tmp_path):
  import jax.numpy as jnp

  from jax_ppo.checkpoint import CheckpointConfigMismatch, RunCheckpointer

  old = config_to_dict(Outer())
  del old["use_lora"], old["inner"]["dropout"]  # fields this version added
  with RunCheckpointer(tmp_path, config=old, async_save=False) as ckpt:
    assert ckpt.save(1, {"w": jnp.zeros(2)})
  with RunCheckpointer(tmp_path, config=Outer(), async_save=False) as ckpt:
    assert ckpt.latest_step() == 1
  with pytest.raises(CheckpointConfigMismatch, match=r"use_lora: saved False, now True"):
    RunCheckpointer(tmp_path, config=Outer(use_lora=True), async_save=False)


def test_a_quickstart_folder_from_before_a_field_was_added_resumes(tmp_path):
  from jax_ppo.quickstart.config import smoke
  from jax_ppo.quickstart.pipeline import _check_config

  _check_config(smoke(), tmp_path)  # writes config.json
  record = json.loads((tmp_path / "config.json").read_text())
  del record["hack_pair_fraction"]  # as if written before the field existed
  (tmp_path / "config.json").write_text(json.dumps(record))
  _check_config(smoke(), tmp_path)
  with pytest.raises(ValueError, match=r"another configuration \(hack_pair_fraction: "):
    _check_config(smoke(hack_pair_fraction=0.5), tmp_path)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Block:
  rate: float = 0.1
  steps: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Stage:
  MOVED_KEYS: typing.ClassVar[dict[str, str]] = {"rate": "block.rate", "warmup": "block.steps"}
  block: _Block = dataclasses.field(default_factory=_Block)
  size: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Run:
  stage: _Stage = dataclasses.field(default_factory=_Stage)
  name: str = "r"


def test_moved_keys_are_one_error_naming_the_new_key_in_files_and_overrides(tmp_path):
  path = tmp_path / "run.yaml"
  path.write_text("stage:\n  rate: 0.5\n")
  with pytest.raises(ValueError, match=r"'stage.rate' has moved to 'stage.block.rate'"):
    load_config(_Run, path)
  with pytest.raises(ValueError, match=r"'stage.warmup' has moved to 'stage.block.steps'"):
    load_config(_Run, None, ["stage.warmup=3"])


def test_migrate_keys_moves_old_keys_of_a_saved_config_and_keeps_their_meaning():
  saved = {"stage": {"rate": 0.5, "warmup": 2, "size": 3}, "name": "x"}
  migrated = migrate_keys(_Run, saved)
  assert migrated == {"stage": {"block": {"rate": 0.5, "steps": 2}, "size": 3}, "name": "x"}
  assert saved["stage"]["rate"] == 0.5  # the input is not changed
  assert config_from_dict(_Run, migrated) == _Run(stage=_Stage(block=_Block(rate=0.5, steps=2),
                                                               size=3), name="x")
  assert with_defaults(_Run, saved)["stage"]["block"] == {"rate": 0.5, "steps": 2}
  with pytest.raises(ValueError, match="'rate' and 'block.rate' of _Stage are both given"):
    migrate_keys(_Run, {"stage": {"rate": 0.5, "block": {"rate": 0.2}}})


@dataclasses.dataclass(frozen=True, kw_only=True)
class _DocBlock:
  """A nested block.

  Attributes:
    size: how many (documented in the class docstring).
    name: a name that
      continues on the next line.
  """

  size: int = 2
  name: str = "x"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _DocBase:
  path: str
  """Where it is."""
  ratio: float = 0.5
  """Base text, replaced by the subclass's."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Documented(_DocBase):
  ratio: float = 0.5
  """The   ratio,
  over two lines."""
  low: int = 0
  high: int = 9
  """Bounds (both fields share this text)."""
  block: _DocBlock = dataclasses.field(default_factory=_DocBlock)
  """The block."""
  extra: _DocBlock | None = None
  """An optional block."""
  tags: tuple[str, ...] = ("a", "b: c")
  undocumented_last: bool = True


def test_field_docs_read_attribute_docstrings_and_attributes_sections():
  assert field_docs(_Documented) == {
      "path": "Where it is.", "ratio": "The ratio, over two lines.",
      "low": "Bounds (both fields share this text).",
      "high": "Bounds (both fields share this text).", "block": "The block.",
      "extra": "An optional block.", "tags": "", "undocumented_last": "",
  }
  assert field_docs(_DocBlock) == {"size": "how many (documented in the class docstring).",
                                "name": "a name that continues on the next line."}
  with pytest.raises(TypeError):
    field_docs(_DocBlock())


def test_documented_yaml_loads_back_with_docs_as_comments(tmp_path):
  config = _Documented(path="p", ratio=0.25, tags=("x", "y: z"))
  data = config_to_dict(config)
  text = documented_yaml(_Documented, data, commented=["path"], notes={"path": "REQUIRED."})
  assert "# REQUIRED.\n# Where it is.\n# path: p\n" in text
  assert "# The ratio, over two lines.\nratio: 0.25\n" in text
  assert "block:\n  # how many (documented in the class docstring).\n  size: 2\n" in text
  assert "extra: null\n# extra:  # to set it" in text and "#   size: 2" in text
  path = tmp_path / "c.yaml"
  path.write_text(text)
  assert load_config(_Documented, path, ["path=p"]) == config
  uncommented = text.replace("# path: p", "path: p")
  path.write_text(uncommented)
  assert load_config(_Documented, path) == config
  with pytest.raises(ValueError, match="Unknown config key 'bogus'"):
    documented_yaml(_Documented, {**data, "bogus": 1})
