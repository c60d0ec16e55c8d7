"""Supervised fine-tuning examples: tokenising (prompt, response) records, padding and packing.

An `SFTExample` is a prompt and a response as token ids; the model is trained on the response
only (the prompt tokens are context, never targets). Records become examples through the
tokenizer:

* a `messages` record (a list of `{"role", "content"}` turns ending with the assistant's) goes
  through `tokenizer.apply_chat_template`: the prompt is the template of every turn but the
  last with the generation prompt (`add_generation_prompt=True`), the response is the rest of the
  template of the whole conversation;
* a plain record has a prompt string and a response string; the prompt is tokenised with the
  tokenizer's special tokens (BOS), the response without. The two are tokenised separately (as
  at generation time, where the response continues the tokenised prompt), so a response should
  carry the leading space that BPE vocabularies expect after a word (`" Great product."`).

EOS is appended to every response (unless it already holds one, as chat templates that close
the assistant turn with the EOS token do), so that the model learns to stop.

Rows (`SFTRows`, host NumPy arrays `[N, L]`) are right-padded to `L = max_length`. Without
packing a row holds one example; with packing (`pack_examples`) consecutive examples share a row
as long as they fit, each with its own segment id (1, 2, ...; 0 on padding), positions restarting
at 0, and targets that never cross from one example into the next.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

logger = logging.getLogger("jax_ppo.data")


class SFTExample(NamedTuple):
  """One training example.

  Attributes:
    prompt_ids: token ids of the prompt (context only, never a target).
    response_ids: token ids of the response (the targets), EOS included.
  """

  prompt_ids: tuple[int, ...]
  response_ids: tuple[int, ...]

  @property
  def num_tokens(self) -> int:
    return len(self.prompt_ids) + len(self.response_ids)


class SFTRows(NamedTuple):
  """Right-padded (and possibly packed) rows, NumPy arrays `[N, L]`.

  Attributes:
    input_ids: int32 token ids (`pad_token_id` on padding).
    attention_mask: bool, True on real tokens.
    positions: int32 position ids, 0 at the first token of every example.
    segment_ids: int32 example index within the row (1, 2, ...), 0 on padding.
    targets: int32 next token of the same example (`input_ids[:, t + 1]`), pad elsewhere.
    loss_mask: bool, True where `targets` is a response token: the slots that carry loss.
  """

  input_ids: np.ndarray
  attention_mask: np.ndarray
  positions: np.ndarray
  segment_ids: np.ndarray
  targets: np.ndarray
  loss_mask: np.ndarray

  @property
  def num_rows(self) -> int:
    return int(self.input_ids.shape[0])

  def take(self, index: np.ndarray) -> SFTRows:
    """The rows at `index`; an index of -1 gives an empty row (all padding, no loss)."""
    index = np.asarray(index, np.int64)
    empty = index < 0
    out = []
    for a in self:
      rows = a[np.where(empty, 0, index)]
      rows[empty] = 0
      out.append(rows)
    return SFTRows(*out)


# -- tokenising -----------------------------------------------------------------------------------


def _ids(tokenizer: Any, text: str, *, special: bool) -> list[int]:
  return [int(i) for i in tokenizer(text, add_special_tokens=special)["input_ids"]]


def _with_eos(response: list[int], eos_token_id: int | None, add_eos: bool) -> list[int]:
  if add_eos and eos_token_id is not None and eos_token_id not in response:
    response = [*response, int(eos_token_id)]
  return response


def chat_prompt_response(
    messages: Any, tokenizer: Any, where: str, *, field: str = "messages"
) -> tuple[list[int], list[int]]:
  """Token ids `(prompt, response)` of a conversation that ends with the assistant's turn: the
  chat template of every turn but the last with the generation prompt, and the rest of the
  template of the whole conversation (the response the policy learns to write, and the reward
  model scores).

  Raises:
    ValueError: naming `where` and `field`, for a conversation that is not a non-empty list of
      `{role, content}` turns ending with the assistant's, a tokenizer without a chat template,
      or a template that does not render the turns in order.
  """
  if not isinstance(messages, list) or not messages or not all(
      isinstance(m, Mapping) and "role" in m and "content" in m for m in messages
  ):
    raise ValueError(
        f"{where}: `{field}` must be a non-empty list of {{'role': ..., 'content': ...}} turns."
    )
  if messages[-1]["role"] != "assistant":
    raise ValueError(
        f"{where}: the last turn of `{field}` has role {messages[-1]['role']!r}; it must be the "
        "assistant's response that SFT trains on."
    )
  if getattr(tokenizer, "chat_template", None) is None:
    raise ValueError(
        f"{where}: a `{field}` chat needs a tokenizer with a chat template; set "
        "tokenizer.chat_template (or load_tokenizer(chat_template=...)) or give text fields."
    )
  prompt_text = tokenizer.apply_chat_template(
      messages[:-1], tokenize=False, add_generation_prompt=True
  )
  full_text = tokenizer.apply_chat_template(messages, tokenize=False)
  if not full_text.startswith(prompt_text):
    raise ValueError(
        f"{where}: the chat template of the whole conversation does not start with the template "
        "of its prompt turns (with add_generation_prompt=True), so the response cannot be "
        "separated from the prompt; use a template that renders the turns in order."
    )
  # The template text already holds BOS and the role markers: no further special tokens.
  return (_ids(tokenizer, prompt_text, special=False),
          _ids(tokenizer, full_text[len(prompt_text):], special=False))


def encode_record(
    record: Mapping[str, Any],
    tokenizer: Any,
    *,
    prompt_field: str = "prompt",
    response_field: str = "response",
    messages_field: str = "messages",
    add_eos: bool = True,
    where: str = "record",
) -> SFTExample:
  """One record -> an `SFTExample` (see the module docstring for the two record kinds).

  Args:
    record: a mapping with `messages_field`, or with `prompt_field` and `response_field`
      strings.
    tokenizer: a transformers tokenizer (with a chat template for `messages` records).
    prompt_field, response_field, messages_field: the record's field names.
    add_eos: append `tokenizer.eos_token_id` to the response unless it already holds it.
    where: how errors name the record (e.g. "train.jsonl line 12").
  """
  if not isinstance(record, Mapping):
    raise ValueError(f"{where}: expected a mapping (a JSON object), got {type(record).__name__}.")
  if messages_field in record:
    prompt, response = chat_prompt_response(record[messages_field], tokenizer, where,
                                            field=messages_field)
  else:
    missing = [f for f in (prompt_field, response_field) if f not in record]
    if missing:
      raise ValueError(
          f"{where}: no field {missing[0]!r} (fields: {sorted(record)}); give "
          f"{prompt_field!r} and {response_field!r} strings or a {messages_field!r} list, or "
          "set the field names in the config."
      )
    for field in (prompt_field, response_field):
      if not isinstance(record[field], str):
        raise ValueError(
            f"{where}: field {field!r} must be a string, got {type(record[field]).__name__}."
        )
    prompt = _ids(tokenizer, record[prompt_field], special=True)
    response = _ids(tokenizer, record[response_field], special=False)
  response = _with_eos(response, tokenizer.eos_token_id, add_eos)
  if not response:
    raise ValueError(f"{where}: the response is empty, so the example has nothing to learn.")
  return SFTExample(tuple(prompt), tuple(response))


def encode_records(
    records: Iterable[Mapping[str, Any]], tokenizer: Any, *, source: str = "records", **kwargs
) -> list[SFTExample]:
  """`encode_record` over `records`; errors name `source` and the record's index."""
  return [encode_record(r, tokenizer, where=f"{source}[{i}]", **kwargs)
          for i, r in enumerate(records)]


