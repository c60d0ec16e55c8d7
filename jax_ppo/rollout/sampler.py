"""The compiled sampler: prefill plus a `lax.while_loop` decode over a KV cache, in one jit.

`generate` is a pure function of `(graphdef, state, input_ids, attention_mask, rng)`: it merges the
NNX model inside the trace, prefills the unique prompts once, repeats their cache for the
`n_samples` rows of each prompt, then decodes one token per loop iteration until every row has
produced a stop token or `max_new_tokens` is reached. The whole rollout is one XLA program: no
host round-trip per token. The KV cache is allocated inside that program and updated in place by
the loop (it is the loop carry), so it never crosses the jit boundary and is freed as soon as the
rollout returns, leaving the memory to the training step. The decode is length-bucketed
(`SamplingConfig.decode_segments`, `segment_schedule`): its steps run in a few consecutive loops
over the same cache, and the steps of each loop attend over the cache's first slots only, as many
as can be live by its last step.

`Sampler` wraps it for host use: it left-pads prompts into bucketed shapes (bounded compiles),
splits the batch into micro-batches chosen from a memory budget and concatenates the results. It is
also the vocabulary boundary: the pad and stop ids are checked against the model's `vocab_size`
when it is built, and every prompt id on the host before the jitted call, so an id outside the
vocabulary (which `jnp.take` would embed as NaN) is a `VocabularyError` naming the prompt, the id
and the vocabulary size, never a silent NaN rollout. `generate` itself, being traced, checks
nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import Mesh

from jax_ppo.core import (
  position_ids_from_mask,
  response_mask_from_stop_tokens,
)
from jax_ppo.models.cache import KVCache
from jax_ppo.models.errors import VocabularyError
from jax_ppo.parallel.jit import MeshJit, compiled_programs
from jax_ppo.parallel.rules import batch_shardings, cache_shardings, constrain, shard_params
from jax_ppo.rollout.batching import bucket_for, left_pad_prompts
from jax_ppo.rollout.config import SamplingConfig
from jax_ppo.rollout.layout import decode_state_jit, sampler_mesh
from jax_ppo.rollout.sampling import sample_tokens

Array = jax.Array


@struct.dataclass
class Rollout:
  """Prompts and sampled responses; rows `[i * n, (i + 1) * n)` are the samples of prompt `i`.

  Attributes:
    prompt_ids: `[B, S]` int32 left-padded prompt ids.
    prompt_mask: `[B, S]` int32, 1 on prompt tokens.
    response_ids: `[B, T]` int32 sampled ids; PAD after the first stop token.
    response_mask: `[B, T]` bool, valid through the first stop token (inclusive).
    logprobs: `[B, T]` float32 log-probs of the sampled tokens under
      `log_softmax(logits / temperature)` (unfiltered); 0 on padding.
    positions: `[B, S + T]` int32 position ids of the prompt + response sequence
      (`cumsum(mask) - 1`), as the teacher-forced training forward uses them.
    has_stop: `[B]` bool, False for rows that reached `max_new_tokens` without a stop token.
  """

  prompt_ids: Array
  prompt_mask: Array
  response_ids: Array
  response_mask: Array
  logprobs: Array
  positions: Array
  has_stop: Array

  @property
  def sequence_ids(self) -> Array:
    """`[B, S + T]` prompt followed by response."""
    return jnp.concatenate([self.prompt_ids, self.response_ids], axis=1)

  @property
  def attention_mask(self) -> Array:
    """`[B, S + T]` int32, 1 on prompt and valid response tokens."""
    return jnp.concatenate(
        [self.prompt_mask, self.response_mask.astype(self.prompt_mask.dtype)], axis=1
    )

  @property
  def response_lengths(self) -> Array:
    """`[B]` int32 number of valid response tokens (stop token included)."""
    return jnp.sum(self.response_mask, axis=1).astype(jnp.int32)


class DecodeCarry(NamedTuple):
  """The carry of `generate`'s decode loop (`B` rows, `T = max_new_tokens`).

  Attributes:
    step: `[]` int32, the response step sampled by the next iteration.
    token: `[B]` int32, the token sampled at `step - 1` (fed to the model next).
    done: `[B]` bool, the row has sampled a stop token.
    done_before: `[B]` bool, the row had finished before `step - 1` (its token is padding).
    tokens: `[B, T]` int32 sampled ids so far (PAD after a row finished).
    logprobs: `[B, T]` float32 their behaviour log-probs (0 after a row finished).
    cache: the `KVCache` holding the prompt and the tokens fed so far.
  """

  step: Array
  token: Array
  done: Array
  done_before: Array
  tokens: Array
  logprobs: Array
  cache: KVCache


def stop_id_array(config: SamplingConfig) -> Array:
  """`config.stop_token_ids` as an int32 array (`[-1]`, which no token matches, when empty)."""
  return jnp.asarray(config.stop_token_ids or (-1,), jnp.int32)


def emit_token(step, logits: Array, done: Array, tokens: Array, logprobs: Array, *, rng: Array,
               config: SamplingConfig) -> tuple[Array, Array, Array, Array]:
  """Samples response step `step` from `logits` `[B, V]` with `fold_in(rng, step)` for the rows
  not `done` `[B]` (finished rows get PAD and log-prob 0), writes it into `tokens` / `logprobs`
  `[B, T]`; returns `(token [B], done, tokens, logprobs)`, `done` updated by the stop ids."""
  tok, lp = sample_tokens(jax.random.fold_in(rng, step), logits, temperature=config.temperature,
                          top_k=config.top_k, top_p=config.top_p, greedy=config.greedy)
  tok = jnp.where(done, config.pad_token_id, tok)
  lp = jnp.where(done, 0.0, lp)
  tokens = jax.lax.dynamic_update_slice(tokens, tok[:, None], (0, step))
  logprobs = jax.lax.dynamic_update_slice(logprobs, lp[:, None], (0, step))
  done = done | jnp.isin(tok, stop_id_array(config))
  return tok, done, tokens, logprobs


class DecodeSegment(NamedTuple):
  """One of `generate`'s decode loops: response steps `[start, stop)`, each attending over the
  KV cache's first `attend_length` slots (`S + stop - 1`: step `t` writes slot `S + t - 1`)."""

  start: int
  stop: int
  attend_length: int

  @property
  def steps(self) -> int:
    return self.stop - self.start


