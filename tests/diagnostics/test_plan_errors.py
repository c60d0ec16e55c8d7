"""`jax-ppo plan` without compiling anything (no libtpu needed): the one-line errors (libtpu
missing, its lock held by another process, an unknown topology, a program that does not
compile, a config of another stage), the datasheet table and the loop-trip arithmetic of
`jax_ppo.diagnostics.ppo_plan` and `jax_ppo.diagnostics.stage_plan`."""

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import topologies

from jax_ppo import cli
from jax_ppo.diagnostics import plan, ppo_plan, topology
from jax_ppo.parallel import chips
from jax_ppo.ppo.config import PPOConfig, PPOSampling


def _run_config(tmp_path):
  import transformers

  policy = tmp_path / "policy"
  transformers.Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=8, max_position_embeddings=64).save_pretrained(policy)
  path = tmp_path / "run.json"
  path.write_text(json.dumps({"policy_path": str(policy), "prompts_path": "prompts.txt",
                              "run_dir": str(tmp_path / "run"), "reward_function": "length"}))
  return str(path)


def test_missing_libtpu_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(topology, "libtpu_installed", lambda: False)
  with pytest.raises(topology.PlanError, match=r"pip install \"jax_ppo\[tpu\]\""):
    topology.tpu_devices("v5e:2x2")
  rc = cli.main(["plan", _run_config(tmp_path), "--topology", "v5e:2x2"])
  err = capsys.readouterr().err
  assert rc == 2 and err.count("\n") == 1
  assert "jax-ppo plan: error:" in err and "jax_ppo[tpu]" in err and "libtpu" in err


@pytest.mark.skipif(topology.libtpu_installed(), reason="libtpu is installed in this venv")
def test_this_environment_has_no_libtpu_and_says_so(tmp_path, capsys):
  assert cli.main(["plan", _run_config(tmp_path), "--topology", "v5e:2x4"]) == 2
  assert "jax_ppo[tpu]" in capsys.readouterr().err


def test_held_lock_names_the_lock_file(monkeypatch):
  def busy(**_):  # what libtpu raises when another process holds its lock
    raise RuntimeError("ABORTED: Internal error when accessing libtpu multi-process lockfile. "
                       'Run "$ sudo rm /tmp/libtpu_lockfile".')

  monkeypatch.setattr(topology, "libtpu_installed", lambda: True)
  monkeypatch.setattr(topologies, "get_topology_desc", busy)
  with pytest.raises(topology.PlanError) as e:
    topology.tpu_devices("v5e:2x2")
  assert "another process" in str(e.value) and "/tmp/libtpu_lockfile" in str(e.value)
  assert "sudo rm" not in str(e.value)  # removing the lock of a live process is not the fix


def test_unknown_topology_names_it(monkeypatch):
  def unknown(**_):
    raise RuntimeError('INVALID_ARGUMENT: Topology layout "v5e:9x9" is not divisible')

  monkeypatch.setattr(topology, "libtpu_installed", lambda: True)
  monkeypatch.setattr(topologies, "get_topology_desc", unknown)
  with pytest.raises(topology.PlanError, match=r"'v5e:9x9'.*not divisible"):
    topology.tpu_devices("v5e:9x9")


def test_a_program_that_does_not_compile_is_named_with_the_topology():
  def refuse(*_):
    raise RuntimeError("RESOURCE_EXHAUSTED: out of memory\nmore lines")

  with pytest.raises(plan.PlanError) as e:
    plan.compile_program("experience_update", plan.Program(refuse, ()), topology="v5e:2x4")
  assert str(e.value) == ("program 'experience_update' does not compile for TPU topology "
                          "'v5e:2x4': RESOURCE_EXHAUSTED: out of memory")


def test_a_program_planned_twice_compiles_once():
  """The advice's search and a slice's memory-then-costs plan compile the same programs again:
  the second time is the first's executable (the same program on the same topology only)."""
  import jax
  import jax.numpy as jnp

  compiles = []

  def lower(x):
    lowered = jax.jit(lambda a: jnp.tanh(a) @ a.T).lower(x)
    return type("Counted", (), {"as_text": lowered.as_text,
                                "compile": lambda _: compiles.append(1) or lowered.compile()})()

  def program(rows):
    return plan.Program(lower, (jax.ShapeDtypeStruct((rows, 8), jnp.float32),))

  first = plan.compile_program("a", program(4), topology="v5e:2x4")
  assert plan.compile_program("b", program(4), topology="v5e:2x4") is first
  assert len(compiles) == 1
  assert plan.compile_program("a", program(4), topology="v6e:2x4") is not first
  assert plan.compile_program("a", program(6), topology="v5e:2x4") is not first
  assert len(compiles) == 3
  assert first.memory_analysis() is not None


