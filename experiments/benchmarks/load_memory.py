"""Peak host memory of `jax_ppo.models.from_pretrained` on a ~500M-parameter checkpoint.

Writes a random Llama-shaped fp32 safetensors checkpoint (sharded, written shard by shard so
this parent process stays small) to a temporary folder, then loads it with `from_pretrained` in
a fresh subprocess and reports that subprocess's peak RSS (`ru_maxrss`), its RSS once jax_ppo is
imported, the XLA runtime started and transformers' config machinery imported (the baseline:
`AutoConfig` imports torch when it is installed, ~250 MB that do not grow with the model), and
both divided by the checkpoint's bytes. A loader that keeps one copy
of the weights scores about 1.0 on `(peak - baseline) / checkpoint bytes`.

    python experiments/benchmarks/load_memory.py --json /tmp/load_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host import host_line, host_record  # noqa: E402

CHILD = textwrap.dedent("""
    import json, resource, sys, time
    import jax, jax.numpy as jnp
    import jax_ppo.models as models
    def rss_kb():
      with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS"))
    imports = rss_kb()
    jax.jit(lambda x: x + 1)(jnp.zeros(8)).block_until_ready()  # Start the runtime.
    runtime = rss_kb()
    models.load_config(sys.argv[1])  # transformers' config import (it imports torch if present).
    base = rss_kb()
    t0 = time.perf_counter()
    model = models.from_pretrained(sys.argv[1], dtype={dtype})
    jax.block_until_ready(jax.tree.leaves(model))
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps(dict(imports_kb=imports, runtime_kb=runtime, baseline_kb=base, peak_kb=peak,
                          after_kb=rss_kb(), seconds=seconds)))
""")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--layers", type=int, default=26, help="26 layers of D=1024, F=4096: ~503M")
  p.add_argument("--hidden", type=int, default=1024)
  p.add_argument("--intermediate", type=int, default=4096)
  p.add_argument("--vocab", type=int, default=32000)
  p.add_argument("--shard-mb", type=int, default=700, help="shard size of the written files")
  p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                 help="load dtypes to measure (each in its own subprocess)")
  p.add_argument("--dir", default=None, help="keep the checkpoint here instead of a temp dir")
  p.add_argument("--json", default=None)
  return p.parse_args(argv)


def write_checkpoint(path, args) -> tuple[int, int]:
  """Random fp32 Llama checkpoint in shards; returns (parameters, bytes)."""
  import numpy as np
  import transformers
  from safetensors.numpy import save_file

  d, f, v, n = args.hidden, args.intermediate, args.vocab, args.layers
  config = transformers.LlamaConfig(
      vocab_size=v, hidden_size=d, intermediate_size=f, num_hidden_layers=n,
      num_attention_heads=d // 64, num_key_value_heads=d // 64, tie_word_embeddings=False,
  )
  shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,),
            "lm_head.weight": (v, d)}
  for i in range(n):
    p = f"model.layers.{i}."
    shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
    for proj in "qkvo":
      shapes[p + f"self_attn.{proj}_proj.weight"] = (d, d)
    shapes.update({p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                   p + "mlp.down_proj.weight": (d, f)})
  rng = np.random.default_rng(0)
  limit = args.shard_mb * 2**20
  shards, current, size = [], {}, 0
  for name, shape in shapes.items():
    nbytes = 4 * int(np.prod(shape))
    if current and size + nbytes > limit:
      shards.append(current)
      current, size = {}, 0
    current[name] = shape
    size += nbytes
  shards.append(current)
  weight_map, total, params = {}, 0, 0
  for i, shard in enumerate(shards):
    file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    tensors = {name: rng.standard_normal(shape, dtype=np.float32) * 0.02
               for name, shape in shard.items()}
    save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
    for name, t in tensors.items():
      weight_map[name] = file
      total += t.nbytes
      params += t.size
    del tensors
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh)
  config.save_pretrained(path)
  return params, total


def main(argv=None):
  args = parse_args(argv)
  tmp = None
  path = args.dir
  if path is None:
    tmp = tempfile.TemporaryDirectory()
    path = tmp.name
  os.makedirs(path, exist_ok=True)
  params, nbytes = write_checkpoint(path, args)
  results = dict(params=params, checkpoint_bytes=nbytes, runs={}, host=host_record())
  print(f"checkpoint: {params / 1e6:.0f}M parameters, {nbytes / 2**30:.2f} GiB fp32; "
        f"{host_line(results['host'])}")
  for dtype in args.dtype:
    code = CHILD.format(dtype=f"jnp.{dtype}")
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True,
                         check=True)
    run = json.loads(out.stdout.strip().splitlines()[-1])
    peak, base = run["peak_kb"] * 1024, run["baseline_kb"] * 1024
    run.update(peak_over_checkpoint=peak / nbytes, peak_minus_baseline_over_checkpoint=(peak - base)
               / nbytes)
    target = nbytes * (0.5 if dtype == "bfloat16" else 1.0)
    run["peak_minus_baseline_over_loaded_weights"] = (peak - base) / target
    results["runs"][dtype] = run
    print(f"load as {dtype:<9}: {run['seconds']:.1f} s, peak RSS {peak / 2**30:.2f} GiB, "
          f"baseline {base / 2**30:.2f} GiB (jax runtime alone {run['runtime_kb'] / 2**20:.2f}); "
          f"(peak - baseline) / checkpoint = "
          f"{run['peak_minus_baseline_over_checkpoint']:.2f}, / loaded weights = "
          f"{run['peak_minus_baseline_over_loaded_weights']:.2f}")
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(results, fh, indent=2)
  if tmp is not None:
    tmp.cleanup()
  return results


if __name__ == "__main__":
  main()