def segment_schedule(prompt_length: int, max_new_tokens: int, segments: int
                     ) -> tuple[DecodeSegment, ...]:
  r"""The decode loops of `generate` for prompts of `S = prompt_length` slots,
  `T = max_new_tokens` and `K = segments` (`SamplingConfig.decode_segments`).

  Step 0 is sampled from the prefill's logits; steps `1 .. T - 1` run in the loops. Loop `k`
  (`1 <= k <= K`) ends before step :math:`e_k = 1 + \lceil k (T - 1) / K \rceil` and
  reads :math:`S + e_k - 1` slots; the last one reads the whole cache (`S + T - 1`). Ends that
  count `T - 1` from 1 keep the lengths round where `S` and `T` are (`S = T = 512`, `K = 4`: 640,
  768, 896, 1023 slots). Loops with no step (`K > T - 1`) are left out, so `T = 1` has none.

  Returns:
    the `DecodeSegment`s in order; their steps cover `[1, T)` once.
  """
  if segments < 1:
    raise ValueError(f"segments must be >= 1, got {segments}.")
  out, start = [], 1
  for k in range(1, segments + 1):
    stop = 1 + -(-k * (max_new_tokens - 1) // segments)
    if stop > start:
      out.append(DecodeSegment(start, stop, prompt_length + stop - 1))
      start = stop
  return tuple(out)


def decode_body(model, carry: DecodeCarry, *, rng: Array, config: SamplingConfig,
                attend_length: int | None = None) -> DecodeCarry:
  """One iteration of `generate`'s decode loop: feeds `carry.token` (a real token unless its row
  had already finished) through `model.decode_step`, attending over the cache's first
  `attend_length` slots (None: all; a `DecodeSegment`'s), then samples step `carry.step`
  (`emit_token`). `jax_ppo.diagnostics.ppo_plan` compiles it alone to count the loop's cost."""
  logits, cache = model.decode_step(carry.token, carry.cache, valid=~carry.done_before,
                                    attend_length=attend_length)
  tok, done, tokens, logprobs = emit_token(carry.step, logits, carry.done, carry.tokens,
                                           carry.logprobs, rng=rng, config=config)
  return DecodeCarry(step=carry.step + 1, token=tok, done=done, done_before=carry.done,
                     tokens=tokens, logprobs=logprobs, cache=cache)


def generate(
    graphdef: nnx.GraphDef,
    state: nnx.State | tuple[nnx.State, ...],
    input_ids: Array,
    attention_mask: Array,
    rng: Array,
    *,
    config: SamplingConfig,
    cache_dtype=None,
    mesh: Mesh | None = None,
) -> Rollout:
  """Samples `config.n_samples` responses per prompt in one compiled program.

  Args:
    graphdef: the causal LM's graph definition (`nnx.split(model)`).
    state: the model's state (parameters), or a tuple of partial states that `nnx.merge`
      combines (e.g. `(lora_state, base_state)` of a LoRA policy).
    input_ids: `[P, S]` left-padded prompt ids.
    attention_mask: `[P, S]`, 1 on prompt tokens; every row needs at least one.
    rng: PRNG key; step `t` samples with `fold_in(rng, t)`.
    config: static sampling configuration.
    cache_dtype: KV-cache dtype (default: the model's compute dtype).
    mesh: a device mesh: the KV cache is then constrained to `jax_ppo.parallel.cache_shardings`
      (rows over `data` x `fsdp`, key/value heads over `tensor`) after prefill and after the
      per-sample repeat. None: no constraint.

  Returns:
    A `Rollout` of `P * n_samples` rows and `T = config.max_new_tokens` response steps.
  """
  model = nnx.merge(graphdef, *state) if isinstance(state, tuple) else nnx.merge(graphdef, state)
  n, t_max = config.n_samples, config.max_new_tokens
  p, s = input_ids.shape
  b = p * n
  stop_ids = stop_id_array(config)

  # The last sampled token is never fed back, so the cache needs S + T - 1 slots.
  cache = model.init_cache(batch_size=p, max_length=s + t_max - 1, dtype=cache_dtype)
  logits, cache = model.prefill(input_ids, attention_mask, cache)
  if n > 1:  # Prefill each prompt once, then give each of its n samples a copy of its cache.
    repeat = lambda x: jnp.repeat(x, n, axis=0) if x.ndim and x.shape[0] == p else x
    logits = repeat(logits)
    cache = cache._replace(
        k=jnp.repeat(cache.k, n, axis=1),
        v=jnp.repeat(cache.v, n, axis=1),
        mask=repeat(cache.mask),
        slot_positions=repeat(cache.slot_positions),
        positions=repeat(cache.positions),
    )
  if mesh is not None:
    cache = constrain(cache, cache_shardings(cache, mesh))

  tokens = jnp.full((b, t_max), config.pad_token_id, jnp.int32)
  logprobs = jnp.zeros((b, t_max), jnp.float32)
  done0 = jnp.zeros((b,), bool)
  tok, done, tokens, logprobs = emit_token(0, logits, done0, tokens, logprobs, rng=rng,
                                           config=config)

  def cond(stop: int, carry: DecodeCarry):
    keep_going = carry.step < stop
    if config.early_stop:
      keep_going &= ~jnp.all(carry.done)
    return keep_going

  carry = DecodeCarry(step=jnp.asarray(1, jnp.int32), token=tok, done=done, done_before=done0,
                      tokens=tokens, logprobs=logprobs, cache=cache)
  # One loop per segment over the same cache carry; a loop after an early stop runs no step.
  for seg in segment_schedule(s, t_max, config.decode_segments):
    carry = jax.lax.while_loop(
        functools.partial(cond, seg.stop),
        functools.partial(decode_body, model, rng=rng, config=config,
                          attend_length=seg.attend_length),
        carry)
  tokens = carry.tokens
  logprobs = carry.logprobs

  # Recomputing the mask from the tokens gives exactly "through the first stop token".
  response_mask = response_mask_from_stop_tokens(tokens, stop_ids)
  hits = jnp.isin(tokens, stop_ids)
  prompt_ids = jnp.repeat(input_ids, n, axis=0).astype(jnp.int32)
  prompt_mask = jnp.repeat(attention_mask, n, axis=0).astype(jnp.int32)
  full_mask = jnp.concatenate([prompt_mask, response_mask.astype(jnp.int32)], axis=1)
  return Rollout(
      prompt_ids=prompt_ids,
      prompt_mask=prompt_mask,
      response_ids=jnp.where(response_mask, tokens, config.pad_token_id),
      response_mask=response_mask,
      logprobs=jnp.where(response_mask, logprobs, 0.0),
      positions=position_ids_from_mask(full_mask),
      has_stop=jnp.any(hits & response_mask, axis=1),
  )


def kv_cache_bytes(model_config, *, batch_size: int, max_length: int, itemsize: int = 4) -> int:
  """Bytes of a `KVCache`'s keys and values: :math:`2 L B T K D_h \\cdot \\text{itemsize}`."""
  c = model_config
  return 2 * c.num_layers * batch_size * max_length * c.num_kv_heads * c.head_dim * itemsize


def estimate_generation_bytes(
    model_config,
    *,
    batch_size: int,
    prompt_length: int,
    max_new_tokens: int,
    param_bytes: int,
    cache_itemsize: int = 4,
    activation_itemsize: int = 4,
) -> int:
  """Upper estimate of the device memory one `generate` call needs.

  .. math::  \\text{params} + 2 L B (S + T) K D_h \\cdot \\text{itemsize}
             + \\text{prefill activations} + \\text{logits}

  The prefill term counts the attention scores `[B, H, S, S]` in float32 and a few `[B, S, F]`
  MLP activations of one layer (layers run one at a time under `lax.scan`).

  Args:
    model_config: a `jax_ppo.models.ModelConfig`.
    batch_size: rows per call (prompts x samples).
    prompt_length: bucketed prompt length `S`.
    max_new_tokens: `T`.
    param_bytes: bytes of the model parameters (`param_bytes(state)`).
    cache_itemsize: bytes per KV-cache element (2 for bf16).
    activation_itemsize: bytes per activation element.
  """
  c = model_config
  b, s, t = batch_size, prompt_length, max_new_tokens
  kv = kv_cache_bytes(c, batch_size=b, max_length=s + t, itemsize=cache_itemsize)
  scores = b * c.num_heads * s * s * 4
  widest = max(c.intermediate_size * 3, c.hidden_size * 4, c.q_size + 2 * c.kv_size)
  prefill = scores + b * s * widest * activation_itemsize
  logits = 3 * b * c.vocab_size * 4
  tokens = 3 * b * t * 4
  return int(param_bytes + kv + prefill + logits + tokens)


def param_bytes(state) -> int:
  """Total bytes of the arrays in a pytree (e.g. an `nnx.State`)."""
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if hasattr(x, "size")))


