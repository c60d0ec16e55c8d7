r"""Direct preference optimisation (DPO), the offline alternative to a reward model and PPO:
`DPOTrainer`, the host side.

A causal-LM policy :math:`\pi_\theta` learns from preference pairs directly (Rafailov et al.
2023), minimising over the pairs

.. math::
   \mathcal{L} = -\log\sigma\Bigl(\beta\bigl[(\log\pi_\theta(y_c|x) - \log\pi_{ref}(y_c|x))
   - (\log\pi_\theta(y_r|x) - \log\pi_{ref}(y_r|x))\bigr]\Bigr)

or its IPO, hinge and cDPO forms (`jax_ppo.core.dpo_loss`), where the reference
:math:`\pi_{ref}` is the starting policy, frozen (or another model of the same architecture:
`reference=`); for a LoRA policy the reference is its base weights, the adapters off. The
compiled steps are `jax_ppo.dpo.steps`, the pairs and their encoding `jax_ppo.dpo.pairs`.

`DPOTrainer` reads the same preference records as the reward-model stage (text or chats, explicit
or implicit prompt), holds out a split, orders the batches with the training kit
(`batch_rows(..., epoch_end="wrap")`: `[seed, epoch]`-seeded permutations, so the step count
alone fixes the data position and a resumed run sees the batches of the uninterrupted one),
evaluates (the per-pair means of the loss and TRL's metrics, under `eval/`) and exports the
policy as a Hugging Face causal-LM folder (LoRA merged). With a `run_dir` the shared `RunLoop`
writes `config.yaml`, `metrics.jsonl`, checkpoints and a progress bar, and resumes from the
latest checkpoint; the reference is not checkpointed (it is the starting model, given again).
With `DPOConfig.precompute_reference` the reference's log-probs of every training and held-out pair
are computed once, before the first step or evaluation (`precompute_reference`), kept on the host
and fed to the policy-only programs; a resumed run computes them again (the same numbers: the
same compiled program on the same pairs), which costs one reference forward over all pairs.
On a device mesh (`mesh=`) the parameters, the reference and the optimizer state are split by
the logical-axis rules and each batch's rows over `data` x `fsdp`; several processes each put
their own rows of each batch into the global arrays (`jax_ppo.parallel.host_rows`).
"""

from __future__ import annotations

import math
import os
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jax_ppo.dpo.config import DPOConfig
from jax_ppo.dpo.pairs import DPOPairs, PairEncoder, eval_chunks
from jax_ppo.dpo.steps import DPOSteps, split_trainable
from jax_ppo.models.lora import has_lora
from jax_ppo.parallel import host_rows
from jax_ppo.parallel.distributed import multi_process, require_mesh
from jax_ppo.training.export import export_pretrained
from jax_ppo.training.loop import RunLoop, RunOptions
from jax_ppo.training.optim import make_optimizer
from jax_ppo.training.stage import RunStage
from jax_ppo.training.state import StageState, batch_rows, init_stage_state, place_stage_state

Array = jax.Array

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")
"""TRL's names of the DPO metrics (logged as they are in training, under `eval/` when
evaluating)."""


def _to_host(metrics: dict[str, Any]) -> dict[str, float]:
  return {k: float(v) for k, v in jax.device_get(metrics).items()}


def reference_params(params: nnx.State, reference: nnx.Module | None, *, lora: bool,
                     scan_layers: bool | None) -> Any:
  """The frozen reference's parameters for `DPOSteps`: an empty dict for a LoRA policy (its
  reference is its base weights), a copy of the policy's starting `params` without a
  `reference`, else the reference module's parameters (`split_trainable`).

  Raises:
    ValueError: the reference's parameters differ in structure or shape from `params`.
  """
  if lora:
    return {}
  if reference is None:  # a frozen copy of the starting weights
    return jax.tree.map(jnp.copy, params)
  _, ref, _ = split_trainable(reference, scan_layers=scan_layers)
  if jax.tree.structure(ref) != jax.tree.structure(params) or any(
      a.shape != b.shape for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(params),
                                         strict=True)):
    raise ValueError("The reference model's parameters differ in structure or shape from "
                     "the policy's; give a reference of the same architecture and size.")
  return ref


