"""`jax-ppo plan` for NVIDIA GPU nodes, compiled on this CPU host by JAX's CUDA plugin: the
devices of one and of two nodes, the plan's bytes per GPU against arithmetic, FSDP across two
nodes, a plan without costs (XLA's GPU compiler has no cost analysis without a GPU), and the
cost variants a GPU plans its costs from compiling for one.

Needs the CUDA plugin (the `jax_ppo[plan-gpu]` extra), which the main test environment does not
have: `.ci/run` runs this file in the plans' virtual environment, beside the TPU plans' tests.
"""

import dataclasses
import json

import pytest

from jax_ppo.diagnostics import gpu_topology
from jax_ppo.diagnostics.gpu_topology import cuda_plugin_installed, gpu_devices

if not cuda_plugin_installed():
  pytest.skip("needs the jax_ppo[plan-gpu] extra (JAX's CUDA plugin); see .ci/run",
              allow_module_level=True)

from tiny_plan_run import param_count, write_run  # noqa: E402

from jax_ppo import cli  # noqa: E402
from jax_ppo.diagnostics import plan as plan_lib  # noqa: E402
from jax_ppo.diagnostics import ppo_plan  # noqa: E402
from jax_ppo.parallel.mesh import MeshConfig, make_mesh  # noqa: E402
from jax_ppo.runs.ppo_config import load_run_config  # noqa: E402

L = 2  # the policy's layers
GiB = 2**30


@pytest.fixture(scope="module")
def run_json(tmp_path_factory):
  return write_run(tmp_path_factory.mktemp("gpu_plan"), L)


@pytest.fixture(scope="module")
def replicated(run_json):
  """The CLI's JSON for the run on one node of 4 H100s, data parallel (parameters replicated)."""
  out = run_json.parent / "plan.json"
  assert cli.main(["plan", str(run_json), "--topology", "h100:4", "--prompt-length", "16",
                   "--json", str(out)]) == 0
  return json.loads(out.read_text())


def test_one_and_two_nodes_of_devices():
  one, two = gpu_devices("h100:8"), gpu_devices("h200:2x8")
  assert len(one) == 8 and {d.process_index for d in one} == {0}
  assert one[0].device_kind == "NVIDIA H100 80GB HBM3"
  assert len(two) == 16 and sorted({d.process_index for d in two}) == [0, 1]
  assert two[0].device_kind == "NVIDIA H200"


def test_replicated_plan_per_gpu(replicated, capsys):
  assert (replicated["topology"], replicated["chip"], replicated["chips"],
          replicated["hosts"]) == ("h100:4", "H100", 4, 1)
  assert replicated["hbm_per_chip_bytes"] == 80 * GiB and replicated["fits"] is True
  # judged against JAX's allocator's share of the card (75% unless the environment says)
  fraction = replicated["memory_fraction"]
  assert fraction == gpu_topology.allocator_fraction()
  assert replicated["usable_bytes_per_chip"] == int(fraction * 80 * GiB)
  resident = replicated["resident_bytes_per_chip"]
  assert resident["params"] == param_count(L) * 4  # float32 masters on every GPU
  assert 2 * resident["params"] <= resident["optimizer"] < 2 * resident["params"] + 1024
  assert set(replicated["programs"]) == {"generate", "experience_update"}
  for name, p in replicated["programs"].items():
    assert p["peak_bytes_per_chip"] == (p["argument_bytes"] + p["output_bytes"]
                                        - p["alias_bytes"] + p["temp_bytes"]
                                        + p["outside_bytes"]), name
    assert p["argument_bytes"] >= resident["params"], name
    # no cost analysis without a GPU: no FLOPs, bytes or roofline time, rather than zeros
    assert p["flops"] is p["bytes_accessed"] is p["roofline_s"] is None, name
  # the update takes every resident array (reference included); the sampler the policy alone
  assert replicated["programs"]["experience_update"]["argument_bytes"] >= sum(resident.values())
  assert replicated["programs"]["generate"]["outside_bytes"] == (resident["optimizer"]
                                                                 + resident["reference"])


