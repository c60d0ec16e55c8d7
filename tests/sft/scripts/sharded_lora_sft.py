"""LoRA SFT on one device and on a (data, fsdp, tensor) mesh, from the same model, adapters and
rows (tests/sft/test_sft_mesh.py; run in a subprocess with fake CPU devices).

Usage: `sharded_lora_sft.py DATA FSDP TENSOR`. Two steps and an evaluation of `sharded_sft.py`'s
configuration (AdamW's epsilon 1e-6) with rank-4 adapters (`LoRAConfig`'s default target
projections). Prints JSON with the largest difference of the trained adapters and optimizer state
between the two runs, how far the adapters moved, the metrics and evaluations of both, and the
shardings of the frozen base.
"""

import dataclasses
import faulthandler
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "parallel" / "scripts"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax  # noqa: E402
from flax import nnx  # noqa: E402
from sharded_sft import CONFIG, examples  # noqa: E402
from tiny_setup import MODEL, max_abs_diff  # noqa: E402

from jax_ppo.models import LoRAConfig, add_lora  # noqa: E402
from jax_ppo.models.transformer import CausalLM  # noqa: E402
from jax_ppo.parallel import MeshConfig, make_mesh  # noqa: E402
from jax_ppo.sft import SFTTrainer  # noqa: E402

# AdamW's epsilon raised from 1e-8 to 1e-6: after the zero-initialised lora_b, lora_a's gradients
# are ~1e-10, below 1e-8, where Adam moves a coordinate by lr * g / eps and so turns the mesh's
# other summation order (~1e-7 relative) into ~1e-5 of movement. The comparison tests the split,
# not Adam's conditioning at g ~ eps.
LORA_CONFIG = dataclasses.replace(CONFIG,
                                  optimizer=dataclasses.replace(CONFIG.optimizer, adam_eps=1e-6))


def model():
  return add_lora(CausalLM(MODEL, rngs=nnx.Rngs(0)), LoRAConfig(rank=4, alpha=8),
                  rngs=nnx.Rngs(1))


def run(mesh):
  trainer = SFTTrainer(LORA_CONFIG, model(), train_data=examples(40, 0), eval_data=examples(12, 1),
                       mesh=mesh)
  history = [trainer.step() for _ in range(2)]
  return trainer, history, trainer.evaluate()


def main():
  faulthandler.dump_traceback_later(360, exit=True)
  mesh = make_mesh(MeshConfig(data=int(sys.argv[1]), fsdp=int(sys.argv[2]),
                              tensor=int(sys.argv[3])))
  single, history1, eval1 = run(None)
  sharded, history8, eval8 = run(mesh)
  start = single.state.params  # the trained tree: the adapters alone
  print(json.dumps({
      "devices": len(jax.devices()),
      "trained_leaves": len(jax.tree.leaves(start)),
      "trained_paths_not_lora": [jax.tree_util.keystr(k) for k, _ in
                                 jax.tree_util.tree_leaves_with_path(start)
                                 if "lora" not in jax.tree_util.keystr(k).lower()],
      "base_leaves": len(jax.tree.leaves(nnx.state(CausalLM(MODEL, rngs=nnx.Rngs(0)),
                                                   nnx.Param))),
      "max_param_diff": max_abs_diff(single.state.params, sharded.state.params),
      "max_opt_diff": max_abs_diff(single.state.opt_state, sharded.state.opt_state),
      "moved": max_abs_diff(nnx.state(model(), nnx.LoRAParam), single.state.params),
      "metrics": [history1, history8],
      "eval": [eval1, eval8],
      "param_devices": len(jax.tree.leaves(sharded.state.params)[0].sharding.device_set),
      "base_specs": sorted({str(x.sharding.spec) for x in jax.tree.leaves(sharded.rest)
                            if hasattr(x, "sharding")}),
  }))


if __name__ == "__main__":
  main()
