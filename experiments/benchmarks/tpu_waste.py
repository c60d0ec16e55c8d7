r"""What the compiled TPU programs of a PPO run say about our own waste, against model counts.

Compiles a PPO run's programs for a TPU slice from this CPU host (libtpu, ahead of time:
`jax_ppo.diagnostics.ppo_plan`) at Qwen3-0.6B's shapes and divides three compiled figures by
what the model needs. Every figure is per chip: XLA's `cost_analysis()` of an SPMD-partitioned
program reports the partitioned (one device's) module, so model counts of the whole slice are
divided by the chips (the ratios near 1 below are the check: whole-slice counts would sit 8x off).

(a) Update FLOPs. Compiled, loop-corrected FLOPs (`ppo_plan.loop_corrected`: layers extrapolated
in depth from 1- and 2-layer unrolled variants, the microbatch / optimizer-step loops counted
back) of the fused `experience_update` and of `experience` + `update`, with the default remat
(`jax_ppo.models.DEFAULT_REMAT`, "dots" = `jax.checkpoint_policies.dots_with_no_batch_dims_
saveable`) and with remat "none", over the model FLOPs. With `B` rows, `S` prompt and `T`
response slots, `L` layers, `H` query heads of width `Dh`, hidden `D`, vocabulary `V`
(`jax_ppo.ppo.perf.compiled_update_model_flops`, tested against a hand count):

    N_body  = L (D q + 2 D kv + q D + m D I)      matmul weights of the blocks (q = H Dh,
                                                  kv = K Dh, m = 3 gated MLP else 2)
    N_head  = D V + D                             LM head (tied: the embedding) + value head
    F_fwd   = 2 N_body B (S+T) + 2 N_head B T     one forward: the trunk runs every slot, the
              + 4 L H Dh B (S+T)^2                heads only the T positions that predict a
                                                  response token; attention's q k^T and p v
                                                  over the full (S+T)^2 square (what a dense
                                                  masked attention computes; PaLM's count)
    F_attn  = 4 L H Dh B (S+T)^2                  the attention matmuls alone
    epoch   = 3 F_fwd + R                         forward + backward (6 N per token); R the
                                                  recomputed forward of the remat policy:
                                                  "dots": F_attn (only the batched attention
                                                  matmuls are recomputed, the weight matmuls'
                                                  outputs are kept); "full": F_fwd; "none": 0
    split   = 2 F_fwd (old log-probs + values, reference) + E epoch
    fused   = 1 F_fwd (reference; the first epoch's forward gives the old ones) + E epoch

The embedding lookup is a gather (no FLOPs). The head's logits are compiled unchunked here
(`PPOSteps.logits_chunk_bytes = None`): the chunked head is a `lax.map` that XLA counts once,
and the run's chunked head recomputes its logits in the backward pass (`jax.checkpoint`), one
more `2 N_head B T` per epoch than these counts.

(b) Decode bytes. XLA's bytes accessed of a sampler decode step (`decode_step_costs`: compiled
at the model's full depth with unrolled layers, no depth extrapolation), averaged over the
`T - 1` steps, over the ideal: the weights the decode loop reads (the matrices in the compute
dtype: `generate` converts them once outside its loop; norms float32) read once, plus the live KV
cache read once at its average length `S + T/2` (the decode steps attend to `S + 1 .. S + T - 1`
slots). The sampler's decode is length-bucketed (`--decode-segments K`, the
`SamplingConfig.decode_segments` default unless given; 1: one loop over the whole cache): loop
`k`'s `n_k` steps each read the cache's first `S + e_k - 1` slots
(`jax_ppo.rollout.sampler.segment_schedule`), so each loop's step is compiled at its own prefix
and the step's bytes are `sum_k n_k bytes_k / (T - 1)`.

(c) FSDP HBM. Per-chip bytes of the trainable parameters and the AdamW state with
`MeshConfig(data=1, fsdp=n)` over `(replicated bytes) / n` (from the arrays' shardings).

    PYTHONPATH=. python experiments/benchmarks/tpu_waste.py --json results/tpu_waste.json

(`--layers 4` for a quick look: (a) compiles 1 and 2 layers whatever the depth, (b) the depth
given).

For a TPU slice it needs libtpu (the `jax_ppo[tpu]` extra; one process at a time may load it on a
host). `--topology local` compiles the same programs for this process's first device instead:
on a GPU, with XLA's GPU cost analysis (which XLA's GPU compiler has only with a GPU present), so
the ratios, and the cost model's floors of (b), are the GPU cost model's
(`accelerator.sh`'s `decode_waste` step: `--parts decode`). On a CPU it checks the plumbing only.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host import host_line, host_record  # noqa: E402

GOALS = {"update_flops": 1.35, "decode_bytes": 1.25, "fsdp_hbm": 1.1}
LOCAL = "local"
"""`--topology local`: compile for this process's first device instead of a TPU slice."""