def test_plan_reads_every_model_and_refuses_split_placements(tmp_path):
  import dataclasses

  from jax_ppo.parallel.mesh import MeshConfig
  from jax_ppo.parallel.placement import PlacementConfig, RoleMesh
  from jax_ppo.runs.ppo_config import load_run_config

  config = load_run_config([_run_config(tmp_path), "reward_function=null",
                            f"reward_model_path={tmp_path / 'policy'}"])
  shape = ppo_plan.run_shape(config, prompt_length=100)
  # GAE with a reward model of the policy's vocabulary: the critic starts as its copy
  assert shape.reward_models == (shape.model,) and shape.critic == shape.model
  grpo = ppo_plan.run_shape(load_run_config([_run_config(tmp_path), "reward_function=null",
                                             f"reward_model_path={tmp_path / 'policy'}",
                                             "ppo.advantage_mode=grpo", "ppo.n_samples=2"]),
                                 prompt_length=100)
  assert grpo.critic is None and len(grpo.reward_models) == 1
  split = dataclasses.replace(config, mesh=MeshConfig(),
                              placement=PlacementConfig(reference=RoleMesh(devices=(2, 4))))
  with pytest.raises(plan.PlanError, match="placement"):
    ppo_plan.run_shape(split, prompt_length=100)
  shape = ppo_plan.run_shape(load_run_config([_run_config(tmp_path)]), prompt_length=100)
  assert shape.prompt_length == 128 and shape.model.num_layers == 1  # bucketed; config.json
  assert shape.reward_models == () and shape.critic is None  # a function; the value head


def test_datasheet_rows_and_roofline():
  for kind, name in (("TPU v5 lite", "TPU v5 lite"), ("TPU v5", "TPU v5p"),
                     ("TPU v6 lite", "TPU v6 lite"), ("NVIDIA H100 80GB HBM3", "H100"),
                     ("NVIDIA H200", "H200"), ("NVIDIA H100 PCIe", "H100 PCIe")):
    assert chips.chip_for(kind).name == name
  assert chips.chip_for("cpu") is None
  v5e = chips.chip_for("TPU v5 lite")
  assert v5e.hbm_bytes == 16 * 2**30 and v5e.bf16_flops == 197e12
  # 1.97 TFLOP at 197 TFLOP/s is 10 ms; 8.19 GB at 819 GB/s is 10 ms too: the larger wins.
  assert chips.roofline_seconds(1.97e12, 1e9, v5e, dtype="bfloat16") == pytest.approx(0.01)
  assert chips.roofline_seconds(1e9, 8.19e9, v5e, dtype="bfloat16") == pytest.approx(0.01)
  assert chips.roofline_seconds(1.97e12, 0, v5e, dtype="float32") == pytest.approx(0.03)


def test_loop_trips_are_counted_back():
  cost = lambda f: plan.Cost(f, 10 * f)  # noqa: E731
  # The sampler's 4 decode loops (steps 1 .. 15: 4, 4, 4 and 3 steps), each step its own cost.
  decode = {ppo_plan.decode_piece(k): cost(7 + k) for k in range(4)}
  xla = {"generate": cost(100), **decode, "experience": cost(50),
         "update": cost(1000), "microbatch_grad": cost(300), "optimizer_step": cost(20)}
  ppo = PPOConfig(batch_size=8, sampling=PPOSampling(max_new_tokens=16), ppo_epochs=3,
                  num_minibatches=2, gradient_accumulation_steps=2)
  out = ppo_plan.loop_corrected(xla, ppo, max_new_tokens=16)
  # the XLA count holds one step of each decode loop, one microbatch gradient and one optimizer
  # step
  assert out["generate"] == cost(100 + 3 * 7 + 3 * 8 + 3 * 9 + 2 * 10)
  assert set(out) == {"generate", "experience", "update"}
  assert out["update"] == cost(1000 + (3 * 2 * 2 - 1) * 300 + (3 * 2 - 1) * 20)
  assert out["experience"] == cost(50)
  fused = ppo_plan.loop_corrected({**xla, "experience_update": cost(900)},
                              PPOConfig(batch_size=8, ppo_epochs=4), max_new_tokens=16)
  assert fused["experience_update"] == cost(900 + 2 * 320)