def choose_micro_batch(
    model_config,
    *,
    budget_bytes: int,
    prompt_length: int,
    max_new_tokens: int,
    param_bytes: int,
    candidates: Sequence[int],
    cache_itemsize: int = 4,
) -> int:
  """The largest candidate batch size whose `estimate_generation_bytes` fits `budget_bytes`.

  Raises:
    ValueError: when not even the smallest candidate fits (naming the bytes needed).
  """
  best = None
  for b in sorted(candidates):
    need = estimate_generation_bytes(
        model_config,
        batch_size=b,
        prompt_length=prompt_length,
        max_new_tokens=max_new_tokens,
        param_bytes=param_bytes,
        cache_itemsize=cache_itemsize,
    )
    if need <= budget_bytes:
      best = b
  if best is None:
    smallest = min(candidates)
    need = estimate_generation_bytes(
        model_config,
        batch_size=smallest,
        prompt_length=prompt_length,
        max_new_tokens=max_new_tokens,
        param_bytes=param_bytes,
        cache_itemsize=cache_itemsize,
    )
    raise ValueError(
        f"memory budget of {budget_bytes / 2**30:.2f} GiB cannot hold even a micro-batch of "
        f"{smallest} rows ({need / 2**30:.2f} GiB needed): raise the budget, shorten "
        "max_new_tokens or prompts, or use a bf16 KV cache."
    )
  return best