def test_fsdp_across_two_nodes_keeps_a_quarter_per_gpu(run_json, replicated):
  config = load_run_config([str(run_json), "mesh.data=1", "mesh.fsdp=4"])
  plan = ppo_plan.plan_run(ppo_plan.run_shape(config, prompt_length=16), "h200:2x2")
  assert (plan.chips, plan.hosts, plan.chip, plan.fits) == (4, 2, "H200", True)
  assert plan.hbm_per_chip_bytes == 141 * GiB
  rep = replicated["resident_bytes_per_chip"]
  for part in ("params", "optimizer", "reference"):
    # norm gains and the value head stay replicated: a little over a quarter
    assert rep[part] / 4 <= plan.resident_bytes_per_chip[part] < 1.05 * rep[part] / 4, part
  text = plan_lib.format_plan(plan)
  assert "h200:2x2: 4 x H200 on 2 host(s)" in text and "fits: yes" in text


def test_a_run_over_the_allocators_share_is_advised_to_raise_it(run_json, monkeypatch):
  """With JAX's allocator given almost nothing of the card, the run does not fit, and the first
  advice is the variable that raises the share (the programs, compiled once, do not change)."""
  monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "1e-6")
  config = load_run_config([str(run_json)])
  plan = ppo_plan.plan_run(ppo_plan.run_shape(config, prompt_length=16), "h100:4")
  assert plan.memory_fraction == 1e-6 and plan.fits is False
  assert [a["change"] for a in plan.advice] == [["XLA_CLIENT_MEM_FRACTION=0.95"]]
  assert plan.advice[0]["fits"] is True
  assert "advice: XLA_CLIENT_MEM_FRACTION=0.95" in plan_lib.format_plan(plan)


def test_the_cost_variants_compile_for_a_gpu(run_json, monkeypatch):
  """On a GPU, costs come from variants of the run's programs (`ppo_plan.layer_costs`: 1 and 2
  unrolled layers, every decode loop's step at full depth, one microbatch's gradient, one
  optimizer step), as experiments/benchmarks/ppo_roofline.py takes them on the card: each
  compiles for a GPU, here with a reward model and a separate critic as that benchmark's run.
  Without a GPU there is no cost analysis, so a unit cost stands in for each compiled one."""
  # 4 epochs, as the benchmark's: the fused update's later epochs add a microbatch's gradient
  # and an optimizer step per trip beyond XLA's one (`ppo_plan.loop_trips`)
  config = load_run_config([str(run_json), "ppo.ppo_epochs=4"])
  shape = ppo_plan.run_shape(config, prompt_length=16)
  shape = dataclasses.replace(shape, reward_models=(shape.model,), critic=shape.model)
  compiled = []

  def unit_cost(executable):
    assert executable.cost_analysis() in (None, {}, [], [{}])  # no cost analysis without a GPU
    compiled.append(executable.memory_analysis().temp_size_in_bytes)
    return plan_lib.Cost(1.0, 1.0)

  monkeypatch.setattr(plan_lib, "xla_cost", unit_cost)
  monkeypatch.setattr(ppo_plan, "xla_cost", unit_cost)
  mesh = make_mesh(MeshConfig(), devices=gpu_devices("h100:1"))
  costs = ppo_plan.layer_costs(shape, mesh, topology="h100:1")
  decode = [n for n in costs if n.startswith("decode_step_")]
  assert set(costs) == {"generate", "score", "experience_update", "microbatch_grad",
                        "optimizer_step", *decode} and decode
  # the programs and the update's pieces at 1 layer, again at 2 (every model has the policy's 2
  # layers); each decode step once, at full depth
  assert len(compiled) == 2 * (len(costs) - len(decode)) + len(decode)
  assert all(c == plan_lib.Cost(1.0, 1.0) for c in costs.values())
