"""DPO's preference pairs: prompt + chosen and prompt + rejected rows, with their response tokens
marked, and their encoding from preference records.

A record is any form the reward-model stage reads (`jax_ppo.data.preferences`): text or token-id
responses after a text, token-id or chat prompt, or chat responses with an explicit or implicit
prompt. Unlike a reward model (scored at the last token), DPO needs the boundary between prompt
and response: only response tokens enter the sequence log-probs
:math:`\\log\\pi(y \\mid x) = \\sum_{t \\in y} \\log\\pi(y_t \\mid x, y_{<t})`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import struct

from jax_ppo.data.preferences import is_chat
from jax_ppo.data.records import Record, preference_record, warn_cut
from jax_ppo.data.sft import chat_prompt_response
from jax_ppo.models.tokenizer import encode_chat

Array = jax.Array


class DPOPairs(struct.PyTreeNode):
  """`N` tokenized preference pairs; chosen and rejected rows share the length `S` (right
  padding).

  Attributes:
    chosen_ids, rejected_ids: `[N, S]` int32 ids of prompt + response.
    chosen_mask, rejected_mask: `[N, S]` int32, 1 on real tokens.
    chosen_response, rejected_response: `[N, S]` int32, 1 on response tokens (a subset of the
      mask, never the first column: every response token has a token before it).
  """

  chosen_ids: Array
  chosen_mask: Array
  chosen_response: Array
  rejected_ids: Array
  rejected_mask: Array
  rejected_response: Array

  @property
  def num_pairs(self) -> int:
    return int(self.chosen_ids.shape[0])

  def take(self, index: np.ndarray) -> DPOPairs:
    """The pairs at `index` (host arrays)."""
    return jax.tree.map(lambda x: np.asarray(x)[index], self)


def dpo_pairs(chosen: Sequence[tuple[list[int], list[int]]],
              rejected: Sequence[tuple[list[int], list[int]]], *, pad_token_id: int,
              name: str = "pairs", places: Sequence[str] | None = None) -> DPOPairs:
  """`DPOPairs` from `(prompt ids, response ids)` of each pair's chosen and rejected side, right
  padded to the longest row.

  Raises:
    ValueError: naming the pair (`places[i]`, e.g. "'prefs.jsonl', line 3", else `name[i]`),
      when a side has no prompt or no response token.
  """
  if len(chosen) != len(rejected) or not chosen:
    raise ValueError(f"{name}: give as many chosen as rejected sides, at least one.")
  for side, rows in (("chosen", chosen), ("rejected", rejected)):
    for i, (prompt, response) in enumerate(rows):
      if not prompt or not response:
        where = f"{name}[{i}]" if places is None else places[i]
        raise ValueError(f"{where}: the {side} side has no "
                         f"{'prompt' if not prompt else 'response'} token; DPO scores response "
                         "tokens after at least one prompt token.")
  length = max(len(p) + len(r) for p, r in (*chosen, *rejected))
  n = len(chosen)
  out = {}
  for side, rows in (("chosen", chosen), ("rejected", rejected)):
    ids = np.full((n, length), pad_token_id, np.int32)
    mask = np.zeros((n, length), np.int32)
    response = np.zeros((n, length), np.int32)
    for i, (p, r) in enumerate(rows):
      ids[i, :len(p) + len(r)] = [*p, *r]
      mask[i, :len(p) + len(r)] = 1
      response[i, len(p):len(p) + len(r)] = 1
    out.update({f"{side}_ids": ids, f"{side}_mask": mask, f"{side}_response": response})
  return DPOPairs(**out)


class PairEncoder:
  """Tokenizes preference records into `(prompt ids, response ids)` sides.

  Args:
    tokenizer: a transformers tokenizer (None: records must hold token ids).
    vocab_size: the model's vocabulary (ids must lie in `[0, vocab_size)`).
    max_length: tokens per row; the response loses its end first (down to `max_length - 1`
      tokens), then the prompt its start.
    eos_token_id: appended to each response when `add_eos` (unless it ends with it).
    fields: the records' prompt, chosen and rejected field names.
  """

  def __init__(self, tokenizer: Any, *, vocab_size: int, max_length: int,
               eos_token_id: int | None, add_eos: bool, fields: tuple[str, str, str]):
    self.tokenizer = tokenizer
    self.vocab_size = vocab_size
    self.max_length = max_length
    self.eos_token_id = eos_token_id
    self.add_eos = add_eos
    self.fields = fields
    self.cut_records: dict[str, int] = {}  # records cut to max_length, by `encode`'s name

  def side(self, prompt: Any, response: Any, where: str, field: str
           ) -> tuple[list[int], list[int]]:
    """`(prompt ids, response ids)` of one side (see the module docstring for the forms); a chat
    response is rendered with its prompt by the chat template and ends at its last EOS."""
    tok = self.tokenizer
    if (isinstance(response, str) or is_chat(response) or is_chat(prompt)
        or isinstance(prompt, str)) and tok is None:
      raise ValueError(f"{where} holds text but no tokenizer was given; pass tokenizer= or "
                       "give token-id lists.")
    if is_chat(response):
      p_ids, r_ids = chat_prompt_response([*prompt, *response], tok, where, field=field)
      if self.eos_token_id in r_ids:
        r_ids = r_ids[:len(r_ids) - r_ids[::-1].index(self.eos_token_id)]
    else:
      p_ids = (tok(prompt, add_special_tokens=True)["input_ids"] if isinstance(prompt, str) else
               encode_chat(tok, [prompt])[0] if is_chat(prompt) else prompt)
      r_ids = tok(response, add_special_tokens=False)["input_ids"] if isinstance(
          response, str) else response
    for part in (p_ids, r_ids):
      if not isinstance(part, (list, tuple, np.ndarray)) or not all(
          isinstance(t, (int, np.integer)) and 0 <= t < self.vocab_size for t in part):
        raise ValueError(f"{where} must be a string, a chat or a list of token ids in [0, "
                         f"{self.vocab_size}) (the model's vocabulary).")
    p_ids, r_ids = [int(t) for t in p_ids], [int(t) for t in r_ids]
    if self.add_eos and (not r_ids or r_ids[-1] != self.eos_token_id):
      r_ids.append(int(self.eos_token_id))
    return p_ids, r_ids

  def fit(self, p_ids: list[int], r_ids: list[int]) -> tuple[list[int], list[int]]:
    """One side cut to `max_length`: the response loses its end first (down to `max_length -
    1` tokens), then the prompt its start."""
    r_ids = r_ids[:self.max_length - 1]
    p_ids = p_ids[len(p_ids) + len(r_ids) - self.max_length:] if (
        len(p_ids) + len(r_ids) > self.max_length) else p_ids
    return p_ids, r_ids

  def encode(self, data: Sequence[Any], *, name: str, pad_token_id: int) -> DPOPairs:
    """`DPOPairs` of the records `data` (mappings); errors name the record and field (or the
    file and line of records read from a file)."""
    if isinstance(data, (str, bytes)) or not isinstance(data, Sequence) or not data:
      raise ValueError(f"{name} must be a non-empty list of preference records.")
    p_field, c_field, r_field = self.fields
    places = getattr(data, "places", None)
    chosen, rejected = [], []
    for i, record in enumerate(data):
      where = f"{name}[{i}]" if places is None else places[i]
      at = (lambda f, w=where: f"{w}.{f}") if places is None else (
          lambda f, w=where: f"{w}, field {f!r}")
      pair = preference_record(Record(where, record), self.fields, None, token_ids=True,
                               prefix="DPOConfig.")
      chosen.append(self.side(pair["prompt"], pair["chosen"], at(c_field), c_field))
      rejected.append(self.side(pair["prompt"], pair["rejected"], at(r_field), r_field))
    cut = [i for i in range(len(chosen))
           if max(sum(map(len, chosen[i])), sum(map(len, rejected[i]))) > self.max_length]
    self.cut_records[name] = warn_cut(
        [f"{name}[{i}]" if places is None else places[i] for i in cut], len(chosen),
        max_length=self.max_length, what=f"preference pairs of {name}",
        how="their responses lose their ends first, then their prompts their starts")
    chosen = [self.fit(*side) for side in chosen]
    rejected = [self.fit(*side) for side in rejected]
    return dpo_pairs(chosen, rejected, pad_token_id=pad_token_id, name=name, places=places)


def eval_chunks(n: int, size: int):
  """`(index [size], weight [size])` chunks covering `range(n)`; the last is padded with row 0
  at weight 0, so every chunk has one shape (one compile)."""
  for start in range(0, n, size):
    index = np.arange(start, min(start + size, n))
    weight = np.ones(size, np.float32)
    weight[index.size:] = 0
    yield np.concatenate([index, np.zeros(size - index.size, index.dtype)]), weight


__all__ = ["DPOPairs", "PairEncoder", "dpo_pairs", "eval_chunks"]