def libtpu_version() -> str | None:
  """The installed libtpu's version; None without it (`--topology local` on a GPU)."""
  try:
    return importlib.metadata.version("libtpu")
  except importlib.metadata.PackageNotFoundError:
    return None


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--topology", default="v5e:2x4",
                 help="TPU slice libtpu describes, or 'local': this process's first device (on "
                      "a GPU, XLA's GPU cost analysis of the same programs)")
  p.add_argument("--layers", type=int, default=28, help="model depth (Qwen3-0.6B: 28)")
  p.add_argument("--rows", type=int, default=64, help="rows per update (batch_size)")
  p.add_argument("--prompt", type=int, default=512, help="prompt slots per row")
  p.add_argument("--response", type=int, default=512, help="response slots (max_new_tokens)")
  p.add_argument("--microbatch", type=int, default=8, help="rows per microbatch (split form)")
  p.add_argument("--epochs", type=int, default=4, help="ppo_epochs")
  p.add_argument("--dtype", default="bfloat16", help="compute dtype")
  p.add_argument("--parts", default="update,decode,fsdp", help="which ratios to compute")
  p.add_argument("--remats", default="dots,none",
                 help="the remat policies of (a), comma-separated (dots: the default)")
  p.add_argument("--decode-segments", type=int, default=None,
                 help="the sampler's decode loops K (default: SamplingConfig's; 1: one loop)")
  p.add_argument("--json", help="write the results here")
  return p.parse_args(argv)


def qwen3_config(num_layers: int):
  """Qwen3-0.6B's `ModelConfig`, via a config.json written with transformers.Qwen3Config."""
  import transformers

  from jax_ppo.models import load_config

  hf = transformers.Qwen3Config(
      hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
      num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
      max_position_embeddings=40960)
  with tempfile.TemporaryDirectory() as folder:
    hf.save_pretrained(folder)
    config = load_config(folder)
  from jax_ppo.diagnostics.plan import with_layers

  return with_layers(config, num_layers)


def decode_step_costs(run, args, n_loops: int):
  """XLA cost of the step of each of the sampler's decode loops at the model's full depth,
  layers unrolled (no extrapolation: at 1 and 2 layers the whole KV cache fits in a v5e's
  128 MiB VMEM and the compiler moves it there, so the depth difference is not a layer's HBM
  traffic), in loop order, and the per-chip bytes of the weights a step should read once:
  `ppo_plan`'s `decode_step_k` pieces, compiled as the sampler's loops run them (attending over
  their cache prefix; the matrices in the compute dtype, as `generate` converts them once outside
  its loops; the carry's layouts left to the compiler)."""
  from jax_ppo.diagnostics import ppo_plan
  from jax_ppo.diagnostics.memory import shard_bytes
  from jax_ppo.diagnostics.plan import compile_program, xla_cost

  programs = run.programs(pieces=("decode_step",))
  names = [ppo_plan.decode_piece(k) for k in range(n_loops)]
  costs = [xla_cost(compile_program(name, programs[name], topology=args.topology))
           for name in names]
  return costs, shard_bytes(programs[names[0]].args[0])


