"""Building blocks of the decoder: projections with optional LoRA, norms, RoPE, attention, and the
scalar head of reward and value models (`ScalarHead`).

Every parameter may carry leading "stack" axes (`[L, ...]` for the layer stack): modules are
created once with `stack=(L,)` and sliced by `jax.lax.scan` in `transformer.py`, so their
`__call__` never assumes a rank for anything but the last axes of a parameter.

Parameters are stored in `param_dtype` and cast to the compute `dtype` when used. Norms,
softmax and RoPE angles are computed in float32 whatever the compute dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array

#: Projections that LoRA can adapt, by the name used in `LoRAConfig.targets`.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def activation_fn(name: str) -> Callable[[Array], Array]:
  """The MLP nonlinearity called `name` in transformers' ACT2FN."""
  if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
    return lambda x: jax.nn.gelu(x, approximate=True)
  if name == "gelu":
    return lambda x: jax.nn.gelu(x, approximate=False)
  if name in ("silu", "swish"):
    return jax.nn.silu
  if name == "relu":
    return jax.nn.relu
  raise ValueError(f"Unsupported activation {name!r}.")


def _normal(std: float):
  return nnx.initializers.normal(stddev=std)


class Linear(nnx.Module):
  r"""Affine map `y = x W + b` with an optional low-rank adapter (LoRA, Hu et al. 2021).

  .. math::  y = x W + b + \frac{\alpha}{r} (x A) B

  `W` is `[*stack, in, out]` (`nnx.Param`), `b` `[*stack, out]`; the adapter's `A`
  `[*stack, in, r]` and `B` `[*stack, r, out]` are `nnx.LoRAParam`s, so that
  `nnx.split(model, nnx.LoRAParam, ...)` separates the trainable adapters from the frozen base.
  `B` starts at zero: a freshly adapted model equals its base.
  """

  def __init__(
      self,
      in_features: int,
      out_features: int,
      *,
      use_bias: bool,
      stack: tuple[int, ...] = (),
      init_std: float = 0.02,
      dtype=jnp.float32,
      param_dtype=jnp.float32,
      rngs: nnx.Rngs,
  ):
    self.in_features = in_features
    self.out_features = out_features
    self.dtype = dtype
    self.kernel = nnx.Param(
        _normal(init_std)(rngs.params(), (*stack, in_features, out_features), param_dtype)
    )
    self.bias = nnx.data(
        nnx.Param(jnp.zeros((*stack, out_features), param_dtype)) if use_bias else None
    )
    self.lora_a = nnx.data(None)
    self.lora_b = nnx.data(None)
    self.lora_scale = 0.0

  def add_lora(self, *, rank: int, alpha: float, rngs: nnx.Rngs) -> None:
    """Attaches a rank-`rank` adapter scaled by `alpha / rank`; `A` ~ N(0, 1/in), `B` = 0."""
    stack = self.kernel.shape[:-2]
    dtype = self.kernel.dtype
    self.lora_a = nnx.LoRAParam(
        _normal(1.0 / math.sqrt(self.in_features))(
            rngs.params(), (*stack, self.in_features, rank), dtype
        )
    )
    self.lora_b = nnx.LoRAParam(jnp.zeros((*stack, rank, self.out_features), dtype))
    self.lora_scale = float(alpha) / rank

  def merged_kernel(self) -> Array:
    """`W + (alpha / r) A B` in float32 (the kernel to export), `[*stack, in, out]`."""
    w = self.kernel[...].astype(jnp.float32)
    if self.lora_a is None:
      return w
    delta = jnp.matmul(self.lora_a[...].astype(jnp.float32), self.lora_b[...].astype(jnp.float32))
    return w + self.lora_scale * delta

  def __call__(self, x: Array, *, use_lora: bool = True) -> Array:
    """`x` `[..., in]` -> `[..., out]` in the compute dtype."""
    x = x.astype(self.dtype)
    y = jnp.dot(x, self.kernel[...].astype(self.dtype))
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    if use_lora and self.lora_a is not None:
      down = jnp.dot(x, self.lora_a[...].astype(self.dtype))
      y = y + self.lora_scale * jnp.dot(down, self.lora_b[...].astype(self.dtype))
    return y