class DPOTrainer(RunStage):
  """Trains a causal LM with DPO on preference pairs, evaluates and exports it.

  Args:
    config: the run's `DPOConfig`.
    model: the policy, a `jax_ppo.models.CausalLM` (with LoRA adapters from `add_lora` only they
      train, and the reference is the base).
    train_data: `DPOPairs`, or records: mappings with the prompt/chosen/rejected fields of
      `config` (text, token ids or chats: `jax_ppo.dpo.pairs`).
    eval_data: the held-out split, in the same forms (None: `config.eval_fraction` of
      `train_data`, or no split).
    tokenizer: a transformers tokenizer (text records, EOS/pad ids, export).
    reference: the reference model (a `CausalLM` of the policy's structure); None: the policy's
      starting weights. Not with LoRA (the reference is then the base weights).
    run_dir, run_options, run_config: the run folder, as `SFTTrainer`'s.
    mesh: a device mesh (`jax_ppo.parallel.make_mesh`); None: one device.

  Attributes:
    reference_cache: with `DPOConfig.precompute_reference`, once computed: `{"train": [N, 2],
      "eval": [M, 2]}` host float32 arrays, the reference's (chosen, rejected) sequence
      log-probs of pair `i` of `train_pairs` / `eval_pairs` in row `i` ("eval" only with a
      held-out split); else None.
    reference_seconds: how long computing `reference_cache` took (None before).
    reference_freed: True once `precompute_reference` dropped a full reference's parameters
      (`ref` is then an empty dict).
  """

  CHECKPOINT_STAGE = "dpo"

  def __init__(
      self,
      config: DPOConfig,
      model: nnx.Module,
      *,
      train_data: DPOPairs | Sequence[Any],
      eval_data: DPOPairs | Sequence[Any] | None = None,
      tokenizer: Any = None,
      reference: nnx.Module | None = None,
      run_dir: str | os.PathLike | None = None,
      run_options: RunOptions | None = None,
      run_config: Any = None,
      mesh: Mesh | None = None,
  ):
    require_mesh(mesh, config_field="DPORunConfig.mesh", trainer="DPOTrainer")
    self.config = c = config
    self.tokenizer = tokenizer
    self.mesh = mesh
    self.lora = has_lora(model)
    if self.lora and reference is not None:
      raise ValueError("A LoRA policy's reference is its base weights (adapters off): drop "
                       "reference= (DPORunConfig.reference_path), or train without LoRA.")
    tok_pad = getattr(tokenizer, "pad_token_id", None)
    self.pad_token_id = c.pad_token_id if c.pad_token_id is not None else (tok_pad or 0)
    eos = c.eos_token_id if c.eos_token_id is not None else getattr(
        tokenizer, "eos_token_id", None)
    if eos is None and model.config.eos_token_ids:
      eos = model.config.eos_token_ids[0]
    if c.add_eos and eos is None:
      raise ValueError("DPOConfig.add_eos is True but there is no EOS id: pass a tokenizer with "
                       "an EOS token, set DPOConfig.eos_token_id, or set add_eos=False.")
    self.encoder = PairEncoder(tokenizer, vocab_size=model.config.vocab_size,
                               max_length=c.max_length, eos_token_id=eos, add_eos=c.add_eos,
                               fields=(c.prompt_field, c.chosen_field, c.rejected_field))
    self.cut_records = self.encoder.cut_records  # records cut to max_length, by argument name
    self.train_pairs = self.encode(train_data, "train_data")
    self.eval_pairs = None if eval_data is None else self.encode(eval_data, "eval_data")
    if eval_data is None and c.eval_fraction > 0:
      n = self.train_pairs.num_pairs
      n_eval = max(1, round(c.eval_fraction * n))
      if n_eval >= n:
        raise ValueError(f"DPOConfig.eval_fraction={c.eval_fraction} holds out all {n} pairs; "
                         "lower it or give more data.")
      order = np.random.default_rng([c.seed, 1 << 30]).permutation(n)
      self.eval_pairs = self.train_pairs.take(np.sort(order[:n_eval]))
      self.train_pairs = self.train_pairs.take(np.sort(order[n_eval:]))
    self.steps_per_epoch = math.ceil(self.train_pairs.num_pairs / c.batch_size)
    self.total_steps = c.total_steps or c.num_epochs * self.steps_per_epoch
    c.check_warmup(self.total_steps)
    graphdef, params, self.rest = split_trainable(model, scan_layers=c.train_scan_layers)
    self.ref: Any = reference_params(params, reference, lora=self.lora,
                                     scan_layers=c.train_scan_layers)
    self.optimizer, self.schedule = make_optimizer(c.optimizer, self.total_steps)
    self.reference_cache: dict[str, np.ndarray] | None = None
    self.reference_seconds: float | None = None
    self.reference_freed = False
    self._reference_logged = False
    self.steps = DPOSteps(c, graphdef=graphdef, lora=self.lora, optimizer=self.optimizer,
                          schedule=self.schedule, mesh=mesh)
    state = init_stage_state(self.optimizer, params)
    self.state: StageState
    self.state, self.rest, self.ref = place_stage_state(state, mesh, self.rest, self.ref)
    self.run = RunLoop(
        self, None if run_dir is None else pathlib.Path(run_dir),
        options=run_options if run_options is not None else RunOptions(log_samples_every=0),
        run_config=run_config if run_config is not None else config, total_steps=self.total_steps,
        max_consecutive_skips=c.max_consecutive_skips,
        progress_metrics=(("loss", "train/loss"), ("acc", "rewards/accuracies"),
                          ("eval_acc", "eval/rewards/accuracies")),
        progress_desc="dpo",
    )

  # -- data ---------------------------------------------------------------------------------

  def encode(self, data: DPOPairs | Sequence[Any], name: str = "data") -> DPOPairs:
    """`DPOPairs` from pairs (used as they are) or records; errors name the record and field."""
    if isinstance(data, DPOPairs):
      return jax.tree.map(lambda x: np.asarray(x, np.int32), data)
    return self.encoder.encode(data, name=name, pad_token_id=self.pad_token_id)

  def batch_index(self, step: int) -> np.ndarray:
    """Pair indices `[batch_size]` of optimizer step `step` (0-based), every batch full."""
    return batch_rows(self.config.seed, step, self.config.batch_size,
                      self.train_pairs.num_pairs, epoch_end="wrap")

  def place_rows(self, tree: Any) -> Any:
    """Host rows as the compiled steps take them (global arrays of this process's rows in a
    multi-process job)."""
    if self.mesh is None or not multi_process():
      return tree
    return host_rows.place_rows(tree, self.mesh)

  # -- training and evaluation --------------------------------------------------------------

  def precompute_reference(self) -> float:
    """Computes `reference_cache` (the reference's log-probs of the training and held-out pairs)
    and returns the seconds it took. Without LoRA it then frees the reference: the trainer drops
    its parameters (`ref`; their device memory is released unless the caller still holds a
    `reference=` module), so training holds only the policy; `evaluate(data)` on other pairs
    then needs `precompute_reference=False`. With LoRA nothing is freed (the reference is the
    policy's own base weights)."""
    start = time.perf_counter()
    cache = {"train": self.reference_logps(self.train_pairs)}
    if self.eval_pairs is not None:
      cache["eval"] = self.reference_logps(self.eval_pairs)
    self.reference_cache = cache
    if not self.lora:
      self.ref, self.reference_freed = {}, True
    self.reference_seconds = time.perf_counter() - start
    return self.reference_seconds

  def reference_logps(self, pairs: DPOPairs) -> np.ndarray:
    """The reference's `[N, 2]` float32 (chosen, rejected) sequence log-probs of every pair of
    `pairs`, on the host of every process, from batches of `eval_batch_size` pairs
    (`DPOSteps.reference_logps`)."""
    self._require_reference()
    n = pairs.num_pairs
    out = np.zeros((n, 2), np.float32)
    for index, weight in eval_chunks(n, min(self.config.eval_batch_size, n)):
      rows = self.place_rows(pairs.take(index))
      lp = np.asarray(jax.device_get(
          self.steps.reference_logps(self.state.params, self.rest, self.ref, rows)), np.float32)
      keep = weight > 0
      out[index[keep]] = lp[keep]
    return out

  def _require_reference(self) -> None:
    if self.reference_freed:
      raise ValueError("The reference was freed after DPOConfig.precompute_reference cached its "
                       "log-probs of the training and held-out pairs; evaluate other pairs with "
                       "a trainer built with precompute_reference=False, or pass them as "
                       "eval_data.")

  def _ensure_reference_cache(self) -> None:
    if self.config.precompute_reference and self.reference_cache is None:
      self.precompute_reference()

  def step(self) -> dict[str, float]:
    """One optimizer step on the next batch of pairs (and an evaluation every `eval_every`).
    With `precompute_reference`, the first step of this trainer first computes the cache and
    logs how long it took as `time/reference_s`."""
    self._ensure_reference_cache()
    index = self.batch_index(self.step_count)
    if self.reference_cache is None:
      batch = self.place_rows(self.train_pairs.take(index))
      self.state, metrics = self.steps.train_step(self.state, self.rest, self.ref, batch)
    else:
      ref_lp, batch = self.place_rows((self.reference_cache["train"][index],
                                       self.train_pairs.take(index)))
      self.state, metrics = self.steps.train_cached_step(self.state, self.rest, ref_lp, batch)
    metrics = _to_host(metrics)
    if self.reference_seconds is not None and not self._reference_logged:
      metrics["time/reference_s"] = self.reference_seconds
      self._reference_logged = True
    c = self.config
    if c.eval_every and self.eval_pairs is not None and self.step_count % c.eval_every == 0:
      metrics.update(self.evaluate())
    return metrics

  def evaluate(self, data: DPOPairs | Sequence[Any] | None = None) -> dict[str, float]:
    """`eval/loss`, `eval/<TRL metric>` (`METRICS`) and `eval/pairs` over every pair of `data`
    (default: the held-out split, with `precompute_reference` against the cached reference
    log-probs): the per-pair means (over every process's rows)."""
    if data is None:
      self._ensure_reference_cache()
    pairs = self.eval_pairs if data is None else self.encode(data, "data")
    if pairs is None:
      raise ValueError("No held-out split: pass eval_data to DPOTrainer or data here, or set "
                       "DPOConfig.eval_fraction > 0.")
    cached = None if data is not None or self.reference_cache is None else (
        self.reference_cache["eval"])
    if cached is None:
      self._require_reference()
    size = min(self.config.eval_batch_size, pairs.num_pairs)
    sums: dict[str, float] = {}
    for index, weight in eval_chunks(pairs.num_pairs, size):
      if cached is None:
        rows = self.place_rows((pairs.take(index), weight))
        out = self.steps.eval_sums(self.state.params, self.rest, self.ref, *rows)
      else:
        rows = self.place_rows((cached[index], pairs.take(index), weight))
        out = self.steps.eval_cached_sums(self.state.params, self.rest, *rows)
      out = _to_host(out)
      sums = {k: sums.get(k, 0.0) + v for k, v in out.items()}
    n = sums["pairs"]
    out = {f"eval/{k}": sums[k] / n for k in ("loss", *METRICS)}
    out["eval/pairs"] = n
    return out

  # -- export -------------------------------------------------------------------------------

  def model(self) -> nnx.Module:
    """The current policy as an NNX module."""
    return nnx.merge(self.steps.graphdef, self.state.params, self.rest)

  def export(self, path: str | os.PathLike, *, dtype=None,
             max_shard_size: int | str | None = "5GB") -> pathlib.Path:
    """Writes the policy as a Hugging Face causal-LM folder (LoRA merged) with the tokenizer,
    atomically (`jax_ppo.training.export.export_pretrained`; process 0 writes)."""
    return export_pretrained(self.model(), path, tokenizer=self.tokenizer, dtype=dtype,
                             max_shard_size=max_shard_size)


__all__ = ["METRICS", "DPOTrainer", "reference_params"]