def example_from_ids(
    prompt_ids: Sequence[int], response_ids: Sequence[int], *, eos_token_id: int | None = None,
    add_eos: bool = True,
) -> SFTExample:
  """An `SFTExample` from token ids (EOS appended when given and not already there)."""
  response = _with_eos([int(i) for i in response_ids], eos_token_id, add_eos)
  if not response:
    raise ValueError("response_ids is empty, so the example has nothing to learn.")
  return SFTExample(tuple(int(i) for i in prompt_ids), tuple(response))


# -- rows -----------------------------------------------------------------------------------------


def _truncate(examples: Sequence[SFTExample], max_length: int) -> list[SFTExample]:
  """Cuts the response of examples longer than `max_length` (the prompt stays whole)."""
  out, cut = [], 0
  for i, ex in enumerate(examples):
    if len(ex.prompt_ids) >= max_length:
      raise ValueError(
          f"Example {i} has a prompt of {len(ex.prompt_ids)} tokens, which leaves no room for a "
          f"response in max_length={max_length}; raise max_length or shorten the prompt."
      )
    if ex.num_tokens > max_length:
      ex = SFTExample(ex.prompt_ids, ex.response_ids[: max_length - len(ex.prompt_ids)])
      cut += 1
    out.append(ex)
  if cut:
    logger.warning("%d of %d examples are longer than max_length=%d; their responses were cut "
                   "(and lose their EOS).", cut, len(examples), max_length)
  return out


