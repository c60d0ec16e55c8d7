"""`jax-ppo plan` for a real TPU slice (v5e:2x2, compiled on this CPU host by libtpu): the plan's
numbers against arithmetic, and its loop-corrected FLOPs against programs unrolled by hand.

Needs libtpu (the `jax_ppo[tpu]` extra), which the main test environment does not have: `.ci/run`
runs this file alone, in one process, in a second virtual environment. Only one process at a
time may load libtpu on a host (its lock file), so never run it with several pytest workers.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("libtpu", reason="needs the jax_ppo[tpu] extra (libtpu); see .ci/run")

import jax  # noqa: E402
import tiny_plan_run  # noqa: E402  (tests/diagnostics: the tiny run and its parameter count)
from flax import nnx  # noqa: E402
from tiny_plan_run import DH, GAE, D, F, H, K, V  # noqa: E402

from jax_ppo import cli  # noqa: E402
from jax_ppo.diagnostics import plan as plan_lib  # noqa: E402
from jax_ppo.diagnostics import ppo_plan  # noqa: E402
from jax_ppo.diagnostics.topology import slice_mesh, tpu_devices  # noqa: E402
from jax_ppo.models import load_config  # noqa: E402
from jax_ppo.parallel.chips import chip_for  # noqa: E402
from jax_ppo.parallel.jit import MeshJit  # noqa: E402
from jax_ppo.parallel.mesh import MeshConfig  # noqa: E402
from jax_ppo.ppo.config import PPOConfig, PPOSampling  # noqa: E402
from jax_ppo.ppo.loss import coefficients  # noqa: E402
from jax_ppo.rollout.sampler import (  # noqa: E402
  DecodeCarry,
  decode_body,
  emit_token,
  segment_schedule,
)

TOPOLOGY = "v5e:2x2"  # one host, 4 chips
L = 4  # the policy's layers (tiny_plan_run: its widths and config)
# The fused run (GAE: one minibatch), and the split one: experience, then update; 4-row
# microbatches, one row per chip (with fewer rows than chips XLA chooses how to lay out a
# microbatch, differently in each program)
SPLIT = dict(GAE, batch_size=16, num_minibatches=2, gradient_accumulation_steps=2)


def param_count() -> int:
  return tiny_plan_run.param_count(L)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("plan")
  tiny_plan_run.write_run(root, L)
  return root


@pytest.fixture(scope="module")
def replicated(run_dir):
  """The CLI's JSON for the run, data parallel over the 4 chips (parameters replicated)."""
  out = run_dir / "plan.json"
  rc = cli.main(["plan", str(run_dir / "run.json"), "--topology", TOPOLOGY, "--prompt-length",
                 "16", "--json", str(out)])
  assert rc == 0
  return json.loads(out.read_text())


@pytest.fixture(scope="module")
def fsdp(run_dir):
  """`plan_run` of the split (experience, then update) run with FSDP over the 4 chips, the
  mesh, and the run's programs with unrolled layers (for the references below)."""
  ppo = PPOConfig(**{**SPLIT, "sampling": PPOSampling(**SPLIT["sampling"])})
  shape = ppo_plan.RunShape(model=load_config(str(run_dir / "policy")), ppo=ppo,
                            prompt_length=32, mesh=MeshConfig(data=1, fsdp=4))
  mesh = slice_mesh(tpu_devices(TOPOLOGY), shape.mesh, topology=TOPOLOGY)
  return (ppo_plan.plan_run(shape, TOPOLOGY),
          ppo_plan.RunPrograms(shape, mesh, scan_layers=False))


