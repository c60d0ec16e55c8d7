r"""Supervised fine-tuning (SFT): next-token cross-entropy on the response given the prompt.

The first stage of RLHF. For a batch of rows with targets :math:`y_{b,t}` (the next token) and a
loss mask :math:`m_{b,t}` that is 1 exactly where :math:`y_{b,t}` is a response token (prompt
tokens and padding carry no loss):

.. math::
   \mathcal{L} = \frac{1}{N} \sum_{b,t} m_{b,t}\,\bigl(-\log \pi_\theta(y_{b,t} \mid x_{b,\le t})
   \bigr), \qquad N = \sum_{b,t} m_{b,t}

Normalisation: a token mean over the valid target tokens of the whole optimizer batch. With
gradient accumulation every microbatch's summed loss is divided by the batch's total `N` (not by
its own count), so the accumulated gradient is exactly the full batch's gradient whatever the
split (docs/rlhf_details.md item 18 makes the same choice for PPO). Log-softmax is float32
(`jax_ppo.core.gather_logprobs`). The evaluation loss uses the same token mean over the whole
held-out split, and the perplexity is `exp(eval loss)`.

`SFTSteps` holds the pure, jitted step; `SFTTrainer` the host side: tokenising records (chat
templates through the tokenizer, EOS appended), padding or packing rows (`jax_ppo.data.sft`), a
held-out split, a deterministic batch order (`[seed, epoch]`-seeded permutations, so the step
count alone fixes the data position and a resumed run sees the batches of the uninterrupted
one), evaluation and export. With a `run_dir` the shared `RunLoop` writes `config.yaml`,
`metrics.jsonl`, checkpoints and a progress bar, and resumes from the latest checkpoint, as for
PPO.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import types
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from jax_ppo import core
from jax_ppo.checkpoint import RunCheckpointer
from jax_ppo.data.sft import (
    ASSISTANT_TURNS,
    SFTExample,
    SFTRows,
    encode_records,
    example_from_ids,
    pack_examples,
    pad_examples,
)
from jax_ppo.models.hf import save_pretrained
from jax_ppo.models.lora import has_lora
from jax_ppo.models.transformer import layer_loop
from jax_ppo.parallel.distributed import barrier, is_main_process
from jax_ppo.training.loop import SKIPPED_METRIC, RunLoop, RunOptions, RunStage
from jax_ppo.training.optim import check_stage_fields, is_int, make_optimizer

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
  """Hyperparameters of an SFT run. A batch is `batch_size` rows of `max_length` tokens."""

  # --- data ---
  max_length: int = 512
  """Tokens per row; longer examples keep their prompt and lose the end of the response."""
  packing: bool = False
  """Pack several examples into each row (segment ids keep them apart)."""
  add_eos: bool = True
  """Append EOS to every response (unless it holds one), so the model learns to stop."""
  prompt_field: str = "prompt"
  """Record field of the prompt string."""
  response_field: str = "response"
  """Record field of the response string."""
  messages_field: str = "messages"
  """Record field of a chat (list of `{role, content}` turns, rendered by the chat template)."""
  assistant_turns: str = "all"
  """Assistant turns of a chat that are targets: "all" (the user turns between them are context)
  or "last" (every earlier turn is context)."""
  pad_token_id: int | None = None
  """Id written into padding (never attended to, never a target); None: the tokenizer's, or 0."""
  eos_token_id: int | None = None
  """Id appended to responses; None: the tokenizer's EOS."""
  eval_fraction: float = 0.0
  """Share of the training examples held out for evaluation when no eval set is given."""

  # --- batch geometry and length ---
  batch_size: int = 8
  """Rows per optimizer step."""
  gradient_accumulation_steps: int = 1
  """Microbatches per step (gradients summed; the loss is normalised by the step's tokens)."""
  num_epochs: int = 1
  """Passes over the training rows when `total_steps` is None."""
  total_steps: int | None = None
  """Optimizer steps of the run; None: `num_epochs` passes."""
  eval_every: int = 0
  """Evaluate on the held-out split every this many steps (0: only when `evaluate()` is
  called)."""

  # --- optimisation ---
  learning_rate: float = 2e-5
  """Peak learning rate of AdamW."""
  lr_schedule: str = "cosine"
  """"constant", "linear" (decay to 0) or "cosine" (to 0), after warm-up."""
  warmup_steps: int = 0
  """Optimizer steps of linear warm-up from 0."""
  adam_b1: float = 0.9
  adam_b2: float = 0.999
  adam_eps: float = 1e-8
  weight_decay: float = 0.0
  """Decoupled weight decay of AdamW."""
  max_grad_norm: float | None = 1.0
  """Clip gradients by global norm (None disables)."""
  max_consecutive_skips: int | None = 5
  """Steps skipped in a row (non-finite loss or gradient: parameters left unchanged) before
  `train()` stops with `NonFiniteUpdates`; None never stops."""
  train_scan_layers: bool | None = None
  """Layer loop of the training forward/backward (see `PPOConfig.train_scan_layers`)."""
  seed: int = 0
  """Seed of the held-out split, the packing order and the batch order."""

  def __post_init__(self):
    def bad(field: str, fix: str):
      raise ValueError(f"SFTConfig.{field}={getattr(self, field)!r} is invalid: {fix}.")

    for field, low in (("max_length", 2), ("batch_size", 1), ("gradient_accumulation_steps", 1),
                       ("num_epochs", 1), ("eval_every", 0), ("warmup_steps", 0)):
      if not is_int(getattr(self, field)) or getattr(self, field) < low:
        bad(field, f"use an int >= {low}")
    check_stage_fields(self, bad, lr_hint="1e-5 to 1e-4 for full SFT fine-tuning",
                       data="the data")
    if self.batch_size % self.gradient_accumulation_steps:
      bad("batch_size", f"it must be divisible by gradient_accumulation_steps "
                        f"({self.gradient_accumulation_steps})")
    for field in ("packing", "add_eos"):
      if not isinstance(getattr(self, field), bool):
        bad(field, "use True or False")
    for field in ("prompt_field", "response_field", "messages_field"):
      if not isinstance(getattr(self, field), str) or not getattr(self, field):
        bad(field, "give the record's field name as a non-empty string")
    if self.assistant_turns not in ASSISTANT_TURNS:
      bad("assistant_turns", f"use one of {list(ASSISTANT_TURNS)}")
    if not 0 <= self.eval_fraction < 1:
      bad("eval_fraction", "use a value in [0, 1) (e.g. 0.05), or pass eval_data")

  @property
  def microbatch_size(self) -> int:
    return self.batch_size // self.gradient_accumulation_steps