class Norm(nnx.Module):
  r"""RMSNorm (:math:`x / \sqrt{\overline{x^2} + \epsilon} \cdot g`, Zhang & Sennrich 2019) or
  LayerNorm (:math:`(x - \bar x) / \sqrt{\mathrm{Var}\,x + \epsilon} \cdot g + b`), over the last
  axis, computed in float32 and returned in the compute dtype (as transformers does).

  With `offset` (Gemma: 1) the RMSNorm gain is :math:`g = \text{offset} + w`, `w` starting at 0,
  and the product is taken in float32 before the cast (Gemma's order).
  """

  def __init__(
      self,
      features: int,
      *,
      kind: str,
      eps: float,
      offset: float = 0.0,
      stack: tuple[int, ...] = (),
      dtype=jnp.float32,
      param_dtype=jnp.float32,
  ):
    self.kind = kind
    self.eps = eps
    self.offset = offset
    self.dtype = dtype
    self.scale = nnx.Param(jnp.full((*stack, features), 1.0 - offset, param_dtype))
    self.bias = nnx.data(
        nnx.Param(jnp.zeros((*stack, features), param_dtype)) if kind == "layer" else None
    )

  def __call__(self, x: Array) -> Array:
    x32 = x.astype(jnp.float32)
    if self.kind == "layer":
      x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(var + self.eps)
    if self.kind == "rms" and self.offset:
      return (y * (self.offset + self.scale[...].astype(jnp.float32))).astype(self.dtype)
    if self.kind == "rms":
      # transformers casts back to the input dtype before the scale (Llama, Qwen).
      return (self.scale[...].astype(self.dtype) * y.astype(self.dtype)).astype(self.dtype)
    y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
    return y.astype(self.dtype)


class Embed(nnx.Module):
  """Token (or position) embedding table `[num, features]`; also the tied output projection."""

  def __init__(
      self,
      num: int,
      features: int,
      *,
      init_std: float = 0.02,
      dtype=jnp.float32,
      param_dtype=jnp.float32,
      rngs: nnx.Rngs,
  ):
    self.dtype = dtype
    self.embedding = nnx.Param(_normal(init_std)(rngs.params(), (num, features), param_dtype))

  def __call__(self, ids: Array) -> Array:
    """`ids` `[...]` int -> `[..., features]`."""
    return jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)

  def attend(self, x: Array) -> Array:
    """Tied output projection: `x` `[..., features]` -> `[..., num]` = `x E^T`."""
    return jnp.dot(x.astype(self.dtype), self.embedding[...].astype(self.dtype).T)


#: Variables that `Linear` and `Embed` cast to their compute dtype before every use.
CAST_VARIABLES = ("kernel", "bias", "lora_a", "lora_b", "embedding")


def compute_weights(state, dtype):
  """`state` (a model's parameters, or any pytree whose paths end in their names) with every
  floating leaf that `Linear` and `Embed` cast to the compute dtype before use
  (`CAST_VARIABLES`) cast to `dtype` ahead of time; norm scales and other leaves unchanged.

  A program run on the result computes exactly what it computes on `state` (the layers' casts
  become identities) and reads `dtype`'s bytes, not the float32 masters'.
  """
  def one(path, x):
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    if names and names[-1] == "value":  # an `nnx.Variable`'s array
      names.pop()
    if names and names[-1] in CAST_VARIABLES and jnp.issubdtype(x.dtype, jnp.floating):
      return x.astype(dtype)
    return x

  return jax.tree_util.tree_map_with_path(one, state)


def rope_cos_sin(positions: Array, inv_freq: Array) -> tuple[Array, Array]:
  r"""Rotary tables for `positions` `[B, S]`: `cos`, `sin` `[B, S, Dh]` float32.

  Angle :math:`\phi_{t,i} = p_t f_i`, repeated over both halves of the head (transformers'
  rotate-half layout): `cos = concat(cos phi, cos phi)`.
  """
  angles = positions.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
  r"""Rotates `x` `[B, S, N, Dh]` by the angles of `cos`/`sin` `[B, S, Dh]` (Su et al. 2021).

  .. math::  x' = x \cos\phi + \mathrm{rotate\_half}(x) \sin\phi,\quad
     \mathrm{rotate\_half}([x_1, x_2]) = [-x_2, x_1]
  """
  half = x.shape[-1] // 2
  x32 = x.astype(jnp.float32)
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
  return out.astype(x.dtype)


def _fused_implementation(dtype) -> str:
  """`jax.nn.dot_product_attention`'s implementation for a compute dtype: cuDNN's fused (flash)
  kernel on NVIDIA GPUs in bfloat16/float16 (the dtypes it supports), XLA's otherwise."""
  if jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16):
    return "cudnn"
  return "xla"


