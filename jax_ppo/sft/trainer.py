"""Supervised fine-tuning (SFT), the first RLHF stage: `SFTTrainer`, the host side.

`SFTTrainer` tokenises records (chat templates through the tokenizer, EOS appended), pads or
packs rows (`jax_ppo.data.sft`), holds out a split, orders the batches deterministically
(`jax_ppo.training.state.batch_rows`: `[seed, epoch]`-seeded permutations, so the step count
alone fixes the data position and a resumed run sees the batches of the uninterrupted one),
evaluates and exports. The loss and the compiled steps are `jax_ppo.sft.steps`, the config
`jax_ppo.sft.config`. With a `run_dir` the shared `RunLoop` writes `config.yaml`,
`metrics.jsonl`, checkpoints and a progress bar, and resumes from the latest checkpoint, as for
PPO.

On a device mesh (`mesh=`, `jax_ppo.parallel.make_mesh`) the parameters and the optimizer
moments are split by the logical-axis rules (FSDP over `fsdp`, tensor parallelism over
`tensor`), each batch's rows over `data` x `fsdp`, and the loss is normalised by the token count
of the whole global batch, so the step equals the single-device step (up to float summation
order). Several processes (a multi-host job, `jax_ppo.parallel.distributed`; a mesh is required):
every process tokenises the records and computes the same batch order, but puts only the rows
its own devices hold into each global batch (`jax_ppo.parallel.host_rows.global_rows`);
evaluation sums are global; process 0 alone writes the logs, `config.yaml` and the export
(`RunLoop`, `jax_ppo.training.export.export_pretrained`), Orbax the checkpoints from every
process.
"""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jax_ppo.data.sft import (
    SFTExample,
    SFTRows,
    encode_records,
    example_from_ids,
    pack_examples,
    pad_examples,
)
from jax_ppo.models.lora import has_lora
from jax_ppo.parallel import host_rows
from jax_ppo.parallel.distributed import require_mesh
from jax_ppo.sft.config import SFTConfig
from jax_ppo.sft.steps import SFTBatch, SFTSteps, split_trainable
from jax_ppo.training.export import export_pretrained
from jax_ppo.training.loop import RunLoop, RunOptions
from jax_ppo.training.optim import make_optimizer
from jax_ppo.training.stage import RunStage
from jax_ppo.training.state import StageState, batch_rows, init_stage_state, place_stage_state

