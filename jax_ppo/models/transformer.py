r"""The decoder shared by every family, its causal-LM head, and the KV cache for generation.

Layout of one block (pre-norm, as in GPT-2, Llama, Mistral and Qwen):

.. math::
   h &\leftarrow h + W_o\, \mathrm{Attn}(\mathrm{RoPE}(W_q n(h)), \mathrm{RoPE}(W_k n(h)),
        W_v n(h)) \\
   h &\leftarrow h + \mathrm{MLP}(n'(h)),\quad
   \mathrm{MLP}(x) = W_d(\sigma(W_g x) \odot W_u x) \text{ (gated) or } W_d \sigma(W_u x)

The `L` blocks are one `Block` module whose parameters carry a leading `[L]` axis; the forward
pass runs them with `jax.lax.scan` (one compiled block whatever the depth) or, with
`scan_layers=False`, unrolls a Python loop over the same stacked weights.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_ppo.core import position_ids_from_mask
from jax_ppo.models.cache import KVCache, init_cache
from jax_ppo.models.config import ModelConfig
from jax_ppo.models.layers import (
  Embed,
  Linear,
  Norm,
  ScalarHead,
  activation_fn,
  apply_rope,
  attention,
  rope_cos_sin,
)
from jax_ppo.models.packing import restrict_to_segments
from jax_ppo.models.tokenizer import check_token_ids
from jax_ppo.parallel.rules import (
  constrain_activations,
  gather_layer_weights,
  remat_gathered,
  stationary_activations,
  stationary_layer_weights,
)

Array = jax.Array

#: Rematerialisation of the per-layer body in the backward pass (`remat=`): "none"; "layer" or
#: "full" (recompute the whole block); "dots" (keep the weight matmuls' outputs); "dots_all"
#: (keep every matmul output, attention scores included); or the name of an argument-free
#: `jax.checkpoint_policies` policy.
REMAT_ALIASES = {
    "layer": "nothing_saveable",
    "full": "nothing_saveable",
    "dots": "dots_with_no_batch_dims_saveable",
    "dots_all": "dots_saveable",
}
#: The default of every model and run: keep the weight matmuls' outputs, recompute the elementwise
#: rest (GELU/SwiGLU terms, norms, softmax) and the attention matmuls. In one fused PPO update at
#: the GPT-2-small shape (12 layers, width 768, batch 8 x 80 tokens, 4 epochs, fp32) it halves the
#: program's temporary memory (2483 -> 1325 MiB, XLA's memory analysis) at the same update time on
#: a 2-core CPU; "none" keeps every intermediate of every layer (10 `[L, B, T, 4d]` buffers for a
#: GPT-2 MLP). `experiments/benchmarks/ppo_step.py --remat` measures it.
DEFAULT_REMAT = "dots"
REMAT_POLICIES = (
    "none", *REMAT_ALIASES, "nothing_saveable", "everything_saveable", "dots_saveable",
    "dots_with_no_batch_dims_saveable", "checkpoint_dots", "checkpoint_dots_with_no_batch_dims",
)


def remat_policy(name: str):
  """The `jax.checkpoint` policy of a `REMAT_POLICIES` name other than "none"."""
  if name == "none" or name not in REMAT_POLICIES:
    raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {name!r}.")
  return getattr(jax.checkpoint_policies, REMAT_ALIASES.get(name, name))


def _check_concrete_ids(ids, vocab_size: int) -> None:
  """Checks ids known on the host (eager calls, constants) against the vocabulary; traced ids
  (inside jit, the hot paths) are left alone: the `Sampler` checks prompts before its jit."""
  if not isinstance(ids, jax.core.Tracer):
    check_token_ids(np.asarray(ids), vocab_size, what="input_ids")


class Block(nnx.Module):
  """One transformer block; created with `stack=(L,)` it holds the weights of all `L` layers."""

  def __init__(
      self,
      config: ModelConfig,
      *,
      stack: tuple[int, ...] = (),
      dtype=jnp.float32,
      param_dtype=jnp.float32,
      rngs: nnx.Rngs,
  ):
    c = config
    d = c.hidden_size
    norm = dict(kind=c.norm_type, eps=c.norm_eps, offset=c.norm_offset, stack=stack, dtype=dtype,
                param_dtype=param_dtype)
    lin = dict(stack=stack, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.config = config
    self.attn_norm = Norm(d, **norm)
    self.q = Linear(d, c.q_size, use_bias=c.qkv_bias, **lin)
    self.k = Linear(d, c.kv_size, use_bias=c.qkv_bias, **lin)
    self.v = Linear(d, c.kv_size, use_bias=c.qkv_bias, **lin)
    self.o = Linear(c.q_size, d, use_bias=c.out_bias, **lin)
    if c.qk_norm:
      head_norm = dict(norm, kind="rms")
      self.q_norm = nnx.data(Norm(c.head_dim, **head_norm))
      self.k_norm = nnx.data(Norm(c.head_dim, **head_norm))
    else:
      self.q_norm = nnx.data(None)
      self.k_norm = nnx.data(None)
    self.mlp_norm = Norm(d, **norm)
    if c.sandwich_norms:
      self.post_attn_norm = nnx.data(Norm(d, **norm))
      self.post_mlp_norm = nnx.data(Norm(d, **norm))
    else:
      self.post_attn_norm = nnx.data(None)
      self.post_mlp_norm = nnx.data(None)
    if c.gated_mlp:
      self.gate = nnx.data(Linear(d, c.intermediate_size, use_bias=c.mlp_bias, **lin))
    else:
      self.gate = nnx.data(None)
    self.up = Linear(d, c.intermediate_size, use_bias=c.mlp_bias, **lin)
    self.down = Linear(c.intermediate_size, d, use_bias=c.mlp_bias, **lin)

  def qkv(self, x: Array, cos: Array | None, sin: Array | None, *, use_lora: bool):
    """Normed input `x` `[B, S, D]` -> `q` `[B, S, H, Dh]`, `k`, `v` `[B, S, K, Dh]`."""
    c = self.config
    b, s, _ = x.shape
    q = self.q(x, use_lora=use_lora).reshape(b, s, c.num_heads, c.head_dim)
    k = self.k(x, use_lora=use_lora).reshape(b, s, c.num_kv_heads, c.head_dim)
    v = self.v(x, use_lora=use_lora).reshape(b, s, c.num_kv_heads, c.head_dim)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    if cos is not None:
      q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return q, k, v

  def mlp(self, x: Array, *, use_lora: bool) -> Array:
    act = activation_fn(self.config.activation)
    if self.gate is not None:
      hidden = act(self.gate(x, use_lora=use_lora)) * self.up(x, use_lora=use_lora)
    else:
      hidden = act(self.up(x, use_lora=use_lora))
    return self.down(hidden, use_lora=use_lora)

  def finish(self, h: Array, attn_out: Array, *, use_lora: bool) -> Array:
    """Residual adds of the attention output `[B, S, H, Dh]` and of the MLP; returns new `h`."""
    b, s = attn_out.shape[:2]
    out = self.o(attn_out.reshape(b, s, -1), use_lora=use_lora)
    if self.post_attn_norm is not None:
      out = self.post_attn_norm(out)
    h = h + out.astype(h.dtype)
    out = self.mlp(self.mlp_norm(h), use_lora=use_lora)
    if self.post_mlp_norm is not None:
      out = self.post_mlp_norm(out)
    return h + out.astype(h.dtype)


class Decoder(nnx.Module):
  """Embeddings, the stacked blocks and the final norm: the trunk shared by every head.

  Args:
    config: architecture.
    dtype: compute dtype of activations and matmuls (norms and softmax stay float32).
    param_dtype: storage dtype of the parameters.
    remat: rematerialisation of each block in the backward pass: `"none"`, `"layer"`/`"full"`
      (recompute the whole block), `"dots"` (the default, `DEFAULT_REMAT`: keep the weight
      matmuls' outputs, recompute the rest), `"dots_all"` (keep every matmul output, attention
      scores included), or a `jax.checkpoint_policies` name (`REMAT_POLICIES`).
    scan_layers: run the blocks with `jax.lax.scan` (compile time independent of depth); False
      unrolls them.
  """

  def __init__(
      self,
      config: ModelConfig,
      *,
      dtype=jnp.float32,
      param_dtype=jnp.float32,
      remat: str = DEFAULT_REMAT,
      scan_layers: bool = True,
      rngs: nnx.Rngs,
  ):
    if remat not in REMAT_POLICIES:
      raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {remat!r}.")
    self.config = config
    self.dtype = dtype
    self.remat = remat
    self.scan_layers = scan_layers
    emb = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.embed = Embed(config.vocab_size, config.hidden_size, **emb)
    if config.position_embedding == "learned":
      self.pos_embed = nnx.data(Embed(config.max_position_embeddings, config.hidden_size, **emb))
    else:
      self.pos_embed = nnx.data(None)
    self.layers = Block(
        config, stack=(config.num_layers,), dtype=dtype, param_dtype=param_dtype, rngs=rngs
    )
    self.final_norm = Norm(
        config.hidden_size, kind=config.norm_type, eps=config.norm_eps, offset=config.norm_offset,
        dtype=dtype, param_dtype=param_dtype,
    )

  # -- shared pieces ------------------------------------------------------------------------------

  def _embed(self, input_ids: Array, positions: Array) -> Array:
    h = self.embed(input_ids)
    if self.config.embed_scale is not None:
      h = h * jnp.asarray(self.config.embed_scale, h.dtype)
    if self.pos_embed is not None:
      h = h + self.pos_embed(positions)
    return h

  def _rope(self, positions: Array):
    if self.config.position_embedding != "rope":
      return None, None
    return rope_cos_sin(positions, jnp.asarray(self.config.inv_frequencies()))

  def _windows(self) -> Array | None:
    windows = self.config.window_per_layer
    return None if windows is None else jnp.asarray(np.asarray(windows, np.int32))

  def _run_layers(self, body, carry, *, gather_weights: bool = True):
    """Applies `body(carry, layer, layer_index, window) -> (carry, y)` over the L layers.

    `layer` is a `Block` holding one layer's weights; `window` is that layer's sliding window
    (int32 scalar) or None. Returns the final carry and the `ys` stacked over layers.
    `gather_weights`: under a mesh with `fsdp`, gather each layer's weights before its body
    (`gather_layer_weights`: what a forward over many tokens wants); False pins them to their
    FSDP split (`stationary_layer_weights`: the decode step, which moves activations instead).
    """
    graphdef, state = nnx.split(self.layers)
    n = self.config.num_layers

    def step(carry, x):
      layer_state, i, window = x
      if gather_weights:
        layer_state = gather_layer_weights(layer_state)  # FSDP under a mesh, else identity
      else:
        layer_state = stationary_layer_weights(layer_state)  # kept split (identity without)
      return body(carry, nnx.merge(graphdef, layer_state), i, window)

    if self.remat != "none":
      step = jax.checkpoint(
          step, policy=remat_policy(self.remat), prevent_cse=not self.scan_layers
      )
    else:  # FSDP under a mesh: the gathered weights are not kept for the backward pass
      step = remat_gathered(step, prevent_cse=not self.scan_layers)
    xs = (state, jnp.arange(n, dtype=jnp.int32), self._windows())
    if self.scan_layers:
      return jax.lax.scan(step, carry, xs)
    ys = []
    for i in range(n):
      carry, y = step(carry, jax.tree.map(lambda a, i=i: a[i], xs))
      ys.append(y)
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)

  # -- full forward -------------------------------------------------------------------------------

  def __call__(
      self,
      input_ids: Array,
      attention_mask: Array | None = None,
      *,
      positions: Array | None = None,
      segment_ids: Array | None = None,
      use_lora: bool = True,
      return_kv: bool = False,
  ):
    """Final hidden states `[B, S, D]` (after the final norm) of a padded batch.

    Args:
      input_ids: `[B, S]` int token ids.
      attention_mask: `[B, S]` bool/int, 1 on real tokens (left or right padding); None means
        all ones. Query `s` attends to key `t` iff `t <= s` and `attention_mask[b, t]` (and, with a
        sliding window, `pos_s - pos_t < window`; with `segment_ids`, `t` is in `s`'s segment).
      positions: `[B, S]` int position ids; default `cumsum(mask) - 1` (docs/rlhf_details.md
        item 2), restarting at 0 in each segment with `segment_ids`.
      segment_ids: `[B, S]` int sequence of each slot of packed rows (`models.packing`) or None.
      use_lora: apply the LoRA adapters (False gives the frozen base / reference model).
      return_kv: also return the per-layer keys and values `[L, B, S, K, Dh]` (for `prefill`).

    Returns:
      `h` `[B, S, D]` in the compute dtype, or `(h, (k, v))` with `return_kv`.

    Raises:
      VocabularyError: (eager calls only) an id outside `[0, vocab_size)`, which would embed as
        NaN; under `jax.jit` ids are traced and not checked.
    """
    if input_ids.ndim != 2:
      raise ValueError(f"`input_ids` must be [B, S], got shape {input_ids.shape}.")
    _check_concrete_ids(input_ids, self.config.vocab_size)
    b, s = input_ids.shape
    if attention_mask is None:
      attention_mask = jnp.ones((b, s), bool)
    if attention_mask.shape != (b, s):
      raise ValueError(f"`attention_mask` must be [B, S] = {(b, s)}, got {attention_mask.shape}.")
    valid = attention_mask != 0
    causal = jnp.tril(jnp.ones((s, s), bool))
    base_mask = causal[None] & valid[:, None, :]
    if segment_ids is not None:
      base_mask, positions = restrict_to_segments(base_mask, segment_ids, positions)
    if positions is None:
      positions = position_ids_from_mask(valid)
    h = self._embed(input_ids, positions)
    cos, sin = self._rope(positions)
    distance = positions[:, :, None] - positions[:, None, :]

    def body(h, layer: Block, i, window):
      del i
      h = constrain_activations(h)  # rows split over the mesh's batch axes (identity without)
      q, k, v = layer.qkv(layer.attn_norm(h), cos, sin, use_lora=use_lora)
      mask = base_mask if window is None else base_mask & (distance < window)
      out = attention(q, k, v, mask, scale=self.config.query_scale,
                      softcap=self.config.attn_softcap)
      h = layer.finish(h, out, use_lora=use_lora)
      return h, ((k, v) if return_kv else None)

    h, kv = self._run_layers(body, h)
    h = self.final_norm(h)
    return (h, kv) if return_kv else h

  # -- generation ---------------------------------------------------------------------------------

  def prefill(
      self, input_ids: Array, attention_mask: Array, cache: KVCache, *, use_lora: bool = True
  ) -> tuple[Array, KVCache]:
    """Runs a left-padded prompt and writes its keys/values to slots `[0, S)` of a fresh cache.

    Returns the hidden states `[B, S, D]` and the cache with `index = S`,
    `positions = attention_mask.sum(1)`.
    """
    b, s = input_ids.shape
    if cache.k.shape[1] != b or cache.max_length < s:
      raise ValueError(
          f"Cache [L, B, K, T, Dh] = {cache.k.shape} cannot hold a prompt of shape {(b, s)}."
      )
    valid = attention_mask != 0
    positions = position_ids_from_mask(valid)
    h, (k, v) = self(input_ids, valid, positions=positions, use_lora=use_lora, return_kv=True)
    zero = jnp.zeros((), jnp.int32)
    t = cache.max_length
    heads_first = lambda x, dtype: jnp.swapaxes(x, 2, 3).astype(dtype)  # [L, B, K, S, Dh]
    cache = KVCache(
        k=jax.lax.dynamic_update_slice(cache.k, heads_first(k, cache.k.dtype), (zero,) * 5),
        v=jax.lax.dynamic_update_slice(cache.v, heads_first(v, cache.v.dtype), (zero,) * 5),
        mask=jnp.zeros((b, t), bool).at[:, :s].set(valid),
        slot_positions=jnp.zeros((b, t), jnp.int32).at[:, :s].set(positions),
        positions=jnp.sum(valid, axis=1).astype(jnp.int32),
        index=jnp.asarray(s, jnp.int32),
    )
    return h, cache

  def decode_step(
      self,
      token_ids: Array,
      cache: KVCache,
      *,
      valid: Array | None = None,
      attend_length: int | None = None,
      use_lora: bool = True,
  ) -> tuple[Array, KVCache]:
    """Appends one token per row at slot `cache.index`; returns hidden `[B, D]` and the cache.

    Args:
      token_ids: `[B]` int ids of the tokens to append.
      cache: the cache after `prefill` (and earlier steps); must satisfy `index < max_length`
        (not checked inside jit: a full cache overwrites its last slot).
      valid: `[B]` bool, False for rows whose token is padding (a finished sequence): the slot is
        then masked for later steps and the row's position does not advance. Default all True.
      attend_length: static `A <= T`: attention reads only the cache's first `A` slots
        (`[L, B, K, A, Dh]` of keys and values, `[B, A]` of the mask), so a step reads the
        bytes of the slots that can be live instead of the whole cache; the caller keeps
        `index < A` (not checked inside jit). Slots at or past `index` are never attendable
        (masked, sliding windows included: the cache is linear, windows are a mask on
        positions), so the result equals the full read but for the float summation order.
        None: all `T` slots.
      use_lora: apply the LoRA adapters.
    """
    if token_ids.ndim != 1:
      raise ValueError(f"`token_ids` must be [B], got shape {token_ids.shape}.")
    t = cache.max_length
    a = t if attend_length is None else attend_length
    if not isinstance(a, int) or isinstance(a, bool) or not 1 <= a <= t:
      raise ValueError(
          f"`attend_length` must be a static int in [1, {t}] (the cache's length), got "
          f"{attend_length!r}.")
    b = token_ids.shape[0]
    if valid is None:
      valid = jnp.ones((b,), bool)
    valid = valid.astype(bool)
    pos = cache.positions
    index = cache.index
    zero = jnp.zeros((), jnp.int32)
    mask = jax.lax.dynamic_update_slice(cache.mask, valid[:, None], (zero, index))
    slot_pos = jax.lax.dynamic_update_slice(cache.slot_positions, pos[:, None], (zero, index))
    h = self._embed(token_ids[:, None], pos[:, None])
    cos, sin = self._rope(pos[:, None])
    distance = pos[:, None, None] - slot_pos[:, None, :a]  # [B, 1, A]
    base_mask = mask[:, None, :a]

    def body(carry, layer: Block, i, window):
      h, k_all, v_all = carry
      h = stationary_activations(h)  # split on `D` like the weights (identity without a mesh)
      q, k, v = layer.qkv(layer.attn_norm(h), cos, sin, use_lora=use_lora)
      at = (i, zero, zero, index, zero)
      new_slot = lambda x, dtype: jnp.swapaxes(x, 1, 2)[None].astype(dtype)  # [1, B, K, 1, Dh]
      k_all = jax.lax.dynamic_update_slice(k_all, new_slot(k, k_all.dtype), at)
      v_all = jax.lax.dynamic_update_slice(v_all, new_slot(v, v_all.dtype), at)
      # Layer i's first `a` slots, [B, K, A, Dh] (all T slots when `a == T`).
      live = lambda x: jax.lax.dynamic_slice(
          x, (i, zero, zero, zero, zero), (1, *x.shape[1:3], a, x.shape[4]))[0].astype(q.dtype)
      k_l, v_l = live(k_all), live(v_all)
      att_mask = base_mask if window is None else base_mask & (distance < window)
      out = attention(q, k_l, v_l, att_mask, scale=self.config.query_scale,
                      softcap=self.config.attn_softcap, heads_first=True)
      return (layer.finish(h, out, use_lora=use_lora), k_all, v_all), None

    # One token per row: the layers' weights stay where FSDP put them (no per-layer gather).
    # A gather would move every layer's `D x F` matrices to every device at every step; with
    # the weights pinned split on `D` and the rows' activations split on `D` like them, each
    # projection all-reduces its `[B, F]` partial sums and a device reads `1/fsdp` of the
    # weights per token (docs/accelerators.md, "The rollout's layout").
    (h, k_all, v_all), _ = self._run_layers(body, (h, cache.k, cache.v), gather_weights=False)
    h = self.final_norm(h)[:, 0]
    cache = KVCache(
        k=k_all,
        v=v_all,
        mask=mask,
        slot_positions=slot_pos,
        positions=pos + valid.astype(jnp.int32),
        index=index + 1,
    )
    return h, cache


class CausalLM(nnx.Module):
  """A decoder with a language-modelling head: `model(ids, attention_mask=m)` -> logits.

  Args:
    config: architecture (`ModelConfig`).
    dtype: compute dtype (activations, matmuls, logits).
    param_dtype: storage dtype of the parameters.
    remat: see `Decoder`.
    scan_layers: see `Decoder`.
    rngs: random initialisation (normal, std 0.02; norms at 1, biases at 0).
  """

  def __init__(
      self,
      config: ModelConfig,
      *,
      dtype=jnp.float32,
      param_dtype=jnp.float32,
      remat: str = DEFAULT_REMAT,
      scan_layers: bool = True,
      rngs: nnx.Rngs,
  ):
    self.config = config
    self.dtype = dtype
    self.decoder = Decoder(
        config, dtype=dtype, param_dtype=param_dtype, remat=remat, scan_layers=scan_layers,
        rngs=rngs,
    )
    if config.tie_word_embeddings:
      self.lm_head = nnx.data(None)
    else:
      self.lm_head = nnx.data(
          Linear(config.hidden_size, config.vocab_size, use_bias=False, dtype=dtype,
                 param_dtype=param_dtype, rngs=rngs)
      )
    self.value_head = nnx.data(None)

  def logits_from_hidden(self, h: Array) -> Array:
    """`h` `[..., D]` final hidden states -> logits `[..., V]` in the compute dtype."""
    if self.lm_head is None:
      logits = self.decoder.embed.attend(h)
    else:
      logits = self.lm_head(h, use_lora=False)
    cap = self.config.final_softcap
    if cap is not None:
      logits = (cap * jnp.tanh(logits.astype(jnp.float32) / cap)).astype(logits.dtype)
    return logits

  def hidden_states(
      self,
      input_ids: Array,
      attention_mask: Array | None = None,
      *,
      positions: Array | None = None,
      segment_ids: Array | None = None,
      use_lora: bool = True,
  ) -> Array:
    """Final hidden states `[B, S, D]` of the trunk (after the final norm), for heads."""
    return self.decoder(input_ids, attention_mask, positions=positions, segment_ids=segment_ids,
                        use_lora=use_lora)

  def __call__(
      self,
      input_ids: Array,
      attention_mask: Array | None = None,
      *,
      positions: Array | None = None,
      segment_ids: Array | None = None,
      use_lora: bool = True,
      return_hidden: bool = False,
  ):
    """Logits `[B, S, V]` of a (left-)padded batch; see `Decoder.__call__` for the arguments.

    With `return_hidden=True` returns `(logits, hidden)`, hidden `[B, S, D]`; a value head on
    the same trunk reads `hidden` (`values_from_hidden`) without a second forward pass.
    """
    h = self.decoder(input_ids, attention_mask, positions=positions, segment_ids=segment_ids,
                     use_lora=use_lora)
    logits = self.logits_from_hidden(h)
    return (logits, h) if return_hidden else logits

  # -- value head on the policy trunk -------------------------------------------------------------

  def add_value_head(self) -> None:
    """Adds a zero-initialised scalar value head on this trunk (docs/rlhf_details.md item 15)."""
    self.value_head = ScalarHead(
        self.config.hidden_size, init="zeros", param_dtype=self.decoder.embed.embedding.dtype,
        rngs=nnx.Rngs(0),
    )

  def values_from_hidden(self, h: Array) -> Array:
    """Per-token values `[B, S]` float32 from hidden states `[B, S, D]` (needs a value head)."""
    if self.value_head is None:
      raise ValueError("This model has no value head; call `add_value_head()` first.")
    return self.value_head(h)

  # -- generation ---------------------------------------------------------------------------------

  def init_cache(self, *, batch_size: int, max_length: int, dtype=None) -> KVCache:
    """An empty `KVCache` in the compute dtype (or `dtype`)."""
    return init_cache(
        self.config, batch_size=batch_size, max_length=max_length, dtype=dtype or self.dtype
    )

  def prefill(
      self,
      input_ids: Array,
      attention_mask: Array,
      cache: KVCache,
      *,
      all_logits: bool = False,
      return_hidden: bool = False,
      use_lora: bool = True,
  ):
    """Processes a left-padded prompt batch into a fresh cache.

    Args:
      input_ids: `[B, S]` prompt ids, left-padded (all rows end at slot `S - 1`).
      attention_mask: `[B, S]`, 1 on prompt tokens.
      cache: a cache from `init_cache` with `max_length >= S` (its contents are overwritten).
      all_logits: return logits for every prompt slot `[B, S, V]` instead of the last `[B, V]`.
      return_hidden: also return the final hidden states `[B, S, D]`.
      use_lora: apply the LoRA adapters.

    Returns:
      `(logits, cache)` or `(logits, hidden, cache)`; `logits` `[B, V]` (the next-token
      distribution after the prompt) or `[B, S, V]`.
    """
    h, cache = self.decoder.prefill(input_ids, attention_mask, cache, use_lora=use_lora)
    logits = self.logits_from_hidden(h if all_logits else h[:, -1])
    return (logits, h, cache) if return_hidden else (logits, cache)

  def decode_step(
      self,
      token_ids: Array,
      cache: KVCache,
      *,
      valid: Array | None = None,
      attend_length: int | None = None,
      use_lora: bool = True,
  ) -> tuple[Array, KVCache]:
    """Appends `token_ids` `[B]` to the cache; returns next-token logits `[B, V]` and the cache.

    See `Decoder.decode_step` for `valid` (False on rows that have finished) and
    `attend_length` (attend over the cache's first slots only).
    """
    h, cache = self.decoder.decode_step(token_ids, cache, valid=valid,
                                        attend_length=attend_length, use_lora=use_lora)
    return self.logits_from_hidden(h), cache


@contextlib.contextmanager
def layer_loop(model: nnx.Module, scan_layers: bool | None):
  """Within the block, every `Decoder` in `model` runs its layers with `lax.scan` (True) or
  unrolled (False); None leaves them as they are. The previous settings come back on exit.

  The parameters are the same stacked `[L, ...]` arrays either way, so graph definitions split
  inside the block (`nnx.split`) run the same state with a different layer loop: the trainer
  uses it to unroll the training forward/backward (no per-layer weight copies) while the sampler
  keeps the scan (on CPU the scanned decode step is ~2.5x faster than the unrolled one).
  """
  decoders = [m for _, m in nnx.iter_modules(model) if isinstance(m, Decoder)]
  before = [d.scan_layers for d in decoders]
  if scan_layers is not None:
    for d in decoders:
      d.scan_layers = bool(scan_layers)
  try:
    yield model
  finally:
    for d, scan in zip(decoders, before, strict=True):
      d.scan_layers = scan


def set_remat(model: nnx.Module, remat: str) -> nnx.Module:
  """Sets the rematerialisation policy (`REMAT_POLICIES`) of every `Decoder` in `model` (a
  `CausalLM`, `ScalarModel`, ...) in place and returns `model`. It takes effect in graph
  definitions split afterwards (`nnx.split`); the parameters are unchanged."""
  if remat not in REMAT_POLICIES:
    raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {remat!r}.")
  for _, m in nnx.iter_modules(model):
    if isinstance(m, Decoder):
      m.remat = remat
  return model


def prefill(model: CausalLM, input_ids: Array, attention_mask: Array, cache: KVCache, **kwargs):
  """Function form of `CausalLM.prefill`."""
  return model.prefill(input_ids, attention_mask, cache, **kwargs)


def decode_step(model: CausalLM, token_ids: Array, cache: KVCache, **kwargs):
  """Function form of `CausalLM.decode_step`."""
  return model.decode_step(token_ids, cache, **kwargs)
