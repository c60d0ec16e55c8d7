r"""The SFT batch, loss and compiled steps.

For a batch of rows with targets :math:`y_{b,t}` (the next token) and a loss mask
:math:`m_{b,t}` that is 1 exactly where :math:`y_{b,t}` is a response token (prompt tokens and
padding carry no loss):

.. math::
   \mathcal{L} = \frac{1}{N} \sum_{b,t} m_{b,t}\,\bigl(-\log \pi_\theta(y_{b,t} \mid x_{b,\le t})
   \bigr), \qquad N = \sum_{b,t} m_{b,t}

Normalisation: a token mean over the valid target tokens of the whole optimizer batch. With
gradient accumulation every microbatch's summed loss is divided by the batch's total `N` (not by
its own count), so the accumulated gradient is exactly the full batch's gradient whatever the
split (docs/rlhf_details.md item 18 makes the same choice for PPO). On a mesh `N` is the count
over the whole global batch, not over one device's rows: the step is one SPMD program over the
global arrays, so every sum in it is global.

Log-probs: the decoder runs to its final hidden states `[B, L, D]` and the LM head turns them
into log-probs of the targets through `jax_ppo.models.logprobs.head_logprobs` (the path
PPO's loss takes), in float32. Above `SFTSteps.logits_chunk_bytes` of float32 logits it works
`L`-chunk by `L`-chunk, so neither the forward nor the backward pass holds the full-vocabulary
`[B, L, V]` logits (at Qwen's 151,936-token vocabulary 16 x 512 rows take 5 GB).

`SFTSteps.train_step` is one optimizer step on the training kit (`jax_ppo.training.state`):
`microbatches` + `accumulate_gradients` (a `lax.scan`, one microbatch's activations live at a
time), then `apply_gradients` (skipped, bit for bit, when the loss or the gradient is not
finite). Without a mesh the steps are `jax.jit`; with one they are `MeshJit`s
(`jax_ppo.parallel.jit`): the state and the frozen rest placed by the logical-axis rules, the
batch's rows split over `data` x `fsdp`, the metrics replicated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh

from jax_ppo.data.sft import SFTRows
from jax_ppo.models.logprobs import LOGITS_CHUNK_BYTES, head_logprobs
from jax_ppo.models.lora import has_lora
from jax_ppo.models.transformer import layer_loop
from jax_ppo.parallel.jit import MeshJit
from jax_ppo.parallel.rules import constrain_rows
from jax_ppo.sft.config import SFTConfig
from jax_ppo.training.loop import SKIPPED_METRIC
from jax_ppo.training.state import (
  LR_METRIC,
  StageState,
  accumulate_gradients,
  apply_gradients,
  microbatches,
)

Array = jax.Array


class SFTBatch(struct.PyTreeNode):
  """One batch of rows, `[B, L]` each (see `jax_ppo.data.sft.SFTRows`).

  `segment_ids` is None for unpacked rows (the model then runs exactly as without packing).
  """

  input_ids: Array
  attention_mask: Array
  positions: Array
  segment_ids: Array | None
  targets: Array
  loss_mask: Array

  @classmethod
  def from_rows(cls, rows: SFTRows, *, packed: bool) -> SFTBatch:
    """The host rows as device arrays (`segment_ids` only when `packed`)."""
    return cls(
        input_ids=jnp.asarray(rows.input_ids), attention_mask=jnp.asarray(rows.attention_mask),
        positions=jnp.asarray(rows.positions),
        segment_ids=jnp.asarray(rows.segment_ids) if packed else None,
        targets=jnp.asarray(rows.targets), loss_mask=jnp.asarray(rows.loss_mask),
    )


def token_nll(logprobs: Array, loss_mask: Array) -> Array:
  """Per-slot negative log-likelihood `[B, L]` float32, 0 where `loss_mask` is False.

  Args:
    logprobs: `[B, L]` float32 log-probs of each slot's target (`SFTSteps.target_logprobs`).
    loss_mask: `[B, L]` bool, True on slots whose target is a response token.
  """
  return jnp.where(loss_mask, -logprobs, 0.0)


def sft_loss(logprobs: Array, loss_mask: Array, *, num_tokens: Array | None = None) -> Array:
  r"""Token-mean cross-entropy :math:`\sum m \cdot (-\log \pi(y)) / N` (float32 scalar).

  Args:
    logprobs, loss_mask: as in `token_nll`.
    num_tokens: the normaliser `N`; None uses `sum(loss_mask)` (pass the whole batch's count
      when this is one microbatch of it). A batch without targets has loss 0.
  """
  if num_tokens is None:
    num_tokens = jnp.sum(loss_mask)
  n = jnp.asarray(num_tokens, jnp.float32)
  return jnp.sum(token_nll(logprobs, loss_mask)) / jnp.maximum(n, 1.0)


def split_trainable(model: nnx.Module, *, scan_layers: bool | None
                    ) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
  """`(graphdef, params, rest)` of an SFT model (`nnx.split`, with the layer loop `scan_layers`,
  None: the model's own): `params` every `nnx.Param`, or only the LoRA adapters when the model
  has them (`add_lora`); `rest` the other variables (LoRA's frozen base weights).

  The split `SFTTrainer` trains and `jax_ppo.diagnostics.stage_plan` compiles (on an abstract
  model from `nnx.eval_shape` as well as a loaded one)."""
  trainable = nnx.LoRAParam if has_lora(model) else nnx.Param
  with layer_loop(model, scan_layers):
    return nnx.split(model, trainable, ...)


class SFTSteps:
  """The compiled SFT functions of one run.

  Args:
    config: the run's `SFTConfig`.
    graphdef: graph definition of the model (`CausalLM`) from `nnx.split(model, trainable, ...)`.
    optimizer, schedule: from `jax_ppo.training.optim.make_optimizer(config.optimizer, ...)`.
    mesh: a device mesh: the steps are `MeshJit`s with the rules' shardings (the state and
      `rest` placed by the logical-axis rules, batch rows over `data` x `fsdp`, metrics
      replicated); None: plain `jax.jit` on one device.

  `train_step(state, rest, batch) -> (state, metrics)` (the `StageState` donated) and
  `eval_sums(params, rest, batch) -> (sum of NLL, token count)`, float32 scalars over the whole
  (global) batch.

  Attributes:
    logits_chunk_bytes: the most bytes of float32 logits per log-prob pass on one device
      (default 256 MiB, `jax_ppo.models.logprobs.LOGITS_CHUNK_BYTES`); larger ones are chunked
      over `L`, None never chunks. Read when the functions are traced: set it before the first call.
  """

  logits_chunk_bytes: int | None = LOGITS_CHUNK_BYTES

  def __init__(self, config: SFTConfig, *, graphdef: nnx.GraphDef,
               optimizer: optax.GradientTransformation, schedule: optax.Schedule,
               mesh: Mesh | None = None):
    self.config = config
    self.graphdef = graphdef
    self.optimizer = optimizer
    self.schedule = schedule
    self.mesh = mesh
    if mesh is None:
      self.train_step = jax.jit(self._train_step, donate_argnums=(0,))
      self.eval_sums = jax.jit(self._eval_sums)
    else:
      self.train_step = MeshJit(self._train_step, mesh, in_roles=("params", "params", "batch"),
                                out_roles=("params", "replicated"), donate_argnums=(0,))
      self.eval_sums = MeshJit(self._eval_sums, mesh, in_roles=("params", "params", "batch"),
                               out_roles=("replicated", "replicated"))

  def target_logprobs(self, params: nnx.State, rest: nnx.State, batch: SFTBatch) -> Array:
    """`[B, L]` float32 log-probs of each slot's target under the model (packed rows attend
    within their segments); the LM head runs chunk by chunk above `logits_chunk_bytes`."""
    model = nnx.merge(self.graphdef, params, rest)
    h = model.hidden_states(batch.input_ids, batch.attention_mask, positions=batch.positions,
                            segment_ids=batch.segment_ids)
    logprobs, _ = head_logprobs(model, h, batch.targets, 1.0, entropy=None,
                                chunk_bytes=self.logits_chunk_bytes)
    return logprobs

  def micro_loss(self, params: nnx.State, rest: nnx.State, mb: SFTBatch,
                 num_tokens: Array) -> Array:
    """One microbatch's share of the step's loss: its summed NLL over the step's `num_tokens`."""
    return sft_loss(self.target_logprobs(params, rest, mb), mb.loss_mask, num_tokens=num_tokens)

  def _train_step(self, state: StageState, rest: nnx.State, batch: SFTBatch):
    c = self.config
    if batch.input_ids.shape[0] != c.batch_size:
      raise ValueError(
          f"Batch has {batch.input_ids.shape[0]} rows but SFTConfig.batch_size is {c.batch_size}."
      )
    micro = constrain_rows(microbatches(batch, c.gradient_accumulation_steps), self.mesh, axis=1)
    num_tokens = jnp.sum(batch.loss_mask)  # the whole (global) batch's count
    grad_fn = jax.value_and_grad(lambda p, mb: self.micro_loss(p, rest, mb, num_tokens))
    loss, grads = accumulate_gradients(grad_fn, state.params, micro)
    lr = self.schedule(state.step) * state.lr_scale
    state, finite, grad_norm = apply_gradients(state, self.optimizer, grads, loss=loss)
    metrics = {
        "train/loss": loss,
        "train/perplexity": jnp.exp(loss),
        "train/tokens": num_tokens.astype(jnp.float32),
        "train/grad_norm": grad_norm,
        LR_METRIC: lr,
        SKIPPED_METRIC: (~finite).astype(jnp.float32),
    }
    return state, metrics

  def _eval_sums(self, params: nnx.State, rest: nnx.State, batch: SFTBatch
                 ) -> tuple[Array, Array]:
    nll = token_nll(self.target_logprobs(params, rest, batch), batch.loss_mask)
    return jnp.sum(nll), jnp.sum(batch.loss_mask)


__all__ = ["SFTBatch", "SFTSteps", "sft_loss", "split_trainable", "token_nll"]