Array = jax.Array


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
    mesh: a device mesh (`jax_ppo.parallel.make_mesh`): the state and the model's other
      variables are placed by the logical-axis rules (`jax_ppo.parallel.shard_params`; a model
      loaded with `from_pretrained(..., mesh=mesh)` is already in its shards) and the steps
      compile with explicit shardings. Checkpoints restore into these shardings whatever mesh
      wrote them. None: one device (a multi-process job needs a mesh).

  Steps are counted in optimizer steps; the metrics of the first have step 1.
  """

  CHECKPOINT_STAGE = "sft"

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
      mesh: Mesh | None = None,
  ):
    require_mesh(mesh, config_field="SFTRunConfig.mesh", trainer="SFTTrainer")
    self.config = c = config
    self.mesh = mesh
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
    places = self._places(train_data, "train_data", len(train))
    # Records cut to max_length, by argument (the examples' responses are cut when rows are made).
    self.cut_records = {"train_data": sum(ex.num_tokens > c.max_length for ex in train)}
    rng = np.random.default_rng(c.seed)
    if eval_data is not None:
      held_out = self._examples(eval_data, "eval_data")
      held_places = self._places(eval_data, "eval_data", len(held_out))
      self.cut_records["eval_data"] = sum(ex.num_tokens > c.max_length for ex in held_out)
    elif c.eval_fraction > 0:
      order = rng.permutation(len(train))
      n_eval = max(1, round(c.eval_fraction * len(train)))
      if n_eval >= len(train):
        raise ValueError(
            f"SFTConfig.eval_fraction={c.eval_fraction} holds out all {len(train)} examples; "
            "lower it or give more data."
        )
      held_out = [train[i] for i in order[:n_eval]]
      held_places = [places[i] for i in order[:n_eval]]
      keep = np.sort(order[n_eval:])
      train, places = [train[i] for i in keep], [places[i] for i in keep]
    else:
      held_out, held_places = [], []
    if c.packing:  # mixes lengths in the rows; the batch order is shuffled every epoch anyway
      order = rng.permutation(len(train))
      train, places = [train[i] for i in order], [places[i] for i in order]
    self.train_rows = self._rows(train, places)
    self.eval_rows = self._rows(held_out, held_places) if held_out else None
    self.steps_per_epoch = math.ceil(self.train_rows.num_rows / c.batch_size)
    self.total_steps = c.total_steps or c.num_epochs * self.steps_per_epoch

    self.lora = has_lora(model)
    graphdef, params, self.rest = split_trainable(model, scan_layers=c.train_scan_layers)
    if c.optimizer.warmup_steps > self.total_steps:
      raise ValueError(
          f"SFTConfig.optimizer.warmup_steps={c.optimizer.warmup_steps} is invalid: it exceeds "
          f"the run's {self.total_steps} optimizer steps; lower it or train longer "
          "(total_steps/num_epochs).")
    self.optimizer, self.schedule = make_optimizer(c.optimizer, self.total_steps)
    self.steps = SFTSteps(c, graphdef=graphdef, optimizer=self.optimizer, schedule=self.schedule,
                          mesh=mesh)
    state = init_stage_state(self.optimizer, params)
    self.state: StageState
    self.state, self.rest = place_stage_state(state, mesh, self.rest)
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

  @staticmethod
  def _places(data: Any, name: str, n: int) -> list[str]:
    """Where each of the `n` records of `data` came from: its file and line (records read from
    a file, `jax_ppo.runs.common.Records`), else `name[i]`."""
    places = getattr(data, "places", None)
    return list(places) if places is not None else [f"{name}[{i}]" for i in range(n)]

  def _rows(self, examples: list[SFTExample], places: list[str]) -> SFTRows:
    build = pack_examples if self.config.packing else pad_examples
    return build(examples, max_length=self.config.max_length, pad_token_id=self.pad_token_id,
                 places=places)

  def batch(self, rows: SFTRows, index: np.ndarray) -> SFTBatch:
    """The batch of `rows` at `index` (`[B]`; -1 gives an empty row, no loss) on the devices.

    Without a mesh: the rows as device arrays. On a mesh: global `[B, L]` arrays with their rows
    split over `data` x `fsdp`, to which this process contributes only the rows its devices
    hold (`host_rows.global_rows`; on one process, all of them).
    """
    packed = self.config.packing
    if self.mesh is None:
      return SFTBatch.from_rows(rows.take(index), packed=packed)
    taken = rows.take(np.asarray(index))
    return host_rows.place_rows(SFTBatch(
        input_ids=taken.input_ids, attention_mask=taken.attention_mask, positions=taken.positions,
        segment_ids=taken.segment_ids if packed else None, targets=taken.targets,
        loss_mask=taken.loss_mask), self.mesh)

  # -- training and evaluation --------------------------------------------------------------

  def step(self) -> dict[str, float]:
    """One optimizer step on the next batch; with `eval_every`, also the held-out metrics."""
    c = self.config
    index = batch_rows(c.seed, self.step_count, c.batch_size, self.train_rows.num_rows,
                       epoch_end="pad")
    self.state, metrics = self.steps.train_step(self.state, self.rest,
                                                self.batch(self.train_rows, index))
    metrics = _to_host(metrics)
    every = self.config.eval_every
    if every and self.eval_rows is not None and self.step_count % every == 0:
      metrics.update(self.evaluate())
    return metrics

  def evaluate(self, eval_data: Sequence[Any] | None = None) -> dict[str, float]:
    """Token-mean loss and perplexity (`exp(loss)`) over the held-out split (or `eval_data`),
    in batches of `batch_size` rows (on a mesh: global batches, global sums).

    Returns `{"eval/loss", "eval/perplexity", "eval/tokens"}`.
    """
    if eval_data is None:
      rows = self.eval_rows
    else:
      examples = self._examples(eval_data, "eval_data")
      rows = self._rows(examples, self._places(eval_data, "eval_data", len(examples)))
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
      s, n = self.steps.eval_sums(self.state.params, self.rest, self.batch(rows, index))
      total, count = total + float(s), count + float(n)
    loss = total / max(count, 1.0)
    return {"eval/loss": loss, "eval/perplexity": math.exp(loss), "eval/tokens": count}

  # -- export -------------------------------------------------------------------------------

  def model(self) -> nnx.Module:
    """The current model as an NNX module."""
    return nnx.merge(self.steps.graphdef, self.state.params, self.rest)

  def export(self, path: str | os.PathLike, *, dtype=None,
             max_shard_size: int | str | None = "5GB") -> pathlib.Path:
    """Writes the model as a Hugging Face checkpoint folder (LoRA merged), with the tokenizer
    (`jax_ppo.training.export.export_pretrained`). Several processes: every process calls it;
    process 0 writes."""
    return export_pretrained(self.model(), path, tokenizer=self.tokenizer, dtype=dtype,
                             max_shard_size=max_shard_size)


__all__ = ["SFTTrainer"]
