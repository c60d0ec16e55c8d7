"""Reward sources: a reward model, a Python function of text, or a jittable function of ids,
alone or several combined with weights (`CombinedScorer`, each source logged as `reward/<name>`).

Every scorer is called as `scorer(rollout, reward_state) -> scores [B]` (float32) on the rollout's
truncated responses (PAD after the stop token, docs/rlhf_details.md item 5); `reward_state` is the
reward model's frozen parameters (`FrozenParams.reward`) or None.

Several processes (a multi-host run, `jax_ppo.parallel.host_rows`): the rollout is a global array
whose rows are split over the processes. Host-side scorers (a Python function of texts, a reward
model with its own tokenizer) decode and score only this process's rows and assemble the global
`[B]` scores from every process's rows (`jax.make_array_from_process_local_data`), so no process
needs every text; device-side scorers (a reward model on the policy's ids, a `TokenScorer`) run
on the global arrays as they are. `CombinedScorer` gathers each source's `[B]` raw scores for its
logged means.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_ppo.parallel import host_rows
from jax_ppo.rollout.sampler import Rollout

Array = jax.Array


def decode_rollout(tokenizer, rollout: Rollout) -> tuple[list[str], list[str]]:
  """Prompt and response texts of every row (padding dropped, special tokens kept)."""
  prompt_ids = np.asarray(rollout.prompt_ids)
  prompt_mask = np.asarray(rollout.prompt_mask).astype(bool)
  response_ids = np.asarray(rollout.response_ids)
  response_mask = np.asarray(rollout.response_mask).astype(bool)
  prompts = [tokenizer.decode(ids[m].tolist()) for ids, m in zip(prompt_ids, prompt_mask,
                                                                     strict=True)]
  responses = [tokenizer.decode(ids[m].tolist()) for ids, m in zip(response_ids, response_mask,
                                                                       strict=True)]
  return prompts, responses


class RewardFunctionError(RuntimeError):
  """A reward function raised; the original exception is the `__cause__`.

  Not a ValueError: the command line prints it with the full traceback (the user's code failed),
  while wrong values (NaN, a wrong length or type) are ValueErrors reported in one line.
  """


def _short(value: Any, limit: int = 60) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[: limit - 3] + "..."


def _row_context(row: int, prompts: Sequence | None) -> str:
  if prompts is None or row >= len(prompts):
    return f"row {row}"
  return f"row {row} (prompt {_short(prompts[row], 50)})"


def _real_dtype(dtype: np.dtype) -> bool:
  return dtype == np.bool_ or (np.issubdtype(dtype, np.number)
                               and not np.issubdtype(dtype, np.complexfloating))


def check_scores(scores: Any, batch: int, *, source: str,
                 prompts: Sequence | None = None) -> np.ndarray:
  """Validates host-side scores: `[batch]` finite numbers, else one ValueError saying what is wrong.

  Args:
    scores: what the scorer returned: a sequence or array of `batch` real numbers (bools and
      integers are accepted and converted).
    batch: the number of responses `B` scored.
    source: how the message names the scorer ("The reward function 'mod:fn'").
    prompts: the rows' prompts (texts or ids), quoted in the message for the first bad row.

  Returns:
    `scores` as a float32 numpy array `[B]`.

  Raises:
    ValueError: naming the batch row (its prompt) and the value: a non-number, NaN or inf, or a
      length other than `B`. Nothing is ever replaced by zero.
  """
  array_like = isinstance(scores, np.ndarray | np.generic | jax.Array)
  if not array_like and (isinstance(scores, str | bytes | Mapping | set | frozenset)
                         or not hasattr(scores, "__len__") or not hasattr(scores, "__iter__")):
    raise ValueError(
        f"{source} returned {_short(scores)} ({type(scores).__name__}); return a list or array "
        f"of {batch} floats, one per response, in order."
    )
  items = None if array_like else list(scores)
  if items is not None:
    if len(items) != batch:
      raise ValueError(
          f"{source} returned scores of shape ({len(items)},) for {batch} responses; return one "
          "float per response, in the order of the prompts it was given."
      )
    for row, value in enumerate(items):
      ok = (isinstance(value, (int, float, np.bool_)) or (
          isinstance(value, (np.generic, np.ndarray, jax.Array)) and np.ndim(value) == 0
          and _real_dtype(np.asarray(value).dtype)))
      if not ok:
        raise ValueError(
            f"{source} returned {_short(value)} ({type(value).__name__}) at "
            f"{_row_context(row, prompts)}; every score must be a real number."
        )
    arr = np.asarray([float(v) for v in items], dtype=np.float32)
  else:
    arr = np.asarray(scores)
    if not _real_dtype(arr.dtype):
      raise ValueError(f"{source} returned an array of dtype {arr.dtype}; return real numbers.")
    if arr.shape != (batch,):
      raise ValueError(
          f"{source} returned scores of shape {arr.shape} for {batch} responses; return one "
          "float per response (shape [B]), in order."
      )
    arr = arr.astype(np.float32)
  bad = np.flatnonzero(~np.isfinite(arr))
  if bad.size:
    more = ", ..." if bad.size > 10 else ""
    rows = ", ".join(map(str, bad[:10].tolist()))
    values = ", ".join(str(v) for v in arr[bad[:10]].tolist())
    raise ValueError(
        f"{source} returned non-finite scores at rows [{rows}{more}] (values {values}{more}; "
        f"{bad.size} of {batch} rows); the first is {_row_context(int(bad[0]), prompts)}. Return "
        "finite floats (clip the score or replace NaN/inf); nothing is replaced by zero."
    )
  return arr


def check_device_scores(scores: Array, *, source: str,
                        prompts: Callable[[], Sequence | None] | None = None) -> None:
  """`check_scores` for scores `[B]` computed on device (a reward model, a `TokenScorer`).

  One device-side reduction when every score is finite (the common case); otherwise the scores
  are gathered to the host and the error names the rows, values and (when `prompts` can give
  them) the prompts.
  """
  if bool(jnp.all(jnp.isfinite(scores))):
    return
  host = host_rows.gathered(scores)
  check_scores(host, host.shape[0], source=source, prompts=prompts() if prompts else None)


def _function_name(fn: Callable) -> str:
  module = getattr(fn, "__module__", None) or type(fn).__module__
  name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
  return f"{module}:{name}"


class FunctionScorer:
  """Scores from a Python function `fn(prompts, responses) -> sequence of floats`.

  With a tokenizer the function receives decoded texts; without one it receives lists of token
  ids (valid tokens only). Row `i` of both lists is batch row `i` (prompts repeat `n_samples`
  times). The result is checked by `check_scores`; an exception raised by `fn` is re-raised as a
  `RewardFunctionError` naming the first row that raises on its own (the function is called
  again row by row to find it), with the original exception as its `__cause__`.
  """

  def __init__(self, fn: Callable[[list, list], Sequence[float]], *, tokenizer=None,
               name: str | None = None):
    if not callable(fn):
      raise ValueError(f"The reward function must be callable, got {_short(fn)}.")
    self.fn = fn
    self.tokenizer = tokenizer
    self.name = name or _function_name(fn)

  def _inputs(self, rollout: Rollout) -> tuple[list, list]:
    """Prompts and responses of the rollout's rows (this process's rows of a global one)."""
    rollout = _local(rollout)
    if self.tokenizer is not None:
      return decode_rollout(self.tokenizer, rollout)
    pm = np.asarray(rollout.prompt_mask).astype(bool)
    rm = np.asarray(rollout.response_mask).astype(bool)
    prompts = [r[m].tolist() for r, m in zip(np.asarray(rollout.prompt_ids), pm, strict=True)]
    responses = [r[m].tolist() for r, m in zip(np.asarray(rollout.response_ids), rm,
                                                strict=True)]
    return prompts, responses

  def _failing_row(self, prompts: list, responses: list) -> int | None:
    for row, (p, r) in enumerate(zip(prompts, responses, strict=True)):
      try:
        self.fn([p], [r])
      except Exception:  # noqa: BLE001 - only locating the row; the batch error is re-raised.
        return row
    return None

  def __call__(self, rollout: Rollout, reward_state=None) -> Array:
    del reward_state
    prompts, responses = self._inputs(rollout)
    b = len(responses)
    source = f"The reward function {self.name!r}{_rows_note(rollout.response_ids)}"
    try:
      try:
        scores = self.fn(prompts, responses)
      except Exception as e:
        row = self._failing_row(prompts, responses)
        where = (f"at {_row_context(row, prompts)}, response {_short(responses[row], 50)}"
                 if row is not None else
                 f"on the batch of {b} responses (no single row raises alone)")
        raise RewardFunctionError(
            f"{source} raised {type(e).__name__}: {e} -- {where}. Fix the function; its "
            "traceback is above."
        ) from e
      scores = check_scores(scores, b, source=source, prompts=prompts)
    except (ValueError, RewardFunctionError):
      _agree_on_failure(rollout.response_ids, source, failed=True)
      raise
    _agree_on_failure(rollout.response_ids, source, failed=False)
    return _global_scores(scores, rollout.response_ids)


def _agree_on_failure(like: Array, source: str, *, failed: bool) -> None:
  """Several processes (`like` is global): every process says whether scoring its rows failed
  (one small all-gather), so that all of them stop together instead of the others waiting for
  ever in the next collective; a process whose rows scored raises `RewardFunctionError` naming
  the failure on another process (whose own error says what is wrong). Nothing on one process."""
  if not host_rows.is_global(like):
    return
  if host_rows.global_max(int(failed)) and not failed:
    raise RewardFunctionError(
        f"{source.split(' (process')[0]} failed on the rows of another process (its error, in "
        f"that process's output, names the row and the fix); process {jax.process_index()} "
        "stops too.")


def _local(rollout: Rollout) -> Rollout:
  """Host copies of the rollout's rows (this process's rows of a global rollout)."""
  if not host_rows.is_global(rollout.response_ids):
    return rollout
  return jax.tree.map(host_rows.local_rows, rollout)


def _rows_note(like: Array) -> str:
  """" (process i: rows a to b of B)" in error messages about a global rollout's local rows."""
  if not host_rows.is_global(like):
    return ""
  start, stop = host_rows.local_row_range(like.sharding, like.shape)
  return (f" (process {jax.process_index()}: rows {start} to {stop - 1} of {like.shape[0]}; "
          "rows below count from its first)")


