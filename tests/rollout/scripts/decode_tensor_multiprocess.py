"""One process of tests/rollout/test_layout_multiprocess.py: the rollout on an FSDP mesh of 8
fake CPU devices and tensor-parallel on the same devices (`SamplingConfig.decode_tensor` 2 and
4), in one process or as a job of 2 processes x 4 devices (`jax.distributed`, gloo on
127.0.0.1).

    decode_tensor_multiprocess.py ROOT NAME [PORT NUM_PROCESSES PROCESS_ID]

NAME is "one" (one process: the reference) or "two" (with the job's PORT, size and index). Each
process fills only its own rows of the prompts (`host_rows.global_rows`, as the trainer does),
samples them with the same key in each layout, gathers the whole rollout and writes its tokens,
masks and log-probs, the rollout meshes and the rows it held to `ROOT/NAME_processI.json`. The
policy's state is a global array split on the FSDP rules, as a trainer's.
"""

import dataclasses
import faulthandler
import json
import pathlib
import sys

import jax
import numpy as np
from flax import nnx

from jax_ppo.parallel import MeshConfig, host_rows, make_mesh, rules
from jax_ppo.parallel.distributed import DistributedConfig, initialize
from jax_ppo.rollout.batching import left_pad_prompts
from jax_ppo.rollout.config import SamplingConfig
from jax_ppo.rollout.sampler import Sampler

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import decode_tensor  # noqa: E402  (its model: 8 query and 4 key/value heads)

# 8 prompts: one per device of the batch axes, so each process holds 4.
PROMPTS = [*decode_tensor.PROMPTS, [30, 31, 32], [9], [40, 41, 42, 43, 44], [12, 13]]


def main() -> None:
  root, name = pathlib.Path(sys.argv[1]), sys.argv[2]
  pid = 0
  if len(sys.argv) > 3:
    port, count, pid = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    initialize(DistributedConfig(coordinator_address=f"127.0.0.1:{port}", num_processes=count,
                                 process_id=pid, initialization_timeout=120))
  mesh = make_mesh(MeshConfig(data=1, fsdp=8))
  config = SamplingConfig(max_new_tokens=9, greedy=False, temperature=1.0, n_samples=2,
                          pad_token_id=0, stop_token_ids=(3,))
  model_config = decode_tensor.CONFIG
  ids, mask = left_pad_prompts(PROMPTS, config, vocab_size=model_config.vocab_size,
                               max_context=model_config.max_position_embeddings)
  shardings = rules.batch_shardings(ids, mesh)
  start, stop = host_rows.local_row_range(shardings, ids.shape)
  ids, mask = (host_rows.global_rows(x[start:stop], shardings, x.shape) for x in (ids, mask))
  model = decode_tensor.model()
  # The policy placed as a trainer places it: a global array over the mesh, split on the FSDP
  # rules, made on every process from the same host copy (the same seed everywhere).
  state = rules.shard_params(jax.tree.map(np.asarray, nnx.state(model)), mesh)
  # A typed key made on this process's first device (`jax_ppo.parallel.jit.place` puts it on
  # the mesh over both processes, which `jax.device_put` alone refuses).
  key = jax.random.key(5)
  result = {"process": jax.process_index(), "processes": jax.process_count(),
            "devices": jax.device_count(), "rows": [start, stop], "layouts": {}}
  for tensor in (None, 2, 4):
    sampler = Sampler(model, dataclasses.replace(config, decode_tensor=tensor), mesh=mesh)
    rollout = sampler.generate_padded(ids, mask, key, state=state)
    result["layouts"][f"decode_tensor={tensor}" if tensor else "fsdp"] = {
        "mesh": dict(sampler.mesh.shape),
        "global": host_rows.is_global(rollout.response_ids),
        "tokens": host_rows.gathered(rollout.response_ids).tolist(),
        "mask": host_rows.gathered(rollout.response_mask).astype(int).tolist(),
        "logprobs": np.asarray(host_rows.gathered(rollout.logprobs), np.float64).tolist(),
    }
  (root / f"{name}_process{pid}.json").write_text(json.dumps(result))
  print(json.dumps({"process": pid, "written": f"{name}_process{pid}.json"}))  # (run_on_devices)
  if jax.process_count() > 1:
    jax.distributed.shutdown()


if __name__ == "__main__":
  faulthandler.dump_traceback_later(400, exit=True)  # under run_processes_of's 420 s
  main()