class Sampler:
  """Host-side driver of `generate`: bucketing, micro-batching, one compile per shape.

  Args:
    model: the causal LM (an NNX module); it is split once here.
    config: sampling configuration.
    memory_budget_bytes: when set, micro-batches are chosen by `choose_micro_batch`;
      otherwise every prompt is processed in one call (padded to a batch bucket).
    cache_dtype: KV-cache dtype (default: the model's compute dtype).
    mesh: a device mesh: `generate` is then compiled with explicit shardings
      (`jax_ppo.parallel.MeshJit`): the state by the logical-axis rules, prompts and the rollout
      split on rows over `data` x `fsdp` (when the rows divide), the key replicated; the KV cache
      inside follows `cache_shardings`. With `config.decode_tensor = k` it runs on the mesh's
      devices regrouped `(n/k, 1, k)` (`jax_ppo.rollout.layout`; the sampler's `mesh`), and
      each call first casts the state's matrices to the compute dtype and moves them to that
      layout (`decode_state`). None: plain `jax.jit`.

  Example::

    sampler = Sampler(model, SamplingConfig(max_new_tokens=32, stop_token_ids=(eos,)))
    rollout = sampler(prompts, jax.random.key(0))  # prompts: list of token-id lists

  Raises:
    VocabularyError: (a ValueError) `config.pad_token_id` or a stop id is outside the model's
      vocabulary `[0, model.config.vocab_size)`.
  """

  def __init__(
      self,
      model,
      config: SamplingConfig,
      *,
      memory_budget_bytes: int | None = None,
      cache_dtype=None,
      mesh: Mesh | None = None,
  ):
    vocab = model.config.vocab_size
    for field, ids in (("pad_token_id", (config.pad_token_id,)),
                       ("stop_token_ids", config.stop_token_ids)):
      for token_id in ids:
        if not 0 <= token_id < vocab:
          raise VocabularyError(
              f"SamplingConfig.{field} (PPOConfig.sampling.{field} in a trainer) holds {token_id}, "
              f"outside the model's vocabulary of {vocab} ids [0, {vocab}); use ids of the "
              "model's tokenizer (or grow the model with resize_token_embeddings after adding "
              "tokens)."
          )
    self.graphdef, self.state = nnx.split(model)
    self.model_config = model.config
    self.compute_dtype = model.dtype
    self.config = config
    self.memory_budget_bytes = memory_budget_bytes
    self.cache_dtype = cache_dtype
    self.mesh = sampler_mesh(mesh, config, model.config)
    self._decode_state = None
    if mesh is None:
      self._generate = jax.jit(
          functools.partial(generate, self.graphdef, config=config, cache_dtype=cache_dtype)
      )
    else:
      # The state stays in the given mesh's layout (a trainer's parameters, not a second copy);
      # a tensor-parallel rollout moves it to its own layout at each call (`decode_state`).
      self.state = shard_params(self.state, mesh)
      self._generate = MeshJit(
          functools.partial(generate, self.graphdef, config=config, cache_dtype=cache_dtype,
                            mesh=self.mesh),
          self.mesh, in_roles=("params", "batch", "batch", "replicated"), out_roles="batch",
      )
      if self.mesh is not mesh:
        self._decode_state = {}  # one program per state structure
        self._given_mesh = mesh

  def decode_state(self, state: nnx.State | tuple[nnx.State, ...]):
    """`state` as `generate` reads it: with `SamplingConfig.decode_tensor`, its matrices cast to
    the compute dtype (`jax_ppo.models.compute_weights`: the same tokens; half the bytes of
    float32 masters with bfloat16 compute) and split over the tensor-parallel mesh, in one
    program; otherwise `state` itself."""
    if self._decode_state is None:
      return state
    structure = jax.tree.structure(state)
    program = self._decode_state.get(structure)
    if program is None:
      program = self._decode_state[structure] = decode_state_jit(state, self.mesh,
                                                                 self.compute_dtype)
    return program(state)

  def update_state(self, state: nnx.State) -> None:
    """Uses new parameters (same structure and shapes) without recompiling."""
    self.state = state

  @property
  def compile_count(self) -> int:
    """Number of distinct programs compiled so far (one per prompt/batch bucket pair)."""
    return compiled_programs(self._generate)

  def micro_batch_size(self, num_prompts: int, prompt_length: int) -> int:
    """Prompts per `generate` call for this batch (a batch bucket)."""
    cfg = self.config
    fit = bucket_for(num_prompts, cfg.batch_buckets, what="Number of prompts")
    if self.memory_budget_bytes is None:
      return fit
    rows = choose_micro_batch(
        self.model_config,
        budget_bytes=self.memory_budget_bytes,
        prompt_length=prompt_length,
        max_new_tokens=cfg.max_new_tokens,
        param_bytes=param_bytes(self.state),
        candidates=[b * cfg.n_samples for b in cfg.batch_buckets if b <= fit],
        cache_itemsize=jnp.dtype(self.cache_dtype or self.compute_dtype).itemsize,
    )
    return rows // cfg.n_samples

  def generate_padded(self, input_ids: Array, attention_mask: Array, rng: Array, *,
                      state: nnx.State | None = None) -> Rollout:
    """One `generate` call on prompts already left-padded to a bucket: `input_ids` and
    `attention_mask` `[P, S]` (host or device arrays, e.g. global arrays of a multi-process run
    whose rows each process filled; `jax_ppo.parallel.host_rows`), `P` a batch bucket. `__call__`
    pads and micro-batches lists of prompts, then does the same per micro-batch."""
    state = self.decode_state(self.state if state is None else state)
    return self._generate_on_mesh(state, input_ids, attention_mask, rng)

  def _generate_on_mesh(self, state, input_ids, attention_mask, rng) -> Rollout:
    """`generate`; a tensor-parallel rollout's rows are then moved back to the given mesh's
    batch layout, where the run's other programs (and eager ops on the rollout) expect them."""
    rollout = self._generate(state, input_ids, attention_mask, rng)
    if self._decode_state is None:
      return rollout
    return jax.device_put(rollout, batch_shardings(rollout, self._given_mesh))

  def __call__(
      self, prompts: Sequence[Sequence[int]], rng: Array, *, state: nnx.State | None = None
  ) -> Rollout:
    """Samples `n_samples` responses for each prompt (a list of token-id lists).

    Prompts are left-padded to a prompt bucket, grouped into micro-batches of a batch bucket
    (the last one padded with one-token dummy prompts whose rows are dropped), and each
    micro-batch is sampled with `fold_in(rng, i)`.

    Raises:
      VocabularyError: a prompt id outside the model's vocabulary (naming the prompt's index in
        `prompts`, the id and the vocabulary size), before anything runs on the device.
      ValueError: an empty or too long prompt (see `left_pad_prompts`).
    """
    state = self.decode_state(self.state if state is None else state)
    ids, mask = left_pad_prompts(
        prompts, self.config, max_context=self.model_config.max_position_embeddings,
        vocab_size=self.model_config.vocab_size,
    )
    p = ids.shape[0]
    mb = self.micro_batch_size(p, ids.shape[1])
    chunks = []
    for i, start in enumerate(range(0, p, mb)):
      chunk_ids, chunk_mask = ids[start : start + mb], mask[start : start + mb]
      real = chunk_ids.shape[0]
      if real < mb:  # Pad with one-token dummy prompts so the shape stays a bucket.
        pad = mb - real
        dummy_ids = np.full((pad, ids.shape[1]), self.config.pad_token_id, np.int32)
        dummy_mask = np.zeros((pad, ids.shape[1]), np.int32)
        dummy_mask[:, -1] = 1
        chunk_ids = np.concatenate([chunk_ids, dummy_ids])
        chunk_mask = np.concatenate([chunk_mask, dummy_mask])
      out = self._generate_on_mesh(state, chunk_ids, chunk_mask, jax.random.fold_in(rng, i))
      rows = real * self.config.n_samples
      chunks.append(jax.tree.map(lambda x, rows=rows: x[:rows], out))
    if len(chunks) == 1:
      return chunks[0]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *chunks)


__all__ = [
    "DecodeCarry",
    "DecodeSegment",
    "Rollout",
    "Sampler",
    "choose_micro_batch",
    "decode_body",
    "emit_token",
    "estimate_generation_bytes",
    "generate",
    "kv_cache_bytes",
    "param_bytes",
    "segment_schedule",
    "stop_id_array",
]
