"""`jax-ppo plan --stage sft|reward` for a real TPU slice (v5e:2x2, compiled on this CPU host by
libtpu): the plans' numbers against arithmetic, and their loop-corrected train-step FLOPs against
steps unrolled by hand.

Needs libtpu (the `jax_ppo[tpu]` extra), which the main test environment does not have: `.ci/run`
runs this file with test_plan.py, in one process, in a second virtual environment. Only one
process at a time may load libtpu on a host (its lock file), so never run it with several pytest
workers.
"""

import contextlib
import io
import json

import pytest

pytest.importorskip("libtpu", reason="needs the jax_ppo[tpu] extra (libtpu); see .ci/run")

import jax  # noqa: E402

from jax_ppo import cli  # noqa: E402
from jax_ppo.diagnostics import plan as plan_lib  # noqa: E402
from jax_ppo.diagnostics import stage_plan  # noqa: E402
from jax_ppo.diagnostics.topology import slice_mesh, tpu_devices  # noqa: E402
from jax_ppo.models import LoRAConfig  # noqa: E402
from jax_ppo.parallel.chips import chip_for  # noqa: E402
from jax_ppo.parallel.jit import MeshJit  # noqa: E402
from jax_ppo.parallel.mesh import MeshConfig  # noqa: E402
from jax_ppo.runs.stages import load_stage_run_config  # noqa: E402
from jax_ppo.sft.config import SFTConfig  # noqa: E402
from jax_ppo.training.state import apply_gradients  # noqa: E402

TOPOLOGY = "v5e:2x2"  # one host, 4 chips
L, D, F, V, H, K, DH = 2, 64, 128, 256, 4, 2, 16
RANK = 4
# 2 microbatches of 4 rows (SFT) or 4 pairs (reward): at least one row per chip
SFT = {"batch_size": 8, "gradient_accumulation_steps": 2, "max_length": 32}
REWARD = {"batch_size": 8, "gradient_accumulation_steps": 2, "max_length": 32,
          "eval_batch_size": 8}


def layer_count() -> int:
  """Qwen3 layer parameters by hand: q, k, v, o projections, the gated MLP, two norms and the
  q/k norms."""
  return D * H * DH + 2 * D * K * DH + H * DH * D + 3 * D * F + 2 * D + 2 * DH


def sft_param_count() -> int:
  """A causal LM with untied embeddings: embedding, layers, final norm, LM head."""
  return 2 * V * D + L * layer_count() + D


def trunk_param_count() -> int:
  """The reward model's trunk: embedding, layers, final norm (no LM head)."""
  return V * D + L * layer_count() + D


def lora_count() -> int:
  """Rank-`RANK` adapters `A [in, r]`, `B [r, out]` on q, k, v, o of every layer."""
  return L * RANK * ((D + H * DH) + 2 * (D + K * DH) + (H * DH + D))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
  import transformers

  root = tmp_path_factory.mktemp("stage_plan")
  transformers.Qwen3Config(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
                           num_attention_heads=H, num_key_value_heads=K, head_dim=DH,
                           max_position_embeddings=256,
                           tie_word_embeddings=False).save_pretrained(root / "model")
  common = {"model_path": str(root / "model"), "train_path": "data.jsonl",
            "mesh": {"data": 4}}
  (root / "sft.json").write_text(json.dumps({**common, "run_dir": str(root / "sft"),
                                             "sft": SFT}))
  (root / "reward.json").write_text(json.dumps({
      **common, "run_dir": str(root / "rm"), "reward": REWARD,
      "lora": {"rank": RANK, "targets": ["q", "k", "v", "o"]}}))
  return root


def _cli_plan(root, stage: str) -> tuple[dict, str]:
  """`jax-ppo plan --stage STAGE`: its JSON and the table it printed."""
  out, table = root / f"{stage}_plan.json", io.StringIO()
  with contextlib.redirect_stdout(table):
    rc = cli.main(["plan", str(root / f"{stage}.json"), "--stage", stage, "--topology",
                   TOPOLOGY, "--json", str(out)])
  assert rc == 0
  return json.loads(out.read_text()), table.getvalue()


