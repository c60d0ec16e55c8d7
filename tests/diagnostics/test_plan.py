"""`jax-ppo plan` for a real TPU slice (v5e:2x2, compiled on this CPU host by libtpu): the plan's
numbers against arithmetic, and its loop-corrected FLOPs against programs unrolled by hand.

Needs libtpu (the `jax_ppo[tpu]` extra), which the main test environment does not have: `.ci/run`
runs this file alone, in one process, in a second virtual environment. Only one process at a
time may load libtpu on a host (its lock file), so never run it with several pytest workers.
"""

import json
import subprocess
import sys

import pytest

pytest.importorskip("libtpu", reason="needs the jax_ppo[tpu] extra (libtpu); see .ci/run")

import jax  # noqa: E402
from flax import nnx  # noqa: E402

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
from jax_ppo.rollout.sampler import DecodeCarry, decode_body, emit_token  # noqa: E402

TOPOLOGY = "v5e:2x2"  # one host, 4 chips
L, D, F, V, H, K, DH = 4, 128, 256, 512, 4, 2, 32
GAE = dict(batch_size=8, sampling={"max_new_tokens": 8}, ppo_epochs=2)  # fused: one minibatch
# experience, then update; 4-row microbatches, one row per chip (with fewer rows than chips XLA
# chooses how to lay out a microbatch, differently in each program)
SPLIT = dict(GAE, batch_size=16, num_minibatches=2, gradient_accumulation_steps=2)


def param_count() -> int:
  """Qwen3 with untied embeddings (embedding and LM head) and a value head on the trunk, by
  hand: q, k, v, o projections, the gated MLP, two norms and the q/k norms per layer."""
  layer = D * H * DH + 2 * D * K * DH + H * DH * D + 3 * D * F + 2 * D + 2 * DH
  return 2 * V * D + L * layer + D + (D + 1)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  import transformers

  root = tmp_path_factory.mktemp("plan")
  transformers.Qwen3Config(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
                           num_attention_heads=H, num_key_value_heads=K, head_dim=DH,
                           max_position_embeddings=256,
                           tie_word_embeddings=False).save_pretrained(root / "policy")
  config = {"policy_path": str(root / "policy"), "prompts_path": "prompts.txt",
            "run_dir": str(root / "run"), "reward_function": "length", "ppo": GAE,
            "mesh": {"data": 4}}
  (root / "run.json").write_text(json.dumps(config))
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
    for _ in range(t - 1):
      carry = decode_body(model, carry, rng=rng, config=sampling)
    return carry.tokens

  truth = _compiled_flops(unrolled, run.mesh, dict(
      in_roles=("params", "batch", "batch", "replicated"), out_roles="batch"),
      (policy, ids, mask, key))
  assert plan.programs["generate"].flops == pytest.approx(truth, rel=0.03)
  assert plan.programs["generate"].xla_flops < truth / 2


def test_a_second_process_gets_the_lock_error(run_dir, replicated):
  """This process holds libtpu now (the plans above loaded it): another plan must say so."""
  done = subprocess.run(
      [sys.executable, "-m", "jax_ppo.cli", "plan", str(run_dir / "run.json"), "--topology",
       TOPOLOGY], capture_output=True, text=True, timeout=300)
  assert done.returncode == 2
  last = done.stderr.strip().splitlines()[-1]
  assert last.startswith("jax-ppo plan: error: libtpu is in use by another process")
  assert "libtpu_lockfile" in last
