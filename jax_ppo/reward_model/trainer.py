r"""Pairwise reward-model training (Bradley-Terry), held-out accuracy and reward normalisation.

The second stage of RLHF. A reward model is a `jax_ppo.models.ScalarModel`; for a preference
triple (prompt `x`, chosen `y_c`, rejected `y_r`) it scores `x + y_c` and `x + y_r` at their last
valid token (`ScalarModel.score`, docs/rlhf_details.md item 6) and minimises, in float32,

.. math::
   \mathcal{L} = -\frac{1}{N} \sum_i \log \sigma\bigl(r_\theta(x_i, y_{c,i})
   - r_\theta(x_i, y_{r,i}) - m_i\bigr)

(Bradley & Terry 1952; Stiennon et al. 2020; Ouyang et al. 2022), with an optional per-pair
margin :math:`m_i \ge 0` (Llama 2, Touvron et al. 2023: a pair rated "significantly better"
must be separated by more). Accuracy is the share of pairs with :math:`r_c > r_r` (ties count
as wrong; the margin is not part of it).

Reward normalisation (docs/rlhf_details.md item 16): after training, `normalise` takes scores of
SFT-policy samples (or their ids and masks, scored here) and sets `gain = 1 / std`,
`bias = -mean / std` (population std), folded into the score head (`ScalarModel.rescale_scores`),
so those samples score with mean 0 and std 1 and PPO sees normalised scores with no extra
setting. `export` writes a one-label Hugging Face `*ForSequenceClassification` folder (plus the
tokenizer): the gain is inside `score.weight`, the bias in `config.json`
(`jax_ppo.models.hf.SCORE_BIAS_KEY`); `load_scalar_model` returns the normalised scores,
transformers the normalised scores minus that constant bias (the same preferences and scale).

`RewardModelSteps` (`jax_ppo.reward_model.steps`, on the loss and the normalisation's arithmetic
of `jax_ppo.reward_model.pairwise`) holds the compiled steps; `RewardModelTrainer` the host side:
tokenising records, the batch order of the training kit (`jax_ppo.training.state.batch_rows`:
`[seed, epoch]`-seeded permutations, so the step count alone fixes the data position),
evaluation, normalisation and export (`jax_ppo.training.export.export_pretrained`). With a
`run_dir` the shared `RunLoop` writes `config.yaml`, `metrics.jsonl`, checkpoints and a progress
bar, and resumes from the latest checkpoint, as for PPO and SFT.

On a device mesh (`mesh=`) the parameters and optimizer state are split by the logical-axis rules
and each batch's rows over `data` x `fsdp`; in a multi-process job every process holds the same
records but puts only its own rows of each batch into the global arrays
(`jax_ppo.parallel.host_rows`), evaluation and the normalisation's scores are global, and only
process 0 writes files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jax_ppo.data.preferences import is_chat
from jax_ppo.data.records import Record, preference_record, warn_cut
from jax_ppo.data.sft import chat_prompt_response
from jax_ppo.models.heads import ScalarModel
from jax_ppo.models.lora import has_lora
from jax_ppo.models.tokenizer import encode_chat, pad_batch
from jax_ppo.parallel import host_rows
from jax_ppo.parallel.distributed import is_main_process, multi_process, require_mesh
from jax_ppo.reward_model.config import RewardModelConfig
from jax_ppo.reward_model.pairwise import (
  PreferencePairs,
  normalisation_from_scores,
  preference_pairs,
)
from jax_ppo.reward_model.steps import RewardModelSteps, split_trainable
from jax_ppo.training.export import export_pretrained
from jax_ppo.training.loop import RunLoop, RunOptions
from jax_ppo.training.optim import make_optimizer
from jax_ppo.training.stage import RunStage
from jax_ppo.training.state import StageState, batch_rows, init_stage_state, place_stage_state

Array = jax.Array
logger = logging.getLogger(__name__)

NORMALISATION_FILE = "reward_normalisation.json"
"""File `export` writes beside the weights: the gain, bias and the statistics they came from."""


def _to_host(metrics: dict[str, Any]) -> dict[str, float]:
  return {k: float(v) for k, v in jax.device_get(metrics).items()}


def _chunks(n: int, size: int):
  """`(index [size], weight [size])` chunks covering `range(n)`; the last is padded with row 0
  at weight 0, so every chunk has one shape (one compile)."""
  for start in range(0, n, size):
    index = np.arange(start, min(start + size, n))
    weight = np.ones(size, np.float32)
    weight[index.size:] = 0
    yield np.concatenate([index, np.zeros(size - index.size, index.dtype)]), weight


class RewardModelTrainer(RunStage):
  """Trains a `ScalarModel` on preference pairs, evaluates, normalises and exports it.

  Args:
    config: the run's `RewardModelConfig`.
    model: a `jax_ppo.models.ScalarModel` (e.g. `load_scalar_model(sft_path)`: the SFT trunk
      with a new head; with LoRA adapters from `add_lora` only they and the head train).
    train_data: `PreferencePairs`, or records: mappings with the prompt/chosen/rejected (and
      optional margin) fields of `config`, holding strings (needs `tokenizer`) or token-id
      lists; a prompt may also be a chat (list of `{role, content}` messages), and chosen and
      rejected may be chats too, with or without the prompt (`jax_ppo.data.preferences`).
    eval_data: the held-out split, in the same forms (None: `config.eval_fraction` of
      `train_data`, or no split: then `evaluate()` needs data).
    tokenizer: a transformers tokenizer (text records, EOS/pad ids, export).
    run_dir: run folder (`config.yaml`, `metrics.jsonl`, `checkpoints/`, progress bar); when it
      holds checkpoints the latest is restored. None: no bookkeeping.
    run_options: `RunOptions` of the run folder.
    run_config: the dataclass written to `config.yaml` and checked when resuming (default:
      `config`).
    mesh: a device mesh (`jax_ppo.parallel.make_mesh`): the model's parameters (best loaded
      straight into their shards, `load_scalar_model(..., mesh=mesh)`) and the optimizer state
      are placed by the logical-axis rules and every batch's rows split over `data` x `fsdp`;
      required in a multi-process job. None: one device.
  """

  CHECKPOINT_STAGE = "reward_model"

  def __init__(
      self,
      config: RewardModelConfig,
      model: ScalarModel,
      *,
      train_data: PreferencePairs | Sequence[Any],
      eval_data: PreferencePairs | Sequence[Any] | None = None,
      tokenizer: Any = None,
      run_dir: str | os.PathLike | None = None,
      run_options: RunOptions | None = None,
      run_config: Any = None,
      mesh: Mesh | None = None,
  ):
    require_mesh(mesh, config_field="RewardRunConfig.mesh", trainer="RewardModelTrainer")
    if mesh is not None and not isinstance(mesh, Mesh):
      raise TypeError(f"mesh must be a jax.sharding.Mesh (jax_ppo.parallel.make_mesh), got "
                      f"{type(mesh).__name__}.")
    if not isinstance(model, ScalarModel):
      raise TypeError(f"model must be a jax_ppo.models.ScalarModel (e.g. load_scalar_model("
                      f"path)), got {type(model).__name__}.")
    self.config = c = config
    self.tokenizer = tokenizer
    self.vocab_size = model.config.vocab_size
    tok_pad = getattr(tokenizer, "pad_token_id", None)
    self.pad_token_id = c.pad_token_id if c.pad_token_id is not None else (tok_pad or 0)
    self.eos_token_id = c.eos_token_id if c.eos_token_id is not None else getattr(
        tokenizer, "eos_token_id", None)
    if self.eos_token_id is None and model.config.eos_token_ids:
      self.eos_token_id = model.config.eos_token_ids[0]
    if c.add_eos and self.eos_token_id is None:
      raise ValueError(
          "RewardModelConfig.add_eos is True but there is no EOS id: pass a tokenizer with an "
          "EOS token, set RewardModelConfig.eos_token_id, or set add_eos=False.")
    self.cut_records: dict[str, int] = {}  # records cut to max_length, by argument name
    self.train_pairs = self.encode(train_data, "train_data")
    self.eval_pairs = None if eval_data is None else self.encode(eval_data, "eval_data")
    if eval_data is None and c.eval_fraction > 0:
      n = self.train_pairs.num_pairs
      n_eval = max(1, round(c.eval_fraction * n))
      if n_eval >= n:
        raise ValueError(f"RewardModelConfig.eval_fraction={c.eval_fraction} holds out all {n} "
                         "pairs; lower it or give more data.")
      order = np.random.default_rng([c.seed, 1 << 30]).permutation(n)
      self.eval_pairs = self.train_pairs.take(np.sort(order[:n_eval]))
      self.train_pairs = self.train_pairs.take(np.sort(order[n_eval:]))
    self.steps_per_epoch = math.ceil(self.train_pairs.num_pairs / c.batch_size)
    self.total_steps = c.total_steps or c.num_epochs * self.steps_per_epoch
    warmup = c.optimizer.warmup_steps
    if warmup > self.total_steps:
      raise ValueError(f"RewardModelConfig.optimizer.warmup_steps={warmup} is invalid: it exceeds "
                       f"the run's {self.total_steps} optimizer steps; lower it or train longer.")
    self.mesh = mesh
    self.lora = has_lora(model)
    graphdef, params, self.rest = split_trainable(model, scan_layers=c.train_scan_layers)
    self.optimizer, self.schedule = make_optimizer(c.optimizer, self.total_steps)
    self.steps = RewardModelSteps(graphdef=graphdef, optimizer=self.optimizer,
                                  schedule=self.schedule,
                                  accumulation_steps=c.gradient_accumulation_steps, mesh=mesh)
    state = init_stage_state(self.optimizer, params)
    self.state: StageState
    self.state, self.rest = place_stage_state(state, mesh, self.rest)
    self.normalisation: dict[str, float] | None = None
    self.run = RunLoop(
        self, None if run_dir is None else pathlib.Path(run_dir),
        options=run_options if run_options is not None else RunOptions(log_samples_every=0),
        run_config=run_config if run_config is not None else config, total_steps=self.total_steps,
        max_consecutive_skips=c.max_consecutive_skips,
        progress_metrics=(("loss", "train/loss"), ("acc", "train/accuracy"),
                          ("eval_acc", "eval/accuracy")),
        progress_desc="reward model",
    )

  # -- data ---------------------------------------------------------------------------------

  def _sequence(self, prompt, response, where: str, field: str) -> list[int]:
    """Ids of prompt + response (EOS appended; `encode` cuts them to `max_length`).

    A response is text (tokenized without special tokens), token ids, or a chat (the turns after
    a chat prompt, ending with the assistant's; see `jax_ppo.data.preferences`). A text response
    follows a prompt of text (tokenized with the tokenizer's special tokens), token ids or a chat
    (rendered by the chat template with the generation prompt). A chat response is rendered with
    its prompt by the chat template, split as SFT splits a conversation
    (`jax_ppo.data.sft.chat_prompt_response`), and ends at its last EOS: template text after it
    (a newline) is dropped, since a sampled response ends at EOS."""
    if (isinstance(response, str) or is_chat(response) or is_chat(prompt)
        or isinstance(prompt, str)) and self.tokenizer is None:
      raise ValueError(f"{where} holds text but no tokenizer was given; pass tokenizer= or "
                       "give token-id lists.")
    if is_chat(response):
      ids, tail = chat_prompt_response([*prompt, *response], self.tokenizer, where, field=field)
      if self.eos_token_id in tail:
        tail = tail[:len(tail) - tail[::-1].index(self.eos_token_id)]
      ids = [*ids, *tail]
    else:
      ids = []
      for part, is_prompt in ((prompt, True), (response, False)):
        if isinstance(part, str) or (is_prompt and is_chat(part)):
          part = (self.tokenizer(part, add_special_tokens=is_prompt)["input_ids"]
                  if isinstance(part, str) else encode_chat(self.tokenizer, [part])[0])
        if not isinstance(part, (list, tuple, np.ndarray)):
          raise ValueError(f"{where} must be a string, a chat or a list of token ids.")
        ids.extend(part)
    if not all(isinstance(t, (int, np.integer)) and 0 <= t < self.vocab_size for t in ids):
      raise ValueError(f"{where} must be a string, a chat or a list of token ids in [0, "
                       f"{self.vocab_size}) (the model's vocabulary).")
    ids = [int(t) for t in ids]
    if self.config.add_eos and (not ids or ids[-1] != self.eos_token_id):
      ids.append(int(self.eos_token_id))
    if not ids:
      raise ValueError(f"{where} is empty (no prompt and no response tokens).")
    return ids

  def encode(self, data: PreferencePairs | Sequence[Any], name: str = "data") -> PreferencePairs:
    """`PreferencePairs` from pairs or records (see the class docstring); errors name the
    record and field."""
    c = self.config
    if isinstance(data, PreferencePairs):
      pairs = preference_pairs(data.chosen_ids, data.chosen_mask, data.rejected_ids,
                               data.rejected_mask, data.margin, name=name)
      if int(max(pairs.chosen_ids.max(), pairs.rejected_ids.max())) >= self.vocab_size:
        raise ValueError(f"{name} holds ids >= the model's vocab_size {self.vocab_size}.")
      return pairs
    if isinstance(data, (str, bytes)) or not isinstance(data, Sequence) or not data:
      raise ValueError(f"{name} must be PreferencePairs or a non-empty list of records.")
    chosen, rejected, margins = [], [], []
    places = getattr(data, "places", None)  # records read from a file name its lines

    def at(where: str, field: str) -> str:
      return f"{where}.{field}" if places is None else f"{where}, field {field!r}"

    for i, record in enumerate(data):
      where = f"{name}[{i}]" if places is None else places[i]
      fields = (c.prompt_field, c.chosen_field, c.rejected_field)
      pair = preference_record(Record(where, record), fields, c.margin_field, token_ids=True,
                               prefix="RewardModelConfig.")
      chosen.append(self._sequence(pair["prompt"], pair["chosen"], at(where, c.chosen_field),
                                   c.chosen_field))
      rejected.append(self._sequence(pair["prompt"], pair["rejected"],
                                     at(where, c.rejected_field), c.rejected_field))
      margins.append(pair["margin"])
    cut = [i for i in range(len(chosen))
           if max(len(chosen[i]), len(rejected[i])) > c.max_length]
    self.cut_records[name] = warn_cut(
        [f"{name}[{i}]" if places is None else places[i] for i in cut], len(chosen),
        max_length=c.max_length, what=f"preference pairs of {name}",
        how="their starts were cut (the score is read at the last token)")
    chosen = [s[-c.max_length:] for s in chosen]
    rejected = [s[-c.max_length:] for s in rejected]
    length = max(len(s) for s in chosen + rejected)
    ci, cm = pad_batch(chosen, pad_token_id=self.pad_token_id, length=length, side="right")
    ri, rm = pad_batch(rejected, pad_token_id=self.pad_token_id, length=length, side="right")
    return preference_pairs(ci, cm, ri, rm, np.asarray(margins, np.float32), name=name)

  def batch_index(self, step: int) -> np.ndarray:
    """Pair indices `[batch_size]` of optimizer step `step` (0-based): the kit's batch order
    (`batch_rows(..., epoch_end="wrap")`: a stream of `[seed, epoch]`-seeded permutations of
    the training pairs, every batch full)."""
    return batch_rows(self.config.seed, step, self.config.batch_size,
                      self.train_pairs.num_pairs, epoch_end="wrap")

  def place_rows(self, tree: Any) -> Any:
    """Host arrays whose rows (dimension 0) are a batch, as the compiled steps take them: as
    they are on one process (the steps place them), else global arrays split on rows over
    `data` x `fsdp` into which this process puts only its own rows
    (`jax_ppo.parallel.host_rows.global_rows`)."""
    if self.mesh is None or not multi_process():
      return tree
    return host_rows.place_rows(tree, self.mesh)

  # -- training and evaluation --------------------------------------------------------------

  def step(self) -> dict[str, float]:
    """One optimizer step on the next batch of pairs (and an evaluation every `eval_every`)."""
    batch = self.place_rows(self.train_pairs.take(self.batch_index(self.step_count)))
    self.state, metrics = self.steps.train_step(self.state, self.rest, batch)
    metrics = _to_host(metrics)
    c = self.config
    if c.eval_every and self.eval_pairs is not None and self.step_count % c.eval_every == 0:
      metrics.update(self.evaluate())
    return metrics

  def evaluate(self, data: PreferencePairs | Sequence[Any] | None = None) -> dict[str, float]:
    """`{"eval/loss", "eval/accuracy", "eval/pairs"}` over every pair of `data` (default: the
    held-out split), with the pair-weighted means of `bradley_terry_loss` (over every process's
    rows in a multi-process run)."""
    pairs = self.eval_pairs if data is None else self.encode(data, "data")
    if pairs is None:
      raise ValueError("No held-out split: pass eval_data to RewardModelTrainer or data here.")
    size = min(self.config.eval_batch_size, pairs.num_pairs)
    sums = {"loss": 0.0, "accuracy": 0.0, "pairs": 0.0}
    for index, weight in _chunks(pairs.num_pairs, size):
      rows = self.place_rows((pairs.take(index), weight))
      out = _to_host(self.steps.eval_sums(self.state.params, self.rest, *rows))
      sums = {k: sums[k] + out[k] for k in sums}
    return {"eval/loss": sums["loss"] / sums["pairs"],
            "eval/accuracy": sums["accuracy"] / sums["pairs"], "eval/pairs": sums["pairs"]}

  def score(self, input_ids, attention_mask) -> np.ndarray:
    """Scores `[N]` (float32, host) of `input_ids`/`attention_mask` `[N, S]`, in batches of
    `eval_batch_size` (several processes: each gives the same `N` rows, scores its own share,
    and every process gets all `N` scores)."""
    ids, mask = np.asarray(input_ids), np.asarray(attention_mask)
    if ids.ndim != 2 or ids.shape != mask.shape or ids.shape[0] < 1:
      raise ValueError(f"input_ids and attention_mask must both be [N, S] with N >= 1, got "
                       f"{ids.shape} and {mask.shape}.")
    size = min(self.config.eval_batch_size, ids.shape[0])
    out = []
    for index, weight in _chunks(ids.shape[0], size):
      rows = self.place_rows((ids[index].astype(np.int32), mask[index].astype(np.int32)))
      s = self.steps.scores(self.state.params, self.rest, *rows)
      out.append(host_rows.gathered(s)[weight > 0])
    return np.concatenate(out)

  def normalise(self, scores=None, *, input_ids=None, attention_mask=None) -> dict[str, float]:
    """Sets the reward normalisation from SFT-policy samples (docs/rlhf_details.md item 16).

    Give either `scores` `[N]` (this model's current scores of the samples, e.g. from a
    `RewardModelScorer`) or the samples' `input_ids` and `attention_mask` `[N, S]` (prompt +
    response, scored here). Folds `gain = 1 / std` and `bias = -mean / std` into the score head,
    so the samples then score with mean 0 and std 1. Call it once, after training: a second call
    rescales the already normalised scores. The run folder's checkpoints keep the trained,
    un-normalised state (the record goes to `run_dir/NORMALISATION_FILE`); `export` writes the
    normalised model.

    Returns:
      `{gain, bias, mean, std, samples}` (also kept in `self.normalisation`, written by
      `export`).
    """
    if (scores is None) == (input_ids is None):
      raise ValueError("Give either scores or input_ids (with attention_mask), not both.")
    if input_ids is not None:
      if attention_mask is None:
        raise ValueError("input_ids needs its attention_mask (1 on real tokens).")
      scores = self.score(input_ids, attention_mask)
    norm = normalisation_from_scores(scores)
    model = self.model
    model.rescale_scores(norm["gain"], norm["bias"])
    params = nnx.state(model, nnx.Any(nnx.LoRAParam, nnx.PathContains("score_head"))
                       if self.lora else nnx.Param)
    self.state = self.state.replace(params=jax.tree.map(
        lambda new, old: jax.device_put(jnp.asarray(new, old.dtype), old.sharding), params,
        self.state.params))
    self.normalisation = norm
    if self.run_dir is not None and is_main_process():
      (self.run_dir / NORMALISATION_FILE).write_text(json.dumps(norm, indent=2) + "\n")
    return norm

  @property
  def model(self) -> ScalarModel:
    """The reward model with the current parameters (a new module; the state is not shared)."""
    return nnx.merge(self.steps.graphdef, jax.tree.map(jnp.copy, self.state.params), self.rest)

  def export(self, path: str | os.PathLike, *, dtype=None,
             max_shard_size: int | str | None = "5GB") -> pathlib.Path:
    """Writes a one-label HF `*ForSequenceClassification` folder (LoRA merged) that
    `load_scalar_model` and `transformers.AutoModelForSequenceClassification` load, the
    tokenizer (when given) and `NORMALISATION_FILE` (after `normalise`). A model config without
    a pad id gets this trainer's (transformers needs one to find each row's last token)."""
    model = self.model
    if model.config.pad_token_id is None:  # transformers finds the last token by the pad id
      model.config = dataclasses.replace(model.config, pad_token_id=int(self.pad_token_id))
    if model.config.pad_token_id in model.config.eos_token_ids:
      logger.warning(
          "The reward model's pad_token_id %d is also its EOS: transformers reads its score at "
          "the last token that is not the pad id, i.e. before a final EOS, where "
          "load_scalar_model reads the EOS itself. Give the tokenizer a separate pad token for "
          "transformers to agree.", model.config.pad_token_id)
    files = ({} if self.normalisation is None else
             {NORMALISATION_FILE: json.dumps(self.normalisation, indent=2) + "\n"})
    return export_pretrained(model, path, tokenizer=self.tokenizer, dtype=dtype,
                             max_shard_size=max_shard_size, files=files)


__all__ = [
    "NORMALISATION_FILE",
    "RewardModelTrainer",
]