def test_cli_json_layout_and_table(replicated, capsys):
  assert {"topology", "chip", "chips", "hosts", "hbm_per_chip_bytes", "fits",
          "programs"} <= set(replicated)
  assert (replicated["topology"], replicated["chip"], replicated["chips"],
          replicated["hosts"]) == (TOPOLOGY, "TPU v5 lite", 4, 1)
  assert replicated["hbm_per_chip_bytes"] == 16 * 2**30
  assert replicated["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
  assert set(replicated["programs"]) == {"generate", "experience_update"}
  for p in replicated["programs"].values():
    assert {"peak_bytes_per_chip", "argument_bytes", "temp_bytes", "flops", "bytes_accessed",
            "roofline_s"} <= set(p)


def test_replicated_parameter_bytes_are_the_parameter_count_times_four(replicated):
  resident = replicated["resident_bytes_per_chip"]
  assert resident["params"] == param_count() * 4  # float32 masters on every chip
  assert resident["reference"] == resident["params"]  # a copy of the trainable state
  # Adam's two moments, plus a few scalars (its step count, the clip's state)
  assert 2 * resident["params"] <= resident["optimizer"] < 2 * resident["params"] + 1024
  fused = replicated["programs"]["experience_update"]
  # every resident array is an argument of the update (kept, though the reference is unused)
  assert fused["argument_bytes"] >= sum(resident.values())
  assert fused["outside_bytes"] == 0
  generate = replicated["programs"]["generate"]
  assert generate["outside_bytes"] == resident["optimizer"] + resident["reference"]
  assert generate["argument_bytes"] >= resident["params"]


def test_fsdp_keeps_a_quarter_of_the_bytes_per_chip(replicated, fsdp):
  plan, _ = fsdp
  rep, split = replicated["resident_bytes_per_chip"], plan.resident_bytes_per_chip
  for part in ("params", "optimizer", "reference"):
    # norm gains and the value head stay replicated: a little over a quarter
    assert rep[part] / 4 <= split[part] < 1.05 * rep[part] / 4, part
  assert set(plan.programs) == {"generate", "experience", "update"}
  assert plan.to_json()["programs"]["update"]["argument_bytes"] < (
      replicated["programs"]["experience_update"]["argument_bytes"] / 2)


def test_a_tensor_parallel_rollout_is_planned_with_its_copy_beside_the_run(run_dir, fsdp):
  """`sampling.decode_tensor=2` on the FSDP run: the rollout gets its own copy of the policy
  (matrices in the compute dtype, split over 2 chips; the run's copy stays resident), made by a
  `decode_state` program; its rollout does the FSDP rollout's work per chip (the same rows,
  split another way: neither layout runs a row twice), and training is untouched."""
  plan, _ = fsdp
  ppo = PPOConfig(**{**SPLIT, "sampling": PPOSampling(**SPLIT["sampling"], decode_tensor=2)})
  shape = ppo_plan.RunShape(model=load_config(str(run_dir / "policy")), ppo=ppo,
                            prompt_length=32, mesh=MeshConfig(data=1, fsdp=4))
  tp = ppo_plan.plan_run(shape, TOPOLOGY)
  assert set(tp.programs) == {"decode_state", "generate", "experience", "update"}
  resident = sum(tp.resident_bytes_per_chip.values())
  assert tp.programs["generate"].outside_bytes == resident
  assert tp.programs["decode_state"].outside_bytes == (
      resident - tp.resident_bytes_per_chip["params"])
  # The copy (float32 compute here: the matrices stay float32): half of the policy per chip, a
  # little over (the replicated norm gains, value head, prompt ids and key).
  copy = tp.programs["generate"].argument_bytes
  assert param_count() * 4 / 2 <= copy < 1.1 * param_count() * 4 / 2 + 2**16
  assert tp.programs["generate"].flops == pytest.approx(plan.programs["generate"].flops,
                                                         rel=0.1)
  for name in ("experience", "update"):  # training is untouched
    assert tp.programs[name].flops == pytest.approx(plan.programs[name].flops)


def test_fit_and_roofline_arithmetic(replicated):
  chip = chip_for("TPU v5 lite")
  assert replicated["fits"] is True
  for p in replicated["programs"].values():
    assert p["peak_bytes_per_chip"] == (p["argument_bytes"] + p["output_bytes"]
                                        - p["alias_bytes"] + p["temp_bytes"]
                                        + p["outside_bytes"])
    assert p["peak_bytes_per_chip"] < replicated["hbm_per_chip_bytes"]
    assert p["roofline_s"] == pytest.approx(max(p["flops"] / chip.fp32_flops,
                                                p["bytes_accessed"] / chip.hbm_bytes_s))
    assert p["flops"] > p["xla_flops"]  # the scanned layers / decode loop counted back


def _compiled_flops(fn, mesh, roles, args):
  return plan_lib.xla_cost(MeshJit(fn, mesh, **roles, keep_unused=True).lower(*args)
                           .compile()).flops


def test_corrected_update_flops_match_an_update_unrolled_by_hand(fsdp):
  """Epochs x minibatches x microbatches and the layers as Python loops: the XLA count of that
  program is the truth the loop correction must reproduce."""
  plan, run = fsdp
  c, steps = run.ppo, run.steps
  state, frozen, batch, _ = run.programs()["update"].args
  grad = jax.value_and_grad(steps.micro_loss, has_aux=True)

  def unrolled(state, frozen, batch):
    coefs = coefficients(c, state)
    for _ in range(c.ppo_epochs):
      for m in range(c.num_minibatches):
        grads = None
        for a in range(c.gradient_accumulation_steps):
          start = m * c.minibatch_size + a * c.microbatch_size
          micro = jax.tree.map(lambda x, s=start: x[s:s + c.microbatch_size], batch)
          (loss, _), g = grad(state.params, frozen, micro, 0.5, coefs)
          grads = g if grads is None else jax.tree.map(lambda u, v: u + v, grads, g)
        state, _ = steps.updater.apply_gradients(state, grads, {"loss/total_avg": loss})
    return state

  truth = _compiled_flops(unrolled, run.mesh, dict(in_roles=("params", "params", "batch"),
                                                   out_roles="params"), (state, frozen, batch))
  assert plan.programs["update"].flops == pytest.approx(truth, rel=0.03)
  assert plan.programs["update"].xla_flops < truth / 3  # what XLA says of the scans


def test_corrected_generate_flops_match_a_decode_loop_unrolled_by_hand(fsdp):
  plan, run = fsdp
  policy, ids, mask, key = run.programs()["generate"].args
  sampling, graphdef = run.sampling, run.sampler_graphdef
  t = sampling.max_new_tokens

  def unrolled(policy, ids, mask, rng):
    model = nnx.merge(graphdef, *policy)
    cache = model.init_cache(batch_size=ids.shape[0], max_length=ids.shape[1] + t - 1)
    logits, cache = model.prefill(ids, mask, cache)
    b = ids.shape[0]
    tokens = jax.numpy.zeros((b, t), jax.numpy.int32)
    logprobs = jax.numpy.zeros((b, t), jax.numpy.float32)
    done = jax.numpy.zeros((b,), bool)
    tok, done2, tokens, logprobs = emit_token(0, logits, done, tokens, logprobs, rng=rng,
                                              config=sampling)
    carry = DecodeCarry(step=jax.numpy.asarray(1), token=tok, done=done2, done_before=done,
                        tokens=tokens, logprobs=logprobs, cache=cache)
    for seg in segment_schedule(ids.shape[1], t, sampling.decode_segments):
      for _ in range(seg.steps):
        carry = decode_body(model, carry, rng=rng, config=sampling,
                            attend_length=seg.attend_length)
    return carry.tokens

  truth = _compiled_flops(unrolled, run.mesh, dict(
      in_roles=("params", "batch", "batch", "replicated"), out_roles="batch"),
      (policy, ids, mask, key))
  assert plan.programs["generate"].flops == pytest.approx(truth, rel=0.03)
  assert plan.programs["generate"].xla_flops < truth / 2


RL = 2  # the reward model's layers (the policy has L): the costs extrapolate in each depth


def scalar_param_count(layers: int) -> int:
  """A Qwen3 `ScalarModel` (reward model or critic) by hand: the embedding, the layers, the final
  norm and the score head `[D, 1]` with its bias (no LM head)."""
  return V * D + layers * tiny_plan_run.layer_param_count() + D + (D + 1)


@pytest.fixture(scope="module")
def with_models(run_dir):
  """The split run with a 2-layer reward model, its critic a copy of it (as a run with a reward
  model and GAE makes it), FSDP over the 4 chips: the plan, and the run's programs unrolled."""
  import transformers

  transformers.Qwen3Config(vocab_size=V, hidden_size=D, intermediate_size=F,
                           num_hidden_layers=RL, num_attention_heads=H, num_key_value_heads=K,
                           head_dim=DH, max_position_embeddings=256, num_labels=1,
                           tie_word_embeddings=False).save_pretrained(run_dir / "reward")
  from jax_ppo.runs.ppo_config import load_run_config

  config = load_run_config([str(run_dir / "run.json"), "reward_function=null",
                            f"reward_model_path={run_dir / 'reward'}", "mesh.data=1",
                            "mesh.fsdp=4", "ppo.batch_size=16", "ppo.num_minibatches=2",
                            "ppo.gradient_accumulation_steps=2"])
  shape = ppo_plan.run_shape(config, prompt_length=32)
  assert shape.critic is not None and shape.critic.num_layers == RL
  mesh = slice_mesh(tpu_devices(TOPOLOGY), shape.mesh, topology=TOPOLOGY)
  return (ppo_plan.plan_run(shape, TOPOLOGY),
          ppo_plan.RunPrograms(shape, mesh, scan_layers=False))


def test_reward_model_and_critic_bytes_are_their_parameter_counts(with_models):
  plan, _ = with_models
  resident = plan.resident_bytes_per_chip
  # FSDP over 4 chips: a quarter of the float32 bytes, plus the replicated norm gains and heads
  for part in ("critic", "reward"):
    assert scalar_param_count(RL) <= resident[part] < 1.1 * scalar_param_count(RL), part
  policy_without_value_head = param_count() - (D + 1)
  assert policy_without_value_head <= resident["params"] < 1.1 * policy_without_value_head
  # Adam's moments cover the policy and the critic
  assert resident["optimizer"] >= 2 * (resident["params"] + resident["critic"])
  assert set(plan.programs) == {"generate", "score", "experience", "update"}
  score = plan.programs["score"]
  # the score program takes the reward model; everything else stays resident beside it
  assert score.outside_bytes == sum(resident.values()) - resident["reward"]


def test_corrected_costs_of_two_depths_match_the_programs_unrolled(with_models):
  """The reward model's score and the experience program (policy, reference and a critic of
  another depth) have no loop but the layers': their XLA counts unrolled at full depth are the
  truth `grouped_depth_costs` must reproduce from its 1- and 2-layer variants."""
  plan, run = with_models
  programs = run.programs()
  for name in ("score", "experience"):
    truth = plan_lib.xla_cost(programs[name].lower(*programs[name].args).compile())
    assert plan.programs[name].flops == pytest.approx(truth.flops, rel=0.03), name
    assert plan.programs[name].bytes_accessed == pytest.approx(truth.bytes_accessed,
                                                               rel=0.1), name
  assert plan.programs["score"].xla_flops < plan.programs["score"].flops  # the scanned layers


def test_costs_extrapolated_in_the_rows_match_the_costs_at_the_full_rows(run_dir):
  """What a plan falls back to when its cost variants need more HBM than the chip has
  (`row_extrapolated_costs`): every piece's costs from the run at 1/2 and 1/4 of its rows (32
  and 16 rows: 2 minibatches of 2 microbatches of 8 and 4 rows, FSDP over the 4 chips), against
  those compiled at the full 64 rows."""
  ppo = PPOConfig(**{**SPLIT, "batch_size": 64, "sampling": PPOSampling(**SPLIT["sampling"])})
  shape = ppo_plan.RunShape(model=load_config(str(run_dir / "policy")), ppo=ppo,
                            prompt_length=32, mesh=MeshConfig(data=1, fsdp=4))
  mesh = slice_mesh(tpu_devices(TOPOLOGY), shape.mesh, topology=TOPOLOGY)
  at = lambda s: ppo_plan.layer_costs(s, mesh, topology=TOPOLOGY)  # noqa: E731
  truth = at(shape)
  tried = []

  def shape_at(k):
    tried.append(k)
    return ppo_plan.rows_divided(shape, k, row_shards=4)

  extrapolated, k = plan_lib.row_extrapolated_costs(at, shape_at)
  assert (tried, k) == ([2, 4], 4) and extrapolated.keys() == truth.keys()
  for name, cost in truth.items():
    assert extrapolated[name].flops == pytest.approx(cost.flops, rel=0.001), name  # exact
    ratio = extrapolated[name].bytes_accessed / cost.bytes_accessed
    if name == "generate" or name.startswith("decode_step"):  # the sampler's: nearly affine
      assert ratio == pytest.approx(1.0, rel=0.05), name
    else:  # the training programs' bytes are not affine in the rows at this tiny shape
      assert 0.4 < ratio < 2.5, name  # (measured: experience 1.13, the split update 2.04)


def test_a_run_that_does_not_fit_gets_the_change_that_makes_it_fit(run_dir, replicated,
                                                                  monkeypatch):
  """On a chip with a little less HBM than the replicated run's largest peak, the plan says it
  does not fit and, re-planning, that FSDP over 2 or 4 chips makes it fit."""
  import dataclasses

  from jax_ppo.runs.ppo_config import load_run_config

  largest = max(p["peak_bytes_per_chip"] for p in replicated["programs"].values())
  v5e = chip_for("TPU v5 lite")
  monkeypatch.setattr(plan_lib, "chip_for",
                      lambda kind: dataclasses.replace(v5e, hbm_bytes=int(0.9 * largest)))
  shape = ppo_plan.run_shape(load_run_config([str(run_dir / "run.json")]), prompt_length=16)
  plan = ppo_plan.plan_run(shape, TOPOLOGY)
  assert not plan.fits and len(plan.advice) == 1
  (advice,) = plan.advice
  assert advice["fits"] and advice["why"].startswith("FSDP")
  assert advice["change"] in (["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=1"],
                              ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=1"])
  assert advice["peak_bytes_per_chip"] <= 0.9 * largest
  fsdp = int(advice["change"][1].split("=")[1])
  # the advice's peak is the re-planned run's
  again = ppo_plan.memory_peaks(dataclasses.replace(
      shape, mesh=MeshConfig(data=4 // fsdp, fsdp=fsdp)), TOPOLOGY,
      devices=tpu_devices(TOPOLOGY))
  assert advice["peak_bytes_per_chip"] == max(again.values())
  assert "advice: mesh.data=" in plan_lib.format_plan(plan)


def test_a_multi_host_slice_compiles_from_this_host(run_dir, replicated):
  """v5p:2x2x2 is 8 chips on 2 hosts: the run's programs compile for it from this one host, with
  FSDP over all 8 chips an eighth of the replicated bytes (v5e's plan above) per chip."""
  from jax_ppo.runs.ppo_config import load_run_config

  config = load_run_config([str(run_dir / "run.json"), "mesh.data=1", "mesh.fsdp=8"])
  plan = ppo_plan.plan_run(ppo_plan.run_shape(config, prompt_length=16), "v5p:2x2x2")
  assert (plan.chips, plan.hosts, plan.chip) == (8, 2, "TPU v5p") and plan.fits
  assert plan.hbm_per_chip_bytes == 95 * 2**30
  rep = replicated["resident_bytes_per_chip"]
  for part in ("params", "optimizer", "reference"):
    assert rep[part] / 8 <= plan.resident_bytes_per_chip[part] < 1.1 * rep[part] / 8, part
  assert set(plan.programs) == {"generate", "experience_update"}


@pytest.mark.parametrize("family, topology", [
    ("gpt2", "v5e:2x2"), ("llama2", "v5e:2x2"), ("mistral_window", "v5e:2x2"),
    ("qwen2", "v5e:2x2"), ("gemma2", "v6e:2x2"), ("qwen3", "v6e:2x2")])
def test_every_family_compiles_for_tpu(tmp_path, family, topology):
  """Each supported family's PPO programs (GAE: a value head on the trunk) compile for a TPU
  slice with FSDP over its chips (memory only: the cost variants are the same code)."""
  from tests.models.conftest import hf_config

  hf_config(family).save_pretrained(tmp_path / family)
  ppo = PPOConfig(**{**GAE, "sampling": PPOSampling(**GAE["sampling"])})
  shape = ppo_plan.RunShape(model=load_config(str(tmp_path / family)), ppo=ppo, prompt_length=16,
                            mesh=MeshConfig(data=1, fsdp=4), dtype="bfloat16")
  peaks = ppo_plan.memory_peaks(shape, topology, devices=tpu_devices(topology))
  assert set(peaks) == {"generate", "experience_update"} and min(peaks.values()) > 0


def test_a_second_process_gets_the_lock_error(run_dir, replicated):
  """This process holds libtpu now (the plans above loaded it): another plan must say so."""
  if os.environ.get("ALLOW_MULTIPLE_LIBTPU_LOAD"):
    pytest.skip("ALLOW_MULTIPLE_LIBTPU_LOAD is set: libtpu takes no lock in this process")
  done = subprocess.run(
      [sys.executable, "-m", "jax_ppo.cli", "plan", str(run_dir / "run.json"), "--topology",
       TOPOLOGY], capture_output=True, text=True, timeout=300)
  assert done.returncode == 2
  last = done.stderr.strip().splitlines()[-1]
  assert last.startswith("jax-ppo plan: error: libtpu is in use by another process")
  assert "libtpu_lockfile" in last