@pytest.fixture(scope="module")
def sft_run(root):
  """The CLI's JSON and table for the SFT run, data parallel over the 4 chips (parameters
  replicated)."""
  return _cli_plan(root, "sft")


@pytest.fixture(scope="module")
def sft_plan(sft_run):
  return sft_run[0]


@pytest.fixture(scope="module")
def reward_plan(root):
  """The CLI's JSON for the LoRA reward-model run, data parallel over the 4 chips."""
  return _cli_plan(root, "reward")[0]


def _mesh(shape):
  return slice_mesh(tpu_devices(TOPOLOGY), shape.mesh, topology=TOPOLOGY)


def _shape(root, stage):
  return stage_plan.stage_shape(load_stage_run_config(stage, [str(root / f"{stage}.json")]))


def test_cli_json_layout_and_table(sft_run):
  sft_plan, table = sft_run
  assert (sft_plan["topology"], sft_plan["chip"], sft_plan["chips"],
          sft_plan["hosts"]) == (TOPOLOGY, "TPU v5 lite", 4, 1)
  assert sft_plan["hbm_per_chip_bytes"] == 16 * 2**30
  assert sft_plan["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
  assert set(sft_plan["resident_bytes_per_chip"]) == {"params", "optimizer", "frozen"}
  assert set(sft_plan["programs"]) == {"train_step", "eval_step"}
  chip = chip_for("TPU v5 lite")
  assert sft_plan["fits"] is True
  for p in sft_plan["programs"].values():
    assert p["peak_bytes_per_chip"] == (p["argument_bytes"] + p["output_bytes"]
                                        - p["alias_bytes"] + p["temp_bytes"]
                                        + p["outside_bytes"])
    assert p["roofline_s"] == pytest.approx(max(p["flops"] / chip.fp32_flops,
                                                p["bytes_accessed"] / chip.hbm_bytes_s))
    assert p["flops"] > p["xla_flops"]  # the scanned layers (and microbatches) counted back
  assert "train_step" in table and "eval_step" in table and "fits: yes" in table


def test_replicated_sft_parameter_bytes_are_the_parameter_count_times_four(sft_plan):
  resident = sft_plan["resident_bytes_per_chip"]
  assert resident["params"] == sft_param_count() * 4  # float32 masters on every chip
  assert resident["frozen"] == 0  # a full fine-tune: everything trains
  # Adam's two moments, plus a few scalars (its step count, the clip's state, the step counter)
  assert 2 * resident["params"] <= resident["optimizer"] < 2 * resident["params"] + 1024
  train, evaluate = sft_plan["programs"]["train_step"], sft_plan["programs"]["eval_step"]
  assert train["argument_bytes"] >= resident["params"] + resident["optimizer"]
  assert train["outside_bytes"] == 0
  assert train["alias_bytes"] >= resident["params"] + 2 * resident["params"]  # state donated
  assert evaluate["outside_bytes"] == resident["optimizer"]
  assert resident["params"] <= evaluate["argument_bytes"] < train["argument_bytes"]


def test_fsdp_keeps_a_quarter_of_the_bytes_per_chip(root, sft_plan):
  import dataclasses

  shape = dataclasses.replace(_shape(root, "sft"), mesh=MeshConfig(data=1, fsdp=4))
  split = stage_plan.StagePrograms(shape, _mesh(shape)).resident_bytes
  rep = sft_plan["resident_bytes_per_chip"]
  for part in ("params", "optimizer"):
    # the norm gains stay replicated: a little over a quarter
    assert rep[part] / 4 <= split[part] < 1.05 * rep[part] / 4, part


def _compiled_flops(fn, mesh, roles, args):
  return plan_lib.xla_cost(MeshJit(fn, mesh, **roles, keep_unused=True).lower(*args)
                           .compile()).flops


def test_corrected_sft_train_step_flops_match_a_step_unrolled_by_hand(root, sft_plan):
  """Microbatches and layers as Python loops: the XLA count of that program is the truth the
  loop correction must reproduce."""
  shape = _shape(root, "sft")
  run = stage_plan.StagePrograms(shape, _mesh(shape), scan_layers=False)
  c, steps = shape.config, run.steps
  assert isinstance(c, SFTConfig)
  state, rest, batch = run.programs()["train_step"].args
  grad = jax.value_and_grad(steps.micro_loss)

  def unrolled(state, rest, batch):
    n = jax.numpy.sum(batch.loss_mask)
    size = c.batch_size // c.gradient_accumulation_steps
    loss = grads = None
    for a in range(c.gradient_accumulation_steps):
      micro = jax.tree.map(lambda x, s=a * size: x[s:s + size], batch)
      part, g = grad(state.params, rest, micro, n)
      loss = part if loss is None else loss + part
      grads = g if grads is None else jax.tree.map(lambda u, v: u + v, grads, g)
    return apply_gradients(state, steps.optimizer, grads, loss=loss)[0]

  truth = _compiled_flops(unrolled, run.mesh, dict(in_roles=("params", "params", "batch"),
                                                   out_roles="params"), (state, rest, batch))
  train = sft_plan["programs"]["train_step"]
  assert train["flops"] == pytest.approx(truth, rel=0.03)
  assert train["xla_flops"] < truth / 1.5  # what XLA says of the scans


def test_lora_reward_plan_holds_the_base_frozen_and_trains_the_adapters(root, reward_plan):
  assert _shape(root, "reward").lora == LoRAConfig(rank=RANK, targets=("q", "k", "v", "o"))
  resident = reward_plan["resident_bytes_per_chip"]
  assert set(reward_plan["programs"]) == {"train_step", "eval_step"}
  assert resident["frozen"] == trunk_param_count() * 4  # the base weights, replicated
  assert resident["params"] == (lora_count() + D + 1) * 4  # adapters and the new score head
  assert 2 * resident["params"] <= resident["optimizer"] < 2 * resident["params"] + 1024
  train = reward_plan["programs"]["train_step"]
  assert train["argument_bytes"] >= sum(resident.values())
  assert train["flops"] > train["xla_flops"]
  assert reward_plan["programs"]["eval_step"]["outside_bytes"] == resident["optimizer"]


def test_an_sft_run_that_does_not_fit_gets_the_change_that_makes_it_fit(root, sft_plan,
                                                                        monkeypatch):
  """On a chip with a little less HBM than the replicated SFT run's largest peak, the plan says
  it does not fit and, re-planning, names the `sft` run's change that makes it fit (FSDP over 2 or
  4 chips), with the re-planned run's peak."""
  import dataclasses

  largest = max(p["peak_bytes_per_chip"] for p in sft_plan["programs"].values())
  v5e = chip_for("TPU v5 lite")
  monkeypatch.setattr(plan_lib, "chip_for",
                      lambda kind: dataclasses.replace(v5e, hbm_bytes=int(0.9 * largest)))
  shape = _shape(root, "sft")
  plan = stage_plan.plan_stage(shape, TOPOLOGY)
  assert not plan.fits and len(plan.advice) == 1
  (advice,) = plan.advice
  assert advice["fits"] and advice["why"].startswith("FSDP")
  assert advice["change"] in (["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=1"],
                              ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=1"])
  fsdp = int(advice["change"][1].split("=")[1])
  again = stage_plan.memory_peaks(dataclasses.replace(
      shape, mesh=MeshConfig(data=4 // fsdp, fsdp=fsdp)), TOPOLOGY,
      devices=tpu_devices(TOPOLOGY))
  assert advice["peak_bytes_per_chip"] == max(again.values()) <= 0.9 * largest
  assert "advice: mesh.data=" in plan_lib.format_plan(plan)