def attention(
    q: Array,
    k: Array,
    v: Array,
    mask: Array,
    *,
    scale: float,
    softcap: float | None = None,
    heads_first: bool = False,
) -> Array:
  r"""Grouped-query attention :math:`\mathrm{softmax}(s\, q k^\top + \text{mask})\, v`.

  Two paths, the same function (tests/models/test_parity.py holds both against transformers):

  - fused: `jax.nn.dot_product_attention` (XLA's implementation; on NVIDIA GPUs in
    bfloat16/float16 cuDNN's flash kernel, falling back to XLA's where cuDNN refuses the
    shapes). Used for the full-sequence forward (training, teacher forcing, prefill) without
    soft-capping. Sliding windows, padding and segments are all in `mask`.
  - explicit (`_explicit_attention`): einsums with a float32 softmax. Used where the fused
    function does not apply: Gemma 2's logit soft-capping (`softcap`: `dot_product_attention`
    has no cap on the scores) and the decode step's `heads_first` cache layout (one query per
    row, nothing for a flash kernel to gain; transposing the cache each step would cost more).

  Both keep keys and values unrepeated over the query groups and give a row with no visible key
  (a padding query) the uniform average of the values instead of NaN.

  Args:
    q: `[B, S, H, Dh]` queries.
    k: `[B, T, K, Dh]` keys, `K` dividing `H` (`[B, K, T, Dh]` with `heads_first`).
    v: `[B, T, K, Dh]` values (`[B, K, T, Dh]` with `heads_first`).
    mask: `[B, S, T]` bool, True where query `s` may attend to key `t`.
    scale: multiplier of the scores (usually `Dh ** -0.5`).
    softcap: if set, scores become `softcap * tanh(scores / softcap)` before masking (Gemma 2).
    heads_first: keys and values are laid out `[B, K, T, Dh]` (the KV cache's layout: each
      head's keys are contiguous, so both contractions are plain batched matmuls).

  Returns:
    `[B, S, H, Dh]` in the dtype of `v`.
  """
  if softcap is not None or heads_first:
    return _explicit_attention(q, k, v, mask, scale=scale, softcap=softcap,
                               heads_first=heads_first)
  q = q.astype(v.dtype)
  k = k.astype(v.dtype)
  implementation = _fused_implementation(v.dtype)
  call = lambda impl: jax.nn.dot_product_attention(
      q, k, v, mask=mask[:, None], scale=float(scale), implementation=impl
  )
  if implementation == "cudnn":
    try:
      return call("cudnn").astype(v.dtype)
    except (ValueError, NotImplementedError, RuntimeError):
      pass  # shapes or masks cuDNN does not support: XLA's implementation below.
  return call("xla").astype(v.dtype)


def _explicit_attention(
    q: Array, k: Array, v: Array, mask: Array, *, scale: float, softcap: float | None,
    heads_first: bool,
) -> Array:
  """`attention` as einsums with a float32 softmax (soft-capping, the decode cache layout).

  Queries are viewed as `[B, S, K, H/K, Dh]` and contracted against `[B, T, K, Dh]`; masked
  scores get the most negative float32.
  """
  b, s, h, dh = q.shape
  kv_heads = k.shape[1 if heads_first else 2]
  kv = "bktd" if heads_first else "btkd"
  q = (q * jnp.asarray(scale, q.dtype)).reshape(b, s, kv_heads, h // kv_heads, dh)
  scores = jnp.einsum(f"bskgd,{kv}->bkgst", q, k, preferred_element_type=jnp.float32)
  if softcap is not None:
    scores = softcap * jnp.tanh(scores / softcap)
  scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum(f"bkgst,{kv}->bskgd", probs, v)
  return out.reshape(b, s, h, dh)


HEAD_INITS = ("reward", "zeros")


class ScalarHead(nnx.Module):
  r"""`h` `[..., D]` -> `[...]` float32, :math:`w^\top h + b`; `kernel` `[D, 1]`, `bias` `[1]`.

  Args:
    features: `D`.
    init: `"reward"` (`w ~ N(0, 1/sqrt(D + 1))`) or `"zeros"` (value head on a policy trunk).
      The bias starts at 0 either way.
  """

  def __init__(self, features: int, *, init: str = "reward", param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    if init not in HEAD_INITS:
      raise ValueError(f"init must be one of {HEAD_INITS}, got {init!r}.")
    if init == "reward":
      std = 1.0 / math.sqrt(features + 1)
      kernel = nnx.initializers.normal(stddev=std)(rngs.params(), (features, 1), param_dtype)
    else:
      kernel = jnp.zeros((features, 1), param_dtype)
    self.kernel = nnx.Param(kernel)
    self.bias = nnx.Param(jnp.zeros((1,), param_dtype))

  def rescale(self, gain: float | Array, bias: float | Array) -> None:
    r"""In place: outputs become `gain * r + bias` (:math:`w \leftarrow g w`,
    :math:`b \leftarrow g b + c`, computed in float32).

    Raises:
      ValueError: a gain that is not finite and > 0 (it would flip or erase the preferences),
        or a bias that is not finite.
    """
    gain = jnp.asarray(gain, jnp.float32)
    bias = jnp.asarray(bias, jnp.float32)
    if gain.shape or bias.shape:
      raise ValueError(f"gain and bias must be scalars, got shapes {gain.shape}, {bias.shape}.")
    if not (bool(jnp.isfinite(gain)) and float(gain) > 0):
      raise ValueError(f"gain must be finite and > 0, got {float(gain)}.")
    if not bool(jnp.isfinite(bias)):
      raise ValueError(f"bias must be finite, got {float(bias)}.")
    kernel, b = self.kernel[...], self.bias[...]
    self.kernel[...] = (kernel.astype(jnp.float32) * gain).astype(kernel.dtype)
    self.bias[...] = (b.astype(jnp.float32) * gain + bias).astype(b.dtype)

  def __call__(self, h: Array) -> Array:
    w = self.kernel[...].astype(jnp.float32)
    out = jnp.dot(h.astype(jnp.float32), w) + self.bias[...].astype(jnp.float32)
    return out[..., 0]
