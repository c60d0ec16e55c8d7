"""jax_ppo.models: decoder-only language models in Flax NNX, loaded from Hugging Face folders.

Families: GPT-2, Llama 2 / 3.x (rope_scaling "llama3", grouped-query attention), Mistral
(sliding window), Qwen2 / Qwen2.5 (q/k/v biases), Qwen3 (q/k RMSNorm, free head_dim), Gemma 2
(scaled embeddings, `1 + w` and sandwich norms, attention and final logit soft-capping, alternating
sliding windows); tied or untied embeddings. Not supported: Gemma 3 (per-layer RoPE bases).
Hyperparameters come from `transformers.AutoConfig.from_pretrained(path)` (local files only,
never remote code); weights from safetensors files, read one tensor at a time.

Shapes: `B` batch, `S` sequence, `T` cache length, `V` vocabulary, `D` hidden size, `L` layers,
`K` key/value heads, `Dh` head dim.

Loading, calling, saving
------------------------
    model = from_pretrained(path, dtype=jnp.bfloat16)        # NNX module (CausalLM)
    logits = model(input_ids, attention_mask=mask)           # [B, S, V]
    logits, h = model(ids, attention_mask=mask, return_hidden=True)   # h: [B, S, D]
    save_pretrained(model, out_path)                         # transformers-loadable folder

Ids must lie in `[0, vocab_size)` (an out-of-range id would embed as NaN): eager calls check
them (`VocabularyError`), traced calls do not; `Sampler` checks prompts before its jit.
`attention_mask` is `[B, S]`, 1 on real tokens; left padding is handled through it: positions are
`cumsum(mask) - 1` (`jax_ppo.core.position_ids_from_mask`) and pad slots are never attended.
`from_pretrained(path, *, dtype=None, param_dtype=None, remat="dots", scan_layers=True)`:
`dtype` is the compute dtype (None: float32), `param_dtype` the storage dtype (None: `dtype`).

Functional use (the project's convention): split once, merge inside pure functions::

    graphdef, state = nnx.split(model)
    @jax.jit
    def f(state, ids, mask):
      return nnx.merge(graphdef, state)(ids, attention_mask=mask)

Generation: prefill + single-step decode with a preallocated KV cache
-----------------------------------------------------------------------
    cache = init_cache(model.config, batch_size=B, max_length=T, dtype=jnp.bfloat16)
    # or model.init_cache(batch_size=B, max_length=T)  (compute dtype)
    logits_bv, cache = model.prefill(prompt_ids, prompt_mask, cache)   # or prefill(model, ...)
    logits_bv, cache = model.decode_step(token_ids_b, cache, valid=alive_b)

- `KVCache` (a NamedTuple pytree, usable as a `lax.while_loop` carry and donatable):
  `k`, `v` `[L, B, K, T, Dh]` (head-major); `mask` `[B, T]` bool (slot holds an attendable token);
  `slot_positions` `[B, T]` int32; `positions` `[B]` int32 (position id of the row's next
  token = its number of valid tokens); `index` `[]` int32 (next slot to write, shared by all rows).
- `prefill(input_ids [B, S], attention_mask [B, S], cache, *, all_logits=False,
  return_hidden=False, use_lora=True) -> (logits, cache)` (or `(logits, hidden, cache)`):
  prompts must be LEFT-padded (all rows end at slot S - 1); writes slots `[0, S)`, sets
  `index = S`. `logits` is `[B, V]` (next-token logits after the prompt), or `[B, S, V]` with
  `all_logits=True`. The cache's previous contents are ignored (prefill starts a sequence).
- `decode_step(token_ids [B], cache, *, valid=None, attend_length=None, use_lora=True) ->
  (logits [B, V], cache)`: writes the tokens at slot `index`, attends over every valid slot,
  returns the next-token logits. `valid` `[B]` bool: False for rows that already finished (their
  slot stays masked and their position does not advance); default all True. `attend_length`
  (a static int `A`): read only the cache's first `A` slots (the sampler's length-bucketed
  decode); None reads all `T`. The caller keeps `index < A` (or `< T`; not checked inside jit).
- Cached decoding reproduces the full forward on the concatenated sequence (tested with left
  padding). A sampler is one jitted program::

    @partial(jax.jit, donate_argnums=(1,))
    def generate(state, cache, prompt_ids, prompt_mask, key):
      model = nnx.merge(graphdef, state)
      logits, cache = model.prefill(prompt_ids, prompt_mask, cache)
      def body(carry): ... logits, cache = model.decode_step(tok, cache, valid=alive) ...
      return jax.lax.while_loop(cond, body, (cache, logits, ...))

Checkpoints and log-probs
-------------------------
`jax_ppo.models.hf` reads and writes Hugging Face folders: `hf.tensors` maps tensor names to our
parameters and builds the one read plan (which file, tensor and columns fill each parameter),
`hf.load` fills it on the host or, with `mesh=...`, straight into each device's shards, `hf.save`
writes safetensors files and the HF config, and `hf.hub` finds a Hub id (`org/name`) in the local
Hugging Face cache (`hub_model_folder`). `jax_ppo.models.logprobs` scores response tokens
under the LM head (`head_logprobs`, chunked over `T` above `LOGITS_CHUNK_BYTES` of float32 logits);
the teacher-forced pass over a prompt + response batch that calls it is
`jax_ppo.ppo.forward.response_logprobs`.

Heads
-----
- `model.hidden_states(ids, attention_mask=m) -> [B, S, D]` (trunk output after the final norm).
- `model.add_value_head()`: zero-initialised value head on the policy trunk;
  `model.values_from_hidden(h) -> [B, S]` float32.
- `ScalarModel` (trunk + `ScalarHead`): `m(ids, attention_mask=mask) -> [B, S]` per-token values,
  `m.score(ids, attention_mask=mask) -> [B]` read at the last valid token (rewards).
  `load_scalar_model(path, *, head_init=None)` reads `*ForSequenceClassification` checkpoints
  (their `score.weight`) or a causal-LM trunk with a new head (reward init N(0, 1/sqrt(D + 1)),
  bias 0; `has_score_head(path)` tells them apart from the files' headers).
  `value_model_from_reward_model(rm)` copies a reward model into a value model.

LoRA
----
`add_lora(model, LoRAConfig(rank=8, alpha=16, targets=("q", "v")), rngs=nnx.Rngs(0))` puts
`nnx.LoRAParam` adapters (B = 0) on the chosen projections; `split_lora(model)` returns
`(graphdef, lora_state, base_state)`; `model(..., use_lora=False)` is the reference model (same
base weights, adapters off); `merge_lora(model)` folds them in (`save_pretrained` does it);
`save_peft_adapter(model, path)` writes the adapters alone as a PEFT adapter folder.

Performance knobs
-----------------
`dtype` / `param_dtype`; `remat` in `REMAT_POLICIES` ("none", "layer"/"full", "dots" (the
default, `DEFAULT_REMAT`), "dots_all" or a `jax.checkpoint_policies` name) per layer,
`set_remat(model, name)` for a built model;
`scan_layers` (lax.scan over the stacked `[L, ...]` weights, or unrolled; `with layer_loop(model,
False): nnx.split(model)` switches an existing model temporarily). Attention never repeats K/V
over query groups and computes scores and softmax in float32.

Errors
------
Bad inputs raise subclasses of `ModelError` (a `ValueError`), each naming the file, field or id
and the fix: `ModelFileError` (missing, truncated or corrupt checkpoint files;
`MissingModelFileError` is also a `FileNotFoundError`), `UnsupportedModelError` (model_type or
option not implemented; lists the supported ones), `PadTokenError`, `VocabularyError`.

Tokenizers
----------
`load_tokenizer(path)`: the folder's `AutoTokenizer` (local only), left padding, and a pad token
distinct from every stop id: the tokenizer's own, else an existing unused special token (Llama
2 / Mistral: `<unk>`), else a `PadTokenError` naming the fixes (`pad_token=...`, or
`add_pad_token=True` plus `resize_token_embeddings(model, len(tokenizer))`, which appends
mean-initialised rows to the embedding and an untied head); `encode_chat(tokenizer,
conversations)` applies the chat template; `pad_batch(seqs, pad_token_id=..., length=...)`
left-pads id lists into `(ids, mask)`.
"""