def _stage_config(tmp_path, name: str, data: dict) -> str:
  path = tmp_path / f"{name}.json"
  path.write_text(json.dumps(data))
  return str(path)


def test_a_config_of_another_kind_is_one_line_naming_its_stage(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(topology, "libtpu_installed", lambda: True)  # checked before the config
  offline = {"model_path": "m", "train_path": "t.jsonl", "run_dir": "r"}
  sft = _stage_config(tmp_path, "sft", {**offline, "sft": {"max_length": 64}})
  ppo = _run_config(tmp_path)
  for argv, stage, says in (
      ([sft], None, "it is a `jax-ppo sft` config (SFTRunConfig; give --stage sft)"),
      ([ppo], "reward", "it is a `jax-ppo train` config (RunConfig; give --stage ppo)"),
      ([_stage_config(tmp_path, "both", offline)], "ppo",
       "--stage sft) or a `jax-ppo reward` config (RewardRunConfig; give --stage reward)"),
      ([sft, "reward.batch_size=4"], "sft", "no stage's config has all of its keys"),
  ):
    rc = cli.main(["plan", *argv, "--topology", "v5e:2x2",
                   *(["--stage", stage] if stage else [])])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("jax-ppo plan: error: the config is not a `jax-ppo"), err
    assert says in err, err
  rc = cli.main(["plan", sft, "--stage", "sft", "--topology", "v5e:2x2", "--prompt-length", "64"])
  err = capsys.readouterr().err
  assert rc == 2 and err.count("\n") == 1
  assert "--prompt-length is for PPO plans" in err and "sft.max_length" in err


def test_stages_that_fit_a_config(tmp_path):
  from jax_ppo.runs import stages

  offline = {"model_path": "m", "train_path": "t.jsonl", "run_dir": "r"}
  assert stages.stages_fitting([_stage_config(tmp_path, "a", offline)]) == ("sft", "reward")
  assert stages.stages_fitting([_stage_config(tmp_path, "b", offline), "normalise=false"]) == (
      "reward",)
  assert stages.stages_fitting([_run_config(tmp_path)]) == ("ppo",)
  # an old flat key a config still accepts (and refuses naming its new place) counts as its own
  assert "sft" in stages.stages_fitting([_stage_config(tmp_path, "c", offline),
                                         "save_every=5"])
  with pytest.raises(ValueError, match="unknown"):
    stages.check_stage("dpo", [])


def test_stage_shape_reads_the_stage_config(tmp_path):
  from jax_ppo.diagnostics import stage_plan
  from jax_ppo.runs.reward import load_reward_config
  from jax_ppo.runs.sft import load_sft_config

  model = str(pathlib.Path(_run_config(tmp_path)).parent / "policy")
  offline = [f"model_path={model}", "train_path=t.jsonl", "run_dir=r", "dtype=bfloat16"]
  sft = stage_plan.stage_shape(load_sft_config([*offline, "sft.max_length=64",
                                                "mesh.fsdp=-1", "mesh.data=1"]))
  assert (sft.stage, sft.model.num_layers, sft.config.max_length, sft.dtype, sft.lora) == (
      "sft", 1, 64, "bfloat16", None)
  assert sft.mesh.fsdp == -1
  common = stage_plan.stage_shape(load_sft_config(["model_path=shape:qwen3-0.6b",
                                                   *offline[1:]]))
  assert common.model.num_layers == 28  # a common model's architecture, nothing downloaded
  reward = stage_plan.stage_shape(load_reward_config([*offline, "lora.rank=4"]))
  assert reward.stage == "reward" and reward.lora.rank == 4
  with pytest.raises(ValueError, match="SFTConfig or a RewardModelConfig"):
    stage_plan.StageShape(model=sft.model, config=PPOConfig())
  with pytest.raises(FileNotFoundError, match="SFTRunConfig.model_path"):
    stage_plan.stage_shape(load_sft_config(["model_path=nowhere", "train_path=t.jsonl",
                                            "run_dir=r"]))


def test_stage_accumulation_trips_are_counted_back():
  from jax_ppo.diagnostics import stage_plan

  cost = lambda f: plan.Cost(f, 10 * f)  # noqa: E731
  xla = {"train_step": cost(100), "eval_step": cost(40), "microbatch_grad": cost(30)}
  # the XLA count of the accumulation scan holds one microbatch gradient
  assert stage_plan.loop_corrected(xla, accumulation_steps=4) == {
      "train_step": cost(100 + 3 * 30), "eval_step": cost(40)}
  assert stage_plan.loop_corrected({"train_step": cost(100), "eval_step": cost(40)},
                                   accumulation_steps=1) == {
      "train_step": cost(100), "eval_step": cost(40)}


def test_only_loop_bodies_with_trips_are_compiled():
  """One epoch of one minibatch (the fused program) leaves no optimizer or gradient trips to
  count back: only the decode loops' steps are compiled alone."""
  fused = PPOConfig(batch_size=8, ppo_epochs=1)
  trips = ppo_plan.loop_trips(fused, ["generate", "experience_update", "score"],
                              max_new_tokens=16)
  assert trips == {"generate": {"decode_step_0": 3, "decode_step_1": 3, "decode_step_2": 3,
                                "decode_step_3": 2},
                   "experience_update": {}, "score": {}}
  # 3 decode steps in 4 loops: 3 loops of one step, each counted by XLA once.
  assert ppo_plan.loop_trips(fused, ["generate"], max_new_tokens=4) == {"generate": {}}
  split = PPOConfig(batch_size=8, ppo_epochs=1, gradient_accumulation_steps=4)
  assert ppo_plan.loop_trips(split, ["update"], max_new_tokens=16) == {
      "update": {"microbatch_grad": 3}}


def test_out_of_memory_is_does_not_fit_with_what_xla_asked_for():
  def refuse(*_):
    raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required "
                       "for HLO temporaries (134.16G) exceeds available HBM (95.74G).")

  with pytest.raises(plan.DoesNotFit) as e:
    plan.compile_program("update", plan.Program(refuse, ()), topology="v5p:2x2x1")
  assert e.value.required_bytes == int(134.16 * 2**30) and e.value.temporaries_only
  assert str(e.value).startswith("program 'update' does not compile for TPU topology 'v5p:2x2x1'")