def _global_scores(local: np.ndarray, like: Array) -> Array:
  """`[B]` float32 scores from this process's rows `local` of `like`'s rows (`jnp.asarray(local)`
  when `like` is not global)."""
  if not host_rows.is_global(like):
    return jnp.asarray(local)
  return host_rows.global_rows(local, host_rows.row_sharding(like), like.shape[:1])


class TokenScorer:
  """Scores from a jittable `fn(prompt_ids, prompt_mask, response_ids, response_mask) -> [B]`.

  Runs on device without leaving the compiled world, e.g. a count of target tokens. The `[B]`
  scores are copied to the host once and checked like a Python function's (`check_scores`:
  NaN or inf is an error naming the rows and values).
  """

  def __init__(self, fn: Callable[[Array, Array, Array, Array], Array], *,
               name: str | None = None):
    self.fn = fn
    self.name = name or _function_name(fn)
    self._jitted = jax.jit(fn)

  def __call__(self, rollout: Rollout, reward_state=None) -> Array:
    del reward_state
    scores = self._jitted(
        rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.response_mask
    )
    if scores.shape != rollout.response_ids.shape[:1]:
      raise ValueError(
          f"The token reward function returned shape {scores.shape}; expected "
          f"{rollout.response_ids.shape[:1]} (one score per response)."
      )
    scores = scores.astype(jnp.float32)
    check_device_scores(scores, source=f"The token reward function {self.name!r}")
    return scores