def cost_model_floors(run, args) -> dict[str, float]:
  """XLA's bytes accessed for the least a decode step must read, each as a minimal program of
  its own on one chip's share: every layer's query against its full-length cache slice (`q k^T`
  and `p v` over `[L, b, K, S+T-1, Dh]`), and a chain of `x W_l` over the stacked weights
  `[L, D, I]` in the compute dtype. Divided by the bytes they read, they are the TPU cost model's
  own factors for reading a layer's slice (it counts the copy that stages the slice in VMEM,
  and the read from there, beside the read from HBM)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jax_ppo.diagnostics.plan import xla_cost

  c, mesh = run.model_config, run.mesh
  one = NamedSharding(mesh, P())
  rows = args.rows // mesh.size
  slots, groups = args.prompt + args.response - 1, c.num_heads // c.num_kv_heads
  cache = jax.ShapeDtypeStruct((c.num_layers, rows, c.num_kv_heads, slots, c.head_dim),
                               run.dtype, sharding=one)
  q = jax.ShapeDtypeStruct((rows, c.num_kv_heads, groups, c.head_dim), run.dtype, sharding=one)

  def attend(k, v, q):
    out = []
    for i in range(c.num_layers):
      p = jnp.einsum("bkgd,bktd->bkgt", q, k[i], preferred_element_type=jnp.float32)
      out.append(jnp.einsum("bkgt,bktd->bkgd", p.astype(v.dtype), v[i]))
    return out

  w = jax.ShapeDtypeStruct((c.num_layers, c.hidden_size, c.intermediate_size), run.dtype,
                           sharding=one)
  x = jax.ShapeDtypeStruct((rows, c.hidden_size), run.dtype, sharding=one)

  def chain(w, x):
    for i in range(c.num_layers):
      x = (x @ w[i])[:, : c.hidden_size]
    return x

  nbytes = lambda a: a.size * jnp.dtype(a.dtype).itemsize  # noqa: E731
  kv = xla_cost(jax.jit(attend).lower(cache, cache, q).compile()).bytes_accessed
  mm = xla_cost(jax.jit(chain).lower(w, x).compile()).bytes_accessed
  return {"kv_read_factor": kv / (2 * nbytes(cache)), "weight_read_factor": mm / nbytes(w)}


def main(argv=None) -> int:
  args = parse_args(argv)
  import jax

  from jax_ppo.diagnostics import ppo_plan
  from jax_ppo.diagnostics.plan import Cost, depth_costs
  from jax_ppo.diagnostics.topology import slice_mesh, tpu_devices
  from jax_ppo.parallel.mesh import MeshConfig
  from jax_ppo.ppo import PPOConfig, PPOSampling
  from jax_ppo.ppo.perf import compiled_update_model_flops
  from jax_ppo.rollout.sampler import segment_schedule

  parts = set(args.parts.split(","))
  t_start = time.perf_counter()
  config = qwen3_config(args.layers)
  devices = jax.devices()[:1] if args.topology == LOCAL else tpu_devices(args.topology)
  n = len(devices)
  mesh = slice_mesh(devices, MeshConfig(), topology=args.topology)

  def ppo(microbatch: int) -> PPOConfig:
    return PPOConfig(batch_size=args.rows, ppo_epochs=args.epochs,
                     gradient_accumulation_steps=args.rows // microbatch,
                     sampling=PPOSampling(max_new_tokens=args.response))

  def shape(microbatch: int, remat: str, mesh_config=None):
    return ppo_plan.RunShape(model=config, ppo=ppo(microbatch), prompt_length=args.prompt,
                             dtype=args.dtype, remat=remat, mesh=mesh_config)

  def costs(run_shape, names) -> dict[str, Cost]:
    def programs_at(layers):
      run = ppo_plan.RunPrograms(run_shape, mesh, layers={"policy": layers},
                                 scan_layers=False)
      run.steps.logits_chunk_bytes = None  # the chunked head's lax.map is counted once
      progs = run.programs(pieces=True)
      return {k: progs[k] for k in names}
    return depth_costs(programs_at, config.num_layers, topology=args.topology)

  host = host_record()
  results = {
      "benchmark": "tpu_waste", "topology": args.topology, "chips": n,
      "chip": devices[0].device_kind, "host": host,
      "versions": {"jax": jax.__version__, "libtpu": libtpu_version(),
                   "python": platform.python_version()},
      "model": "Qwen3-0.6B shapes", "layers": args.layers, "rows": args.rows,
      "prompt": args.prompt, "response": args.response, "microbatch": args.microbatch,
      "epochs": args.epochs, "dtype": args.dtype, "mesh": f"data={n}", "goals": GOALS,
      "per_chip": True,
  }
  rows = []

  if "update" in parts:
    update = {}
    forms = (("split", args.microbatch), ("fused", args.rows))
    try:  # the model counts first: a policy they do not know is refused before compiling
      models = {(remat, form): compiled_update_model_flops(
                    config, rows=args.rows, prompt_len=args.prompt, response_len=args.response,
                    epochs=args.epochs, remat=remat, fused_first_epoch=form == "fused")
                for remat in args.remats.split(",") for form, _ in forms}
    except ValueError as e:
      raise SystemExit(f"--remats: {e}") from None
    for remat in args.remats.split(","):
      for form, micro in forms:
        run_shape = shape(micro, remat)
        names = (["experience_update"] if form == "fused" else ["experience", "update"])
        t0 = time.perf_counter()
        xla = costs(run_shape, [*names, "microbatch_grad", "optimizer_step"])
        corrected = ppo_plan.loop_corrected(xla, run_shape.ppo, max_new_tokens=args.response)
        compiled = {k: corrected[k].flops for k in names}
        model = models[remat, form]
        total = sum(compiled.values())
        ratio = total / (model["total"] / n)
        parts_ratio = ({"experience": compiled["experience"] / (model["experience"] / n),
                        "update": compiled["update"] / (model["update"] / n)}
                       if form == "split" else {})
        update[f"{form}/{remat}"] = {
            "compiled_flops_per_chip": compiled, "compiled_total_per_chip": total,
            "compiled_total_slice": total * n, "model_flops_slice": model,
            "model_flops_per_chip": model["total"] / n, "ratio": ratio,
            "ratio_parts": parts_ratio, "compile_s": round(time.perf_counter() - t0, 1)}
        label = "experience_update" if form == "fused" else "experience + update"
        rows.append((f"update flops, {label}, remat {remat}", total, model["total"] / n, ratio,
                     GOALS["update_flops"]))
        print(rows[-1], parts_ratio, flush=True)
    results["update_flops"] = update

  if "decode" in parts:
    run_shape = shape(args.microbatch, "dots")
    t0 = time.perf_counter()
    run = ppo_plan.RunPrograms(run_shape, mesh, scan_layers=False)
    if args.decode_segments is not None:  # the sampler's option (not a PPOConfig field)
      run.sampling = dataclasses.replace(run.sampling, decode_segments=args.decode_segments)
    segments = segment_schedule(args.prompt, args.response, run.sampling.decode_segments)
    seg_costs, weights = decode_step_costs(run, args, len(segments))
    steps = args.response - 1
    step = Cost(sum(seg.steps * c.flops for seg, c in zip(segments, seg_costs, strict=True))
                / steps,
                sum(seg.steps * c.bytes_accessed
                    for seg, c in zip(segments, seg_costs, strict=True)) / steps)
    read = sum(seg.steps * seg.attend_length for seg in segments) / steps
    rows_chip = args.rows // n
    cache_item = jax.numpy.dtype(run.dtype).itemsize
    live = args.prompt + args.response / 2
    kv = (2 * config.num_layers * rows_chip * config.num_kv_heads * config.head_dim * live
          * cache_item)
    ideal = weights + kv
    floors = cost_model_floors(run, args)
    read_kv = kv * read / live  # the cache slots the loops read, on average over the steps
    mlp = 3 if config.gated_mlp else 2
    stacked = config.num_layers * (2 * config.hidden_size * (config.q_size + config.kv_size)
                                   + mlp * config.hidden_size * config.intermediate_size)
    stacked *= jax.numpy.dtype(run.dtype).itemsize  # the layers' matrices, read slice by slice
    floor = (floors["weight_read_factor"] * stacked + (weights - stacked)
             + floors["kv_read_factor"] * read_kv)
    results["decode_bytes"] = {
        "cost_model_factors": floors, "cost_model_floor_read_slots": floor,
        "ratio_to_cost_model_floor": step.bytes_accessed / floor,
        "program": "as in the sampler's loops",
        "decode_segments": [{"steps": seg.steps, "attend_slots": seg.attend_length,
                             "compiled_bytes_per_chip": c.bytes_accessed,
                             "compiled_flops_per_chip": c.flops}
                            for seg, c in zip(segments, seg_costs, strict=True)],
        "compiled_bytes_per_chip": step.bytes_accessed, "compiled_flops_per_chip": step.flops,
        "weights_bytes_per_chip": weights, "live_kv_bytes_per_chip": kv,
        "average_live_slots": live, "average_read_slots": read,
        "cache_slots": args.prompt + args.response - 1,
        "ideal_bytes_per_chip": ideal, "ratio": step.bytes_accessed / ideal,
        "compile_s": round(time.perf_counter() - t0, 1)}
    rows.append((f"decode_step bytes ({len(segments)} decode loops)", step.bytes_accessed, ideal,
                 step.bytes_accessed / ideal, GOALS["decode_bytes"]))
    rows.append(("decode_step bytes / cost model's floor (slots read)", step.bytes_accessed,
                 floor, step.bytes_accessed / floor, GOALS["decode_bytes"]))
    print(rows[-2:], floors, flush=True)

  if "fsdp" in parts:
    def resident(mesh_config):
      m = slice_mesh(devices, mesh_config, topology=args.topology)
      return ppo_plan.RunPrograms(shape(args.microbatch, "dots", mesh_config), m).resident_bytes

    rep, fsdp = resident(MeshConfig(data=n)), resident(MeshConfig(data=1, fsdp=n))
    fsdp_res = {}
    for key in ("params", "optimizer"):
      ratio = fsdp[key] / (rep[key] / n)
      fsdp_res[key] = {"replicated_per_chip": rep[key], "fsdp_per_chip": fsdp[key],
                       "ratio": ratio}
      rows.append((f"FSDP HBM per chip, {key} (fsdp={n})", fsdp[key], rep[key] / n, ratio,
                   GOALS["fsdp_hbm"]))
    both = (fsdp["params"] + fsdp["optimizer"]) / ((rep["params"] + rep["optimizer"]) / n)
    fsdp_res["params+optimizer"] = {"ratio": both}
    rows.append((f"FSDP HBM per chip, params + optimizer (fsdp={n})",
                 fsdp["params"] + fsdp["optimizer"], (rep["params"] + rep["optimizer"]) / n,
                 both, GOALS["fsdp_hbm"]))
    results["fsdp_hbm"] = fsdp_res

  results["seconds"] = round(time.perf_counter() - t_start, 1)
  print(f"\n{args.topology} ({n} x {devices[0].device_kind}), Qwen3-0.6B shapes at "
        f"{config.num_layers} layers, {args.rows} rows x ({args.prompt} + {args.response}), "
        f"{args.dtype}, mesh data={n}; per chip; compiled on {host_line(host)}")
  print(f"{'quantity':<58}{'compiled':>14}{'model/ideal':>14}{'ratio':>8}{'goal':>7}  met")
  for name, got, ideal, ratio, goal in rows:
    print(f"{name:<58}{got:>14.4g}{ideal:>14.4g}{ratio:>8.3f}{goal:>7.2f}  "
          f"{'yes' if ratio <= goal else 'NO'}")
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(results, f, indent=2, default=float)
  return 0


if __name__ == "__main__":
  sys.exit(main())