@pytest.mark.parametrize("message, expected", [
    # XLA's figure counts the temporaries alone: the arguments (4 KiB per chip) and the resident
    # arrays the program does not take (100 bytes) come on top.
    ("the total memory required for HLO temporaries (16.19G) exceeds available HBM (15.75G).",
     int(16.19 * 2**30) + 4096 + 100),
    # A figure that is not the temporaries': only the resident arrays come on top.
    ("the total memory required for the program (20.5G) exceeds available HBM (15.75G).",
     int(20.5 * 2**30) + 100),
    ("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm.", sys.maxsize),
])
def test_a_refused_program_peaks_at_least_what_xla_asked_for_and_its_arguments(message, expected):
  def refuse(*_):
    raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, " + message)

  mesh = jax.sharding.Mesh(jax.devices()[:1], ("fsdp",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  arg = jax.ShapeDtypeStruct((1024,), jnp.float32, sharding=sharding)
  program = plan.Program(refuse, (arg,), outside_bytes=100)
  assert plan.program_peaks({"update": program}, topology="v5e:8x8") == {"update": expected}


def _affine_costs(shape, refuse_above: int):
  """Costs affine in the rows (`batch_size` b): flops 3b + 7, bytes 5b + 100 for `experience`,
  constant for `optimizer_step`; refused (`DoesNotFit`) above `refuse_above` rows."""
  b = shape.ppo.batch_size
  if b > refuse_above:
    raise plan.DoesNotFit(f"program 'experience' needs more HBM at {b} rows", None)
  return {"experience": plan.Cost(3.0 * b + 7, 5.0 * b + 100),
          "optimizer_step": plan.Cost(11.0, 13.0)}


@pytest.mark.parametrize("refuse_above,divisors", [(32, [2, 4]), (16, [2, 4, 8]),
                                                   (8, [2, 4, 8, 16])])
def test_cost_variants_refused_at_full_rows_are_extrapolated_from_fewer(refuse_above, divisors):
  import dataclasses

  full = ppo_plan.RunShape(model=None, ppo=PPOConfig(batch_size=64))
  tried = []

  def shape_at(k):
    tried.append(k)
    return dataclasses.replace(full, ppo=dataclasses.replace(full.ppo, batch_size=64 // k))

  costs, k = plan.row_extrapolated_costs(lambda s: _affine_costs(s, refuse_above), shape_at)
  assert k == divisors[-1]
  assert costs["experience"] == plan.Cost(3.0 * 64 + 7, 5.0 * 64 + 100)  # exact for affine
  assert costs["optimizer_step"] == plan.Cost(11.0, 13.0)
  assert tried == divisors  # the largest two fractions that compile
  with pytest.raises(plan.DoesNotFit, match="needs more HBM at 4 rows"):
    plan.row_extrapolated_costs(lambda s: _affine_costs(s, 2), shape_at)
  with pytest.raises(plan.DoesNotFit, match="do not divide"):
    plan.row_extrapolated_costs(lambda s: _affine_costs(s, 2), lambda k: None)


def test_rows_divided_keeps_the_loop_trips_and_refuses_what_does_not_divide():
  shape = ppo_plan.RunShape(model=None, ppo=PPOConfig(
      batch_size=64, n_samples=8, advantage_mode="grpo", num_minibatches=2,
      gradient_accumulation_steps=2))
  half = ppo_plan.rows_divided(shape, 2, row_shards=4)
  assert (half.ppo.batch_size, half.ppo.microbatch_size, half.ppo.prompts_per_update) == (
      32, 8, 4)
  assert (half.ppo.num_minibatches, half.ppo.gradient_accumulation_steps) == (2, 2)
  assert ppo_plan.rows_divided(shape, 16, row_shards=1) is None  # 4 rows: not groups of 8
  assert ppo_plan.rows_divided(shape, 4, row_shards=8) is None  # microbatch of 4 over 8 chips
  assert ppo_plan.rows_divided(shape, 3, row_shards=1) is None


def test_a_plan_whose_cost_variants_are_refused_gets_costs_from_fewer_rows(monkeypatch):
  """`plan_run`'s costs: the variants at the full rows are refused, those at 1/2 and 1/4
  compile: the loop-corrected costs are those of the full rows; refused at every fraction, the
  plan has no costs (and still its memory and fit)."""
  from types import SimpleNamespace

  refuse_above = [32]
  monkeypatch.setattr(ppo_plan, "layer_costs",
                      lambda s, mesh, topology, only=None: _affine_costs(s, refuse_above[0]))
  monkeypatch.setattr(ppo_plan, "batch_axis_size", lambda mesh: 4)
  run = SimpleNamespace(sampling=SimpleNamespace(max_new_tokens=8))
  seen = {}

  def plan_programs(*args, costs, **kwargs):  # what compile_plan does with the costs
    seen["costs"] = costs(run, None)
    program = plan.ProgramPlan(argument_bytes=1, output_bytes=0, alias_bytes=0, temp_bytes=0,
                               outside_bytes=0, flops=None, bytes_accessed=None,
                               xla_flops=None, xla_bytes_accessed=None, roofline_s=None)
    return plan.Plan(topology="v5e:2x2", chip="v5e", chips=4, hosts=1, hbm_per_chip_bytes=1,
                     mesh={}, dtype="bfloat16", resident_bytes_per_chip={},
                     programs={"experience": program})

  monkeypatch.setattr(ppo_plan, "plan_programs", plan_programs)
  shape = ppo_plan.RunShape(model=None, ppo=PPOConfig(batch_size=64))
  result = ppo_plan.plan_run(shape, "v5e:2x2", devices=[0, 1, 2, 3])
  expected = ppo_plan.loop_corrected(_affine_costs(shape, 64), shape.ppo, max_new_tokens=8)
  assert seen["costs"] == expected
  assert result.costs_rows_divisor == 4 and result.to_json()["costs_rows_divisor"] == 4
  assert "1/4 and 2/4 of its rows" in plan.format_plan(result)
  refuse_above[0] = 1
  result = ppo_plan.plan_run(shape, "v5e:2x2", devices=[0, 1, 2, 3])
  assert seen["costs"] is None and result.costs_rows_divisor is None
  refuse_above[0] = 64  # compiled at its rows
  assert ppo_plan.plan_run(shape, "v5e:2x2", devices=[0, 1, 2, 3]).costs_rows_divisor is None