class RewardModelScorer:
  """Scores from a reward model (`jax_ppo.models.ScalarModel`) read at the last valid token.

  When the reward model has its own tokenizer that differs from the policy's (docs/rlhf_details.md
  item 21), each prompt + response is decoded with the policy tokenizer without its special
  tokens (`clean_texts`: the policy's EOS, PAD, BOS never reach the reward model as literal
  text) and re-tokenized with the reward tokenizer as it tokenizes any text, adding its own
  special tokens (e.g. a Llama tokenizer's BOS; as verl does, and as the reward stage's
  normalisation tokenizes the policy's samples, `jax_ppo.runs.reward.policy_samples`), then
  right-aligned to `max_length`. Otherwise the policy's ids are scored directly.
  Non-finite scores (broken weights, float16 overflow) are an error naming the rows and values
  (`check_scores`), never passed on.

  Args:
    reward_model: the reward model; it is split once, its state goes into `FrozenParams`.
    policy_tokenizer: needed when re-tokenizing.
    reward_tokenizer: the reward model's tokenizer, when it may differ from the policy's.
    max_length: re-tokenized sequences are truncated on the left to this many tokens (the reward
      model's context, `max_position_embeddings`).
  """

  def __init__(
      self,
      reward_model: nnx.Module,
      *,
      policy_tokenizer=None,
      reward_tokenizer=None,
      max_length: int = 1024,
  ):
    self.graphdef, self.state = nnx.split(reward_model)
    self.policy_tokenizer = policy_tokenizer
    self.reward_tokenizer = reward_tokenizer
    self.max_length = max_length
    self.retokenize = reward_tokenizer is not None and (
        policy_tokenizer is None or policy_tokenizer.get_vocab() != reward_tokenizer.get_vocab()
    )
    if self.retokenize and policy_tokenizer is None:
      raise ValueError(
          "RewardModelScorer needs `policy_tokenizer` to decode responses for a reward model "
          "with a different tokenizer."
      )
    graphdef = self.graphdef

    @jax.jit
    def score(state, ids, mask):
      return nnx.merge(graphdef, state).score(ids, mask)

    self._score = score

  def clean_texts(self, ids_bs: np.ndarray, mask_bs: np.ndarray) -> list[str]:
    """The text of each row's valid tokens, decoded by the policy's tokenizer without its
    special tokens (EOS, PAD, BOS, ...): the policy's `<|endoftext|>` is not text the reward
    model should read, and its own tokenizer adds its own special tokens when re-tokenizing.

    Args:
      ids_bs: `[B, S]` int token ids of the policy (prompt and response).
      mask_bs: `[B, S]` bool, True at the valid tokens.
    """
    return [self.policy_tokenizer.decode(r[m].tolist(), skip_special_tokens=True)
            for r, m in zip(ids_bs, mask_bs, strict=True)]

  def _retokenized(self, rollout: Rollout) -> tuple[np.ndarray, np.ndarray]:
    # Each row's prompt and response are decoded together: decoding them apart and joining the
    # texts drops the space between them for tokenizers that do not store it in the token
    # (word-level, SentencePiece's leading "▁" of the first response token).
    spread = host_rows.is_global(rollout.response_ids)
    rollout = _local(rollout)  # (several processes: this process's rows)
    ids_all = np.asarray(rollout.sequence_ids)
    mask_all = np.asarray(rollout.attention_mask).astype(bool)
    texts = self.clean_texts(ids_all, mask_all)
    tok = self.reward_tokenizer
    seqs = [tok(t)["input_ids"][-self.max_length :] for t in texts]
    empty = [i for i, seq in enumerate(seqs) if not seq]
    if spread:  # (several processes: all stop when one's rows cannot be read)
      host_rows.stop_together(bool(empty), "Re-tokenizing the rows for the reward model")
    if empty:
      raise ValueError(
          f"Row {empty[0]} re-tokenizes to no reward-model tokens (text "
          f"{_short(texts[empty[0]])}); the reward model's tokenizer cannot read the policy's text."
      )
    length = host_rows.global_max(max(len(seq) for seq in seqs))  # (the same on every process)
    # Bucket to a power of two (bounded compiles), never past the reward model's context.
    length = min(1 << max(length - 1, 0).bit_length(), self.max_length)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = np.full((len(seqs), length), pad, np.int32)
    mask = np.zeros((len(seqs), length), np.int32)
    for i, seq in enumerate(seqs):
      ids[i, length - len(seq):] = seq
      mask[i, length - len(seq):] = 1
    return ids, mask

  def __call__(self, rollout: Rollout, reward_state=None) -> Array:
    state = self.state if reward_state is None else reward_state
    if self.retokenize:
      ids, mask = self._retokenized(rollout)
      if host_rows.is_global(rollout.response_ids):  # this process's rows of the global batch
        like = rollout.response_ids
        sharding = jax.sharding.NamedSharding(
            like.sharding.mesh, jax.sharding.PartitionSpec(*host_rows.row_sharding(like).spec,
                                                           None))
        shape = (like.shape[0], ids.shape[1])
        ids, mask = (host_rows.global_rows(x, sharding, shape) for x in (ids, mask))
      scores = self._score(state, ids, mask)
    else:
      scores = self._score(state, rollout.sequence_ids, rollout.attention_mask)
    # B floats to the host: a NaN score would otherwise reach the advantages silently.
    check_device_scores(
        scores, source="The reward model (check its weights, and dtype='float32' if it overflows)",
        prompts=lambda: (decode_rollout(self.policy_tokenizer,
                                        jax.tree.map(host_rows.gathered, rollout))[0]
                         if self.policy_tokenizer is not None else None))
    return scores


