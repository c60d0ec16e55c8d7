"""Hugging Face checkpoint folders in and out (safetensors, `config.json`).

* `tensors`: HF tensor names <-> our parameters (`tensor_specs`), the shape rules, the split of
  fused tensors, and the one `read_plan` (which file, tensor and columns fill each parameter);
* `load`: `from_pretrained`, `load_scalar_model` (`has_score_head`: does a folder hold one),
  `load_config`; the plan is filled on the host or, given a mesh, straight into each device's
  shards;
* `save`: `save_pretrained` (safetensors files, `config.json`, `generation_config.json`);
* `peft`: `save_peft_adapter`, a LoRA model's adapters as a PEFT adapter folder
  (`adapter_config.json`, `adapter_model.safetensors`) that `peft.PeftModel.from_pretrained` loads.
* `hub`: `hub_model_folder`, a Hugging Face Hub id (`org/name[@revision]`) as the folder of its
  snapshot in the local cache (never downloaded; an absent id names `hf download org/name`).
"""

from jax_ppo.models.hf.hub import (
    download_command,
    hub_cache_dir,
    hub_model_folder,
    is_hub_id,
    split_hub_id,
)
from jax_ppo.models.hf.load import (
    checkpoint_index,
    fill_on_host,
    fill_sharded,
    from_pretrained,
    has_score_head,
    load_config,
    load_params,
    load_scalar_model,
    read_slice,
    tensor_shape,
)
from jax_ppo.models.hf.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, peft_adapter, save_peft_adapter
from jax_ppo.models.hf.save import save_pretrained
from jax_ppo.models.hf.tensors import (
    INDEX_FILE,
    SCORE_BIAS_KEY,
    SINGLE_FILE,
    ReadPlan,
    Source,
    TensorSpec,
    read_plan,
    tensor_specs,
)

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "INDEX_FILE",
    "SCORE_BIAS_KEY",
    "SINGLE_FILE",
    "ReadPlan",
    "Source",
    "TensorSpec",
    "checkpoint_index",
    "download_command",
    "fill_on_host",
    "fill_sharded",
    "from_pretrained",
    "has_score_head",
    "hub_cache_dir",
    "hub_model_folder",
    "is_hub_id",
    "load_config",
    "load_params",
    "load_scalar_model",
    "peft_adapter",
    "read_plan",
    "read_slice",
    "save_peft_adapter",
    "save_pretrained",
    "split_hub_id",
    "tensor_shape",
    "tensor_specs",
]