from jax_ppo.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, RopeScaling
from jax_ppo.models.errors import (
    MissingModelFileError,
    ModelError,
    ModelFileError,
    PadTokenError,
    UnsupportedModelError,
    VocabularyError,
)
from jax_ppo.models.heads import ScalarModel, read_last_valid, value_model_from_reward_model
from jax_ppo.models.hf import (
    from_pretrained,
    has_score_head,
    hub_model_folder,
    load_config,
    load_scalar_model,
    save_peft_adapter,
    save_pretrained,
)
from jax_ppo.models.layers import ScalarHead, compute_weights
from jax_ppo.models.logprobs import LOGITS_CHUNK_BYTES, head_logprobs, logits_chunk
from jax_ppo.models.lora import LoRAConfig, add_lora, has_lora, merge_lora, split_lora
from jax_ppo.models.resize import resize_token_embeddings
from jax_ppo.models.tokenizer import (
    check_token_ids,
    check_vocab_covers,
    encode_chat,
    ensure_pad_token,
    load_tokenizer,
    pad_batch,
)
from jax_ppo.models.transformer import (
    DEFAULT_REMAT,
    REMAT_POLICIES,
    CausalLM,
    Decoder,
    KVCache,
    decode_step,
    init_cache,
    layer_loop,
    prefill,
    set_remat,
)

__all__ = [
    "DEFAULT_REMAT",
    "LOGITS_CHUNK_BYTES",
    "REMAT_POLICIES",
    "SUPPORTED_MODEL_TYPES",
    "CausalLM",
    "Decoder",
    "KVCache",
    "LoRAConfig",
    "MissingModelFileError",
    "ModelConfig",
    "ModelError",
    "ModelFileError",
    "PadTokenError",
    "RopeScaling",
    "ScalarHead",
    "ScalarModel",
    "UnsupportedModelError",
    "VocabularyError",
    "add_lora",
    "check_token_ids",
    "check_vocab_covers",
    "compute_weights",
    "decode_step",
    "encode_chat",
    "ensure_pad_token",
    "from_pretrained",
    "has_score_head",
    "hub_model_folder",
    "has_lora",
    "head_logprobs",
    "init_cache",
    "layer_loop",
    "load_config",
    "load_scalar_model",
    "load_tokenizer",
    "logits_chunk",
    "merge_lora",
    "pad_batch",
    "prefill",
    "read_last_valid",
    "resize_token_embeddings",
    "save_peft_adapter",
    "save_pretrained",
    "set_remat",
    "split_lora",
    "value_model_from_reward_model",
]