def _rows(groups: Sequence[Sequence[SFTExample]], max_length: int, pad_token_id: int) -> SFTRows:
  n = len(groups)
  input_ids = np.full((n, max_length), pad_token_id, np.int32)
  targets = np.full((n, max_length), pad_token_id, np.int32)
  mask = np.zeros((n, max_length), bool)
  loss_mask = np.zeros((n, max_length), bool)
  positions = np.zeros((n, max_length), np.int32)
  segment_ids = np.zeros((n, max_length), np.int32)
  for r, group in enumerate(groups):
    offset = 0
    for k, ex in enumerate(group, start=1):
      ids = np.asarray(ex.prompt_ids + ex.response_ids, np.int32)
      m, p = len(ids), len(ex.prompt_ids)
      span = slice(offset, offset + m)
      input_ids[r, span] = ids
      mask[r, span] = True
      positions[r, span] = np.arange(m)
      segment_ids[r, span] = k
      # Slot j predicts token j + 1 of the same example; the response's tokens carry the loss.
      targets[r, offset : offset + m - 1] = ids[1:]
      loss_mask[r, offset + max(p, 1) - 1 : offset + m - 1] = True  # no prompt: no BOS either
      offset += m
  return SFTRows(input_ids, mask, positions, segment_ids, targets, loss_mask)


def _check_length(max_length: int) -> None:
  if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 2:
    raise ValueError(f"max_length={max_length!r} is invalid: use an int >= 2.")


def pad_examples(
    examples: Sequence[SFTExample], *, max_length: int, pad_token_id: int = 0
) -> SFTRows:
  """One example per row, right-padded to `max_length` (longer responses are cut)."""
  _check_length(max_length)
  return _rows([[ex] for ex in _truncate(examples, max_length)], max_length, pad_token_id)


def pack_examples(
    examples: Sequence[SFTExample], *, max_length: int, pad_token_id: int = 0
) -> SFTRows:
  """Consecutive examples share a row of `max_length` slots while they fit (greedy, in order).

  Every example keeps its own segment id, positions from 0 and in-example targets, so a model
  run with `segment_ids` computes each example's logits as if it were alone in its row.
  """
  _check_length(max_length)
  groups: list[list[SFTExample]] = []
  used = max_length
  for ex in _truncate(examples, max_length):
    if used + ex.num_tokens > max_length:
      groups.append([])
      used = 0
    groups[-1].append(ex)
    used += ex.num_tokens
  return _rows(groups, max_length, pad_token_id)


__all__ = [
    "SFTExample",
    "SFTRows",
    "chat_prompt_response",
    "encode_record",
    "encode_records",
    "example_from_ids",
    "pack_examples",
    "pad_examples",
]