def make_sft_optimizer(
    config: SFTConfig, total_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW with global-norm clipping, linear warm-up and decay over `total_steps`
  (`jax_ppo.training.optim.make_optimizer`, fed this config's fields)."""
  if config.warmup_steps > total_steps:
    raise ValueError(
        f"SFTConfig.warmup_steps={config.warmup_steps} is invalid: it exceeds the run's "
        f"{total_steps} optimizer steps; lower it or train longer (total_steps/num_epochs)."
    )
  fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
  return make_optimizer(types.SimpleNamespace(**fields, total_optimizer_steps=total_steps))


class SFTState(struct.PyTreeNode):
  """Everything an SFT step changes.

  Attributes:
    params: the trainable variables (every `nnx.Param`, or only the LoRA adapters).
    opt_state: optax state over `params`.
    step: int32, optimizer steps done (also the schedule's clock and the data position).
    lr_scale: float32 multiplier of the learning rate (a rollback lowers it).
  """

  params: nnx.State
  opt_state: optax.OptState
  step: Array
  lr_scale: Array


class SFTBatch(struct.PyTreeNode):
  """One batch of rows on device, `[B, L]` each (see `jax_ppo.data.sft.SFTRows`).

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
    return cls(
        input_ids=jnp.asarray(rows.input_ids), attention_mask=jnp.asarray(rows.attention_mask),
        positions=jnp.asarray(rows.positions),
        segment_ids=jnp.asarray(rows.segment_ids) if packed else None,
        targets=jnp.asarray(rows.targets), loss_mask=jnp.asarray(rows.loss_mask),
    )


def token_nll(logits: Array, targets: Array, loss_mask: Array) -> Array:
  """Per-slot negative log-likelihood `[B, L]` float32, 0 where `loss_mask` is False.

  Args:
    logits: `[B, L, V]` logits of any dtype; slot `t` scores `targets[:, t]`.
    targets: `[B, L]` int next-token ids.
    loss_mask: `[B, L]` bool, True on slots whose target is a response token.
  """
  return jnp.where(loss_mask, -core.gather_logprobs(logits, targets), 0.0)


def sft_loss(logits: Array, targets: Array, loss_mask: Array, *,
             num_tokens: Array | None = None) -> Array:
  r"""Token-mean cross-entropy :math:`\sum m \cdot (-\log \pi(y)) / N` (float32 scalar).

  Args:
    logits, targets, loss_mask: as in `token_nll`.
    num_tokens: the normaliser `N`; None uses `sum(loss_mask)` (pass the whole batch's count
      when this is one microbatch of it). A batch without targets has loss 0.
  """
  if num_tokens is None:
    num_tokens = jnp.sum(loss_mask)
  n = jnp.asarray(num_tokens, jnp.float32)
  return jnp.sum(token_nll(logits, targets, loss_mask)) / jnp.maximum(n, 1.0)


def init_sft_state(optimizer: optax.GradientTransformation, params: nnx.State) -> SFTState:
  """A fresh `SFTState` (step 0, learning-rate scale 1)."""
  return SFTState(params=params, opt_state=optimizer.init(params),
                  step=jnp.zeros((), jnp.int32), lr_scale=jnp.ones((), jnp.float32))


class SFTSteps:
  """The compiled SFT functions of one run.

  Args:
    config: the run's `SFTConfig`.
    graphdef: graph definition of the model (`CausalLM`) from `nnx.split(model, trainable, ...)`.
    optimizer, schedule: from `make_sft_optimizer`.

  `train_step(state, rest, batch) -> (state, metrics)` (state donated) and
  `eval_sums(params, rest, batch) -> (sum of NLL, token count)`.
  """

  def __init__(self, config: SFTConfig, *, graphdef: nnx.GraphDef,
               optimizer: optax.GradientTransformation, schedule: optax.Schedule):
    self.config = config
    self.graphdef = graphdef
    self.optimizer = optimizer
    self.schedule = schedule
    self.train_step = jax.jit(self._train_step, donate_argnums=(0,))
    self.eval_sums = jax.jit(self._eval_sums)

  def logits(self, params: nnx.State, rest: nnx.State, batch: SFTBatch) -> Array:
    """`[B, L, V]` logits of the rows (packed rows attend within their segments)."""
    model = nnx.merge(self.graphdef, params, rest)
    return model(batch.input_ids, batch.attention_mask, positions=batch.positions,
                 segment_ids=batch.segment_ids)

  def _micro_loss(self, params, rest, mb: SFTBatch, num_tokens):
    return sft_loss(self.logits(params, rest, mb), mb.targets, mb.loss_mask,
                    num_tokens=num_tokens)

  def _train_step(self, state: SFTState, rest: nnx.State, batch: SFTBatch):
    c = self.config
    if batch.input_ids.shape[0] != c.batch_size:
      raise ValueError(
          f"Batch has {batch.input_ids.shape[0]} rows but SFTConfig.batch_size is {c.batch_size}."
      )
    micro = jax.tree.map(
        lambda x: x.reshape(c.gradient_accumulation_steps, c.microbatch_size, *x.shape[1:]),
        batch,
    )
    num_tokens = jnp.sum(batch.loss_mask)
    grad_fn = jax.value_and_grad(self._micro_loss)

    def accumulate(carry, mb):
      loss, grads = carry
      micro_loss, g = grad_fn(state.params, rest, mb, num_tokens)
      return (loss + micro_loss, jax.tree.map(jnp.add, grads, g)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state.params))
    (loss, grads), _ = jax.lax.scan(accumulate, zeros, micro)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
    updates = jax.tree.map(lambda u: u * state.lr_scale.astype(u.dtype), updates)
    params = optax.apply_updates(state.params, updates)
    # A non-finite loss or gradient leaves parameters and optimizer moments unchanged.
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
    state = state.replace(params=keep(params, state.params),
                          opt_state=keep(opt_state, state.opt_state), step=state.step + 1)
    metrics = {
        "train/loss": loss,
        "train/perplexity": jnp.exp(loss),
        "train/tokens": num_tokens.astype(jnp.float32),
        "train/grad_norm": grad_norm,
        "lr": self.schedule(state.step - 1) * state.lr_scale,
        SKIPPED_METRIC: (~ok).astype(jnp.float32),
    }
    return state, metrics

  def _eval_sums(self, params, rest, batch: SFTBatch) -> tuple[Array, Array]:
    nll = token_nll(self.logits(params, rest, batch), batch.targets, batch.loss_mask)
    return jnp.sum(nll), jnp.sum(batch.loss_mask)


def _to_host(metrics: dict[str, Any]) -> dict[str, float]:
  return {k: float(v) for k, v in jax.device_get(metrics).items()}


class SFTTrainer(RunStage):
  """Supervised fine-tuning of a causal LM on (prompt, response) examples.

  Args:
    config: the run's `SFTConfig`.
    model: a `jax_ppo.models.CausalLM` (with LoRA adapters from `add_lora` to train only them).
    train_data: records (mappings: `messages`, or `prompt`/`response` strings; needs
      `tokenizer`), `(prompt_ids, response_ids)` pairs (EOS appended as for records), or
      `SFTExample`s (used as they are).
    eval_data: the held-out split, in the same forms; None holds out `config.eval_fraction` of
      `train_data` (or nothing).
    tokenizer: a transformers tokenizer (records, EOS/pad ids, export).
    run_dir: run folder (`config.yaml`, `metrics.jsonl`, `checkpoints/`, progress bar); when it
      holds checkpoints the latest is restored. None: no bookkeeping.
    run_options: `RunOptions` of the run folder.
    run_config: the dataclass written to `config.yaml` and checked when resuming (default:
      `config`).

  Steps are counted in optimizer steps; the metrics of the first have step 1.
  """

  def __init__(
      self,
      config: SFTConfig,
      model: nnx.Module,
      *,
      train_data: Sequence[Any],
      eval_data: Sequence[Any] | None = None,
      tokenizer: Any = None,
      run_dir: str | os.PathLike | None = None,
      run_options: RunOptions | None = None,
      run_config: Any = None,
  ):
    self.config = c = config
    self.tokenizer = tokenizer
    self.eos_token_id = c.eos_token_id if c.eos_token_id is not None else getattr(
        tokenizer, "eos_token_id", None)
    tok_pad = getattr(tokenizer, "pad_token_id", None)
    self.pad_token_id = c.pad_token_id if c.pad_token_id is not None else (tok_pad or 0)
    if c.add_eos and self.eos_token_id is None:
      raise ValueError(
          "SFTConfig.add_eos is True but there is no EOS id: pass a tokenizer with an EOS token, "
          "set SFTConfig.eos_token_id, or set add_eos=False."
      )
    train = self._examples(train_data, "train_data")
    if not train:
      raise ValueError("train_data is empty; give at least one example.")
    rng = np.random.default_rng(c.seed)
    if eval_data is not None:
      held_out = self._examples(eval_data, "eval_data")
    elif c.eval_fraction > 0:
      order = rng.permutation(len(train))
      n_eval = max(1, round(c.eval_fraction * len(train)))
      if n_eval >= len(train):
        raise ValueError(
            f"SFTConfig.eval_fraction={c.eval_fraction} holds out all {len(train)} examples; "
            "lower it or give more data."
        )
      held_out = [train[i] for i in order[:n_eval]]
      train = [train[i] for i in np.sort(order[n_eval:])]
    else:
      held_out = []
    if c.packing:  # mixes lengths in the rows; the batch order is shuffled every epoch anyway
      train = [train[i] for i in rng.permutation(len(train))]
    self.train_rows = self._rows(train)
    self.eval_rows = self._rows(held_out) if held_out else None
    self.steps_per_epoch = math.ceil(self.train_rows.num_rows / c.batch_size)
    self.total_steps = c.total_steps or c.num_epochs * self.steps_per_epoch

    self.lora = has_lora(model)
    trainable = nnx.LoRAParam if self.lora else nnx.Param
    with layer_loop(model, c.train_scan_layers):
      graphdef, params, self.rest = nnx.split(model, trainable, ...)
    self.optimizer, self.schedule = make_sft_optimizer(c, self.total_steps)
    self.steps = SFTSteps(c, graphdef=graphdef, optimizer=self.optimizer, schedule=self.schedule)
    state = init_sft_state(self.optimizer, params)
    # Committed to its devices, as a restored checkpoint is (no recompilation after a resume).
    self.state: SFTState = jax.tree.map(lambda x: jax.device_put(x, x.sharding), state)
    self.preempted: str | None = None
    self.run_options = run_options if run_options is not None else RunOptions(
        log_samples_every=0)
    self.run = RunLoop(
        self, None if run_dir is None else pathlib.Path(run_dir), options=self.run_options,
        run_config=run_config if run_config is not None else config,
        total_steps=self.total_steps, max_consecutive_skips=c.max_consecutive_skips,
        progress_metrics=(("loss", "train/loss"), ("eval_loss", "eval/loss")), progress_desc="sft",
    )

  # -- data ---------------------------------------------------------------------------------

  def _examples(self, data: Sequence[Any], name: str) -> list[SFTExample]:
    c = self.config
    places = getattr(data, "places", None)  # records read from a file name its lines
    data = list(data)
    if data and all(isinstance(d, SFTExample) for d in data):
      return data
    if data and all(isinstance(d, dict) for d in data):
      if self.tokenizer is None:
        raise ValueError(f"{name} holds text records; pass the tokenizer (tokenizer=...).")
      if c.eos_token_id is not None and c.eos_token_id != self.tokenizer.eos_token_id:
        raise ValueError(
            f"SFTConfig.eos_token_id={c.eos_token_id} differs from the tokenizer's EOS "
            f"({self.tokenizer.eos_token_id}); leave it None for text records."
        )
      return encode_records(data, self.tokenizer, source=name, places=places,
                            prompt_field=c.prompt_field,
                            response_field=c.response_field, messages_field=c.messages_field,
                            add_eos=c.add_eos, assistant_turns=c.assistant_turns)
    out = []
    for i, d in enumerate(data):
      if isinstance(d, SFTExample):
        out.append(d)
      elif isinstance(d, (tuple, list)) and len(d) == 2:
        out.append(example_from_ids(d[0], d[1], eos_token_id=self.eos_token_id,
                                    add_eos=c.add_eos))
      else:
        raise ValueError(
            f"{name}[{i}] is a {type(d).__name__}; give records (dicts), SFTExample or "
            "(prompt_ids, response_ids) pairs, one kind per dataset."
        )
    return out

  def _rows(self, examples: list[SFTExample]) -> SFTRows:
    build = pack_examples if self.config.packing else pad_examples
    return build(examples, max_length=self.config.max_length, pad_token_id=self.pad_token_id)

  def batch_index(self, step: int) -> np.ndarray:
    """Row indices of the batch of optimizer step `step` (0-based); -1 pads the last batch of
    an epoch with empty rows (no loss)."""
    c = self.config
    epoch, i = divmod(int(step), self.steps_per_epoch)
    order = np.random.default_rng([c.seed, epoch]).permutation(self.train_rows.num_rows)
    index = order[i * c.batch_size : (i + 1) * c.batch_size]
    return np.concatenate([index, np.full(c.batch_size - len(index), -1, np.int64)])

  def _batch(self, rows: SFTRows) -> SFTBatch:
    return SFTBatch.from_rows(rows, packed=self.config.packing)

  # -- run folder (the `Stage` of `RunLoop`) ------------------------------------------------

  def checkpoint_extra(self) -> dict[str, Any]:
    return {"stage": "sft", "step": self.step_count}

  def restore_checkpoint(self, checkpointer: RunCheckpointer, step: int | None) -> dict:
    """Restores the `SFTState` of a checkpoint (None: the latest); returns its extra."""
    return self.restore_stage_state(checkpointer, step, stage="sft")

  # -- training and evaluation --------------------------------------------------------------

  def step(self) -> dict[str, float]:
    """One optimizer step on the next batch; with `eval_every`, also the held-out metrics."""
    rows = self.train_rows.take(self.batch_index(self.step_count))
    self.state, metrics = self.steps.train_step(self.state, self.rest, self._batch(rows))
    metrics = _to_host(metrics)
    every = self.config.eval_every
    if every and self.eval_rows is not None and self.step_count % every == 0:
      metrics.update(self.evaluate())
    return metrics

  def evaluate(self, eval_data: Sequence[Any] | None = None) -> dict[str, float]:
    """Token-mean loss and perplexity (`exp(loss)`) over the held-out split (or `eval_data`).

    Returns `{"eval/loss", "eval/perplexity", "eval/tokens"}`.
    """
    rows = self.eval_rows if eval_data is None else self._rows(
        self._examples(eval_data, "eval_data"))
    if rows is None:
      raise ValueError(
          "No held-out split: pass eval_data to SFTTrainer or evaluate(), or set "
          "SFTConfig.eval_fraction > 0."
      )
    bs = self.config.batch_size
    total, count = 0.0, 0.0
    for start in range(0, rows.num_rows, bs):
      index = np.arange(start, start + bs)
      index[index >= rows.num_rows] = -1
      s, n = self.steps.eval_sums(self.state.params, self.rest, self._batch(rows.take(index)))
      total, count = total + float(s), count + float(n)
    loss = total / max(count, 1.0)
    return {"eval/loss": loss, "eval/perplexity": math.exp(loss), "eval/tokens": count}

  # -- export -------------------------------------------------------------------------------

  def model(self) -> nnx.Module:
    """The current model as an NNX module."""
    return nnx.merge(self.steps.graphdef, self.state.params, self.rest)

  def export(self, path: str | os.PathLike, *, dtype=None,
             max_shard_size: int | str | None = "5GB") -> pathlib.Path:
    """Writes the model as a Hugging Face checkpoint folder (LoRA merged), with the tokenizer.
    Several processes: every process calls it; process 0 writes (`save_pretrained`)."""
    path = pathlib.Path(path)
    save_pretrained(self.model(), str(path), dtype=dtype, max_shard_size=max_shard_size)
    if (self.tokenizer is not None and hasattr(self.tokenizer, "save_pretrained")
        and is_main_process()):
      self.tokenizer.save_pretrained(str(path))
    barrier(f"export {path}")
    return path


__all__ = [
    "SFTBatch",
    "SFTConfig",
    "SFTState",
    "SFTSteps",
    "SFTTrainer",
    "init_sft_state",
    "make_sft_optimizer",
    "sft_loss",
    "token_nll",
]
