"""`from_pretrained(path, mesh=...)` reads each tensor into its shards; `save_pretrained` of the
sharded model writes the same files.

Usage: `sharded_loading.py TMPDIR`. For a Llama-style model (untied head, transposed torch
layout) and a GPT-2 model (fused `c_attn`, Conv1D layout, biases), saved from random weights:
loads it on one device and on a (data=2, fsdp=2, tensor=2) mesh, and prints JSON per family:
whether every parameter is equal, the sharding specs of a few parameters, and whether the files
written back from the sharded model equal the original ones.
"""

import dataclasses
import json
import os
import sys

import jax
import numpy as np
from flax import nnx, traverse_util
from safetensors.numpy import load_file
from tiny_setup import MODEL

from jax_ppo.models.config import ModelConfig
from jax_ppo.models.heads import ScalarModel
from jax_ppo.models.hf import from_pretrained, load, load_scalar_model, save_pretrained
from jax_ppo.models.transformer import CausalLM
from jax_ppo.parallel import MeshConfig, make_mesh

GPT2 = ModelConfig(
    model_type="gpt2", vocab_size=64, hidden_size=32, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=4, head_dim=8, max_position_embeddings=64, norm_type="layer",
    activation="gelu_new", gated_mlp=False, position_embedding="learned", qkv_bias=True,
    out_bias=True, mlp_bias=True, norm_eps=1e-5, tie_word_embeddings=True,
)


def flat_params(model):
  return traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model)))


def same_files(a: str, b: str) -> bool:
  ta, tb = load_file(os.path.join(a, "model.safetensors")), load_file(
      os.path.join(b, "model.safetensors"))
  return set(ta) == set(tb) and all(np.array_equal(ta[k], tb[k]) for k in ta)


def check(name: str, config: ModelConfig, tmp: str, mesh) -> dict:
  src, back = os.path.join(tmp, name), os.path.join(tmp, name + "_back")
  model = CausalLM(config, rngs=nnx.Rngs(0))
  # Biases and norm gains away from their init, so that a wrong slice shows.
  state = nnx.state(model)
  state = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.PRNGKey(x.size), x.shape),
                       state)
  nnx.update(model, state)
  save_pretrained(model, src)
  host = flat_params(from_pretrained(src))
  reads = []  # (tensor name, elements read) of every slice read from the files
  read_slice = load.read_slice

  def spy(file, name, index, **kw):
    out = read_slice(file, name, index, **kw)
    reads.append((name, out.size))
    return out

  load.read_slice = spy
  try:
    sharded_model = from_pretrained(src, mesh=mesh)
  finally:
    load.read_slice = read_slice
  sharded = flat_params(sharded_model)
  save_pretrained(sharded_model, back)
  equal = all(np.array_equal(np.asarray(host[p]), np.asarray(sharded[p])) for p in host)
  specs = {"/".join(p): str(x.sharding.spec) for p, x in sharded.items()
           if p[-2] in ("q", "embed", "up", "down", "attn_norm", "lm_head")}
  out = {"equal": equal, "same_paths": set(host) == set(sharded), "specs": specs,
         "files_equal": same_files(src, back),
         "on_mesh": all(x.sharding.mesh == mesh for x in sharded.values()),
         # the largest slice read, as a fraction of its tensor (1/4: split on fsdp and tensor)
         "embed_read_fraction": max(n for t, n in reads if t.endswith("wte.weight")
                                    or t.endswith("embed_tokens.weight"))
         / host[("decoder", "embed", "embedding")].size}
  if name == "llama":  # a reward model read from the same files, head on the mesh too
    rm = ScalarModel(config, rngs=nnx.Rngs(1))
    save_pretrained(rm, os.path.join(tmp, "rm"))
    host_rm = flat_params(load_scalar_model(os.path.join(tmp, "rm")))
    sharded_rm = flat_params(load_scalar_model(os.path.join(tmp, "rm"), mesh=mesh))
    out["scalar_equal"] = all(np.array_equal(np.asarray(host_rm[p]), np.asarray(sharded_rm[p]))
                              for p in host_rm)
  return out


def main():
  tmp = sys.argv[1]
  mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
  llama = dataclasses.replace(MODEL, tie_word_embeddings=False)
  print(json.dumps({"llama": check("llama", llama, tmp, mesh),
                    "gpt2": check("gpt2", GPT2, tmp, mesh)}))


if __name__ == "__main__":
  main()