class CombinedScorer:
  """A weighted sum of several reward sources, each source's raw score checked and logged.

  `score = sum_i w_i * s_i` where `s_i [B]` is the raw score of source `i` (a reward model, a
  Python function of texts or a jittable function of ids). Every source is called and checked as
  on its own (`check_scores`: NaN/inf, wrong length or type is an error); an error is re-raised
  with the source's name and weight in front, as the same exception type (the original stays
  the `__cause__`). After each call `metrics()` gives `reward/<name>` (the mean raw score of each
  source over the batch) and `reward/<name>_std`.

  Sources with parameters (reward models) keep them in `state`, a dict `name -> state` that the
  trainer stores in `FrozenParams.reward` and hands back on each call.

  Args:
    sources: `(name, scorer, weight)` triples; names must be unique and non-empty, weights
      finite numbers.
  """

  def __init__(self, sources: Sequence[tuple[str, Callable, float]]):
    if not sources:
      raise ValueError("CombinedScorer needs at least one (name, scorer, weight) source.")
    names: list[str] = []
    for entry in sources:
      if not (isinstance(entry, tuple) and len(entry) == 3):
        raise ValueError(f"CombinedScorer: expected (name, scorer, weight) triples, got "
                         f"{_short(entry)}.")
      name, scorer, weight = entry
      if not isinstance(name, str) or not name:
        raise ValueError(f"CombinedScorer: a source name must be a non-empty string, got "
                         f"{name!r}.")
      if name in names:
        raise ValueError(f"CombinedScorer: two reward sources are named {name!r}; give each a "
                         "distinct name (RunConfig.rewards[i].name).")
      if not callable(scorer):
        raise ValueError(f"CombinedScorer: reward source {name!r} is {_short(scorer)}, not a "
                         "scorer.")
      if (isinstance(weight, bool) or not isinstance(weight, int | float)
          or not np.isfinite(weight)):
        raise ValueError(f"CombinedScorer: reward source {name!r} has weight {weight!r}; give "
                         "a finite number.")
      names.append(name)
    self.sources = [(n, s, float(w)) for n, s, w in sources]
    self.names = tuple(names)
    self.weights = {n: w for n, _, w in self.sources}
    states = {n: s.state for n, s, _ in self.sources if getattr(s, "state", None) is not None}
    self.state = states or None
    self.last_raw: dict[str, np.ndarray] = {}

  def __call__(self, rollout: Rollout, reward_state=None) -> Array:
    total = None
    raw: dict[str, np.ndarray] = {}
    for name, scorer, weight in self.sources:
      sub_state = None
      if reward_state is not None and name in reward_state:
        sub_state = reward_state[name]
      try:
        scores = scorer(rollout, sub_state)
      except (ValueError, RewardFunctionError) as e:
        raise type(e)(f"Reward source {name!r} (weight {weight:g}): {e}") from e
      scores = jnp.asarray(scores, jnp.float32)
      raw[name] = host_rows.gathered(scores)  # (several processes: the [B] scores, gathered)
      total = weight * scores if total is None else total + weight * scores
    self.last_raw = raw
    return total

  def metrics(self) -> dict[str, float]:
    """`reward/<name>` and `reward/<name>_std` of each source's raw scores in the last call."""
    out = {}
    for name, scores in self.last_raw.items():
      out[f"reward/{name}"] = float(np.mean(scores))
      out[f"reward/{name}_std"] = float(np.std(scores))
    return out


def as_scorer(reward: Any, tokenizer: Any = None) -> Callable:
  """`PPOTrainer`'s `reward` argument as a scorer: a `ScalarModel` becomes a
  `RewardModelScorer`, a scorer is kept, any other callable becomes a `FunctionScorer`."""
  from jax_ppo.models.heads import ScalarModel

  if isinstance(reward, ScalarModel):
    return RewardModelScorer(reward, policy_tokenizer=tokenizer)
  if isinstance(reward, nnx.Module):
    raise ValueError(
        f"`reward` is a {type(reward).__name__}; pass a ScalarModel reward model, a scorer, or "
        "a function fn(prompts, responses) -> scores."
    )
  if isinstance(reward, (FunctionScorer, TokenScorer, RewardModelScorer, CombinedScorer)):
    return reward
  if callable(reward):
    return FunctionScorer(reward, tokenizer=tokenizer)
  raise ValueError(f"`reward` must be a reward model, a scorer or a function, got {reward!r}.")
