"""Per-device memory of one compiled PPO update of the tiny model, replicated (data=8) and
FSDP (fsdp=8), from abstract arrays (`jax_ppo.diagnostics.memory.update_memory`). Prints JSON."""

import json

from tiny_setup import MODEL

from jax_ppo.diagnostics.memory import update_memory
from jax_ppo.parallel import MeshConfig, make_mesh
from jax_ppo.ppo import PPOConfig, PPOSampling

config = PPOConfig(batch_size=8, sampling=PPOSampling(max_new_tokens=4), ppo_epochs=1)
print(json.dumps({
    layout: update_memory(MODEL, config, make_mesh(mesh), prompt_length=4)
    for layout, mesh in (("replicated", MeshConfig(data=8)), ("fsdp", MeshConfig(fsdp=-1,
                                                                                 data=1)))
}))
