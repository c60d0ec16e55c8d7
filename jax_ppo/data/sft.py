"""Supervised fine-tuning examples: tokenising (prompt, response) records, padding and packing.

An `SFTExample` is a prompt and a response as token ids; the model is trained on the response
only (the prompt tokens are context, never targets). Records become examples through the
tokenizer:

* a `messages` record (a list of `{"role", "content"}` turns ending with the assistant's) goes
  through `tokenizer.apply_chat_template`: the prompt is the template of the turns before the
  first trained assistant turn with the generation prompt (`add_generation_prompt=True`), the
  response is the rest of the template of the whole conversation. Every assistant turn is
  trained (`assistant_turns="all"`, the user turns between them are context, masked out of the
  loss by `SFTExample.response_mask`), or only the last (`"last"`; see `chat_segments`). A
  record whose prompt and response are both chats (TRL's conversational prompt-completion) is
  the conversation of the two, with only the response's turns trained;
* a plain record has a prompt string and a response string (the response field is `response`,
  or `completion` as in TRL's prompt-completion datasets: see `response_field_of`); the prompt
  is tokenised with the
  tokenizer's special tokens (BOS), the response without. The two are tokenised separately (as
  at generation time, where the response continues the tokenised prompt), so a response should
  carry the leading space that BPE vocabularies expect after a word (`" Great product."`).

EOS is appended to every response (to the last assistant turn of a chat, unless it already holds
one, as chat templates that close the assistant turn with the EOS token do), so that the model
learns to stop.

Rows (`SFTRows`, host NumPy arrays `[N, L]`) are right-padded to `L = max_length`. Without
packing a row holds one example; with packing (`pack_examples`) consecutive examples share a row
as long as they fit, each with its own segment id (1, 2, ...; 0 on padding), positions restarting
at 0, and targets that never cross from one example into the next.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from jax_ppo.data.records import Record, response_field_of, sft_record, warn_cut


class SFTExample(NamedTuple):
  """One training example.

  Attributes:
    prompt_ids: token ids of the prompt (context only, never a target).
    response_ids: token ids of the response (the targets), EOS included.
    response_mask: None when every response token is a target; else one flag per response
      token, False on the context inside it (the user turns between the assistant turns of a
      multi-turn chat).
  """

  prompt_ids: tuple[int, ...]
  response_ids: tuple[int, ...]
  response_mask: tuple[bool, ...] | None = None

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


ASSISTANT_TURNS = ("all", "last")
"""Which assistant turns of a chat SFT trains on: every one, or the last (the earlier ones are
then context)."""


def _template(tokenizer: Any, messages: list, *, prompt: bool) -> str:
  return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)


def _turn_end(tokenizer: Any, messages: list, i: int, full: str) -> int | None:
  """Where turn `i` ends in `full` (the template of the whole conversation), or None.

  The end of the template of the turns through `i`, when that is a prefix of `full`; else (a
  template that renders the last turn differently, e.g. Qwen3's empty reasoning block) the start
  of turn `i + 1`: the template through it, less the template of that turn alone, when the
  first is a prefix of `full` and ends with the second."""
  if i == len(messages) - 1:
    return len(full)
  through = _template(tokenizer, messages[: i + 1], prompt=False)
  if full.startswith(through):
    return len(through)
  upto = _template(tokenizer, messages[: i + 2], prompt=False)
  alone = _template(tokenizer, messages[i + 1: i + 2], prompt=False)
  if full.startswith(upto) and upto.endswith(alone):
    return len(upto) - len(alone)
  return None


def chat_segments(
    messages: Any, tokenizer: Any, where: str, *, field: str = "messages",
    assistant_turns: str = "last", first_turn: int = 0,
) -> list[tuple[list[int], bool]]:
  """The token ids of a conversation that ends with the assistant's turn, as consecutive
  segments `(ids, trained)`: context, then a trained assistant turn, then context, ...

  A trained turn is the chat template's text from the end of the template of the turns before it
  with the generation prompt to the end of the turn (`_turn_end`): the assistant's text and the
  template's end-of-turn marker, which the policy learns to write. With
  `assistant_turns="last"` only the last turn is trained, and everything before it is one
  context segment; with "all", every assistant turn from index `first_turn` on (the turns before
  it, e.g. a conversational prompt's, are context). Each segment is tokenized on its own
  (without special tokens: the template text holds BOS and the role markers), as a response
  continues its tokenized prompt at generation time.

  Raises:
    ValueError: naming `where` and `field`, for a conversation that is not a non-empty list of
      `{role, content}` turns ending with the assistant's, a tokenizer without a chat template,
      or a template whose renderings of the leading turns are not prefixes of the whole
      conversation's (then the turns cannot be separated).
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
  if assistant_turns not in ASSISTANT_TURNS:
    raise ValueError(f"assistant_turns={assistant_turns!r} is invalid: use one of "
                     f"{ASSISTANT_TURNS}.")
  if getattr(tokenizer, "chat_template", None) is None:
    raise ValueError(
        f"{where}: a `{field}` chat needs a tokenizer with a chat template; set "
        "tokenizer.chat_template (or load_tokenizer(chat_template=...)) or give text fields."
    )
  full = _template(tokenizer, messages, prompt=False)
  turns = [len(messages) - 1] if assistant_turns == "last" else [
      i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first_turn]
  bounds = []  # character spans of the trained turns in `full`
  for i in turns:
    head = _template(tokenizer, messages[:i], prompt=True)
    end = _turn_end(tokenizer, messages, i, full)
    if end is None or not full.startswith(head) or end < len(head) or (
        bounds and len(head) < bounds[-1][1]):
      raise ValueError(
          f"{where}: the chat template of the whole conversation does not start with the "
          f"template of the turns before assistant turn {i} (with add_generation_prompt=True) "
          "and through it, so the turn cannot be separated from its context; use a template "
          "that renders the turns in order"
          + (", or train on the last turn only (assistant_turns=\"last\")."
             if assistant_turns == "all" and i != len(messages) - 1 else ".")
      )
    bounds.append((len(head), end))
  segments, start = [], 0
  for lo, hi in bounds:
    if lo > start or not segments:
      segments.append((_ids(tokenizer, full[start:lo], special=False), False))
    segments.append((_ids(tokenizer, full[lo:hi], special=False), True))
    start = hi
  return segments


def chat_prompt_response(
    messages: Any, tokenizer: Any, where: str, *, field: str = "messages"
) -> tuple[list[int], list[int]]:
  """Token ids `(prompt, response)` of a conversation that ends with the assistant's turn: the
  chat template of every turn but the last with the generation prompt, and the rest of the
  template of the whole conversation (the response the policy learns to write, and the reward
  model scores). See `chat_segments` (with `assistant_turns="last"`) for the errors."""
  (prompt, _), (response, _) = chat_segments(messages, tokenizer, where, field=field)
  return prompt, response


def encode_record(
    record: Mapping[str, Any],
    tokenizer: Any,
    *,
    prompt_field: str = "prompt",
    response_field: str = "response",
    messages_field: str = "messages",
    add_eos: bool = True,
    assistant_turns: str = "all",
    where: str = "record",
) -> SFTExample:
  """One record -> an `SFTExample` (see the module docstring for the two record kinds).

  Args:
    record: a mapping with `messages_field`, or with `prompt_field` and `response_field`, both
      strings or both chats (a conversational prompt and completion, as TRL's: the completion
      ends with the assistant's turn, and only its turns are trained). With the default
      `response_field="response"`, a record may give its response as "completion" instead
      (TRL's prompt-completion datasets), never as both (`response_field_of`).
    tokenizer: a transformers tokenizer (with a chat template for `messages` records).
    prompt_field, response_field, messages_field: the record's field names.
    add_eos: append `tokenizer.eos_token_id` to the response (the last assistant turn of a chat)
      unless it already holds it.
    assistant_turns: "all": every assistant turn of a chat is a target (the user turns between
      them are context, `SFTExample.response_mask`); "last": only the last one.
    where: how errors name the record (e.g. "'train.jsonl', line 12").

  Raises:
    ValueError: naming `where`: a record `jax_ppo.data.records.sft_record` refuses (a missing or
      empty field, a malformed chat), a chat the template cannot split (`chat_segments`), or a
      response that tokenizes to nothing.
  """
  data = sft_record(Record(where, record), prompt_field, response_field, messages_field)
  if "messages" in data or isinstance(data["prompt"], list):
    if "messages" in data:
      messages, first, field = data["messages"], 0, messages_field
    else:  # a conversational prompt and completion: only the completion's turns are trained
      messages = [*data["prompt"], *data["response"]]
      first, field = len(data["prompt"]), response_field_of(record, response_field, where)
    segments = chat_segments(messages, tokenizer, where, field=field,
                             assistant_turns=assistant_turns, first_turn=first)
    segments[-1] = (_with_eos(segments[-1][0], tokenizer.eos_token_id, add_eos), True)
    if not segments[-1][0]:
      raise ValueError(f"{where}: the response is empty, so the example has nothing to learn.")
    response = [t for ids, _ in segments[1:] for t in ids]
    mask = tuple(trained for ids, trained in segments[1:] for _ in ids)
    return SFTExample(tuple(segments[0][0]), tuple(response), None if all(mask) else mask)
  prompt = _ids(tokenizer, data["prompt"], special=True)
  response = _ids(tokenizer, data["response"], special=False)
  response = _with_eos(response, tokenizer.eos_token_id, add_eos)
  if not response:
    raise ValueError(f"{where}: the response is empty, so the example has nothing to learn.")
  return SFTExample(tuple(prompt), tuple(response))


def encode_records(
    records: Iterable[Mapping[str, Any]], tokenizer: Any, *, source: str = "records",
    places: Sequence[str] | None = None, **kwargs
) -> list[SFTExample]:
  """`encode_record` over `records`; errors name `source` and the record's index, or its
  `places[i]` (e.g. "'train.jsonl', line 3") when given."""
  return [encode_record(r, tokenizer, where=f"{source}[{i}]" if places is None else places[i],
                        **kwargs) for i, r in enumerate(records)]


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


def _truncate(examples: Sequence[SFTExample], max_length: int,
              places: Sequence[str] | None) -> list[SFTExample]:
  """Cuts the response of examples longer than `max_length` (the prompt stays whole); one
  warning names the cut examples (`places[i]`, else "Example i") and counts them."""
  out, cut = [], []
  for i, ex in enumerate(examples):
    where = f"Example {i}" if places is None else places[i]
    if ex.response_mask is not None and (len(ex.response_mask) != len(ex.response_ids)
                                         or not any(ex.response_mask)):
      raise ValueError(
          f"{where} has a response_mask of {len(ex.response_mask)} flags "
          f"({sum(map(bool, ex.response_mask))} True) for {len(ex.response_ids)} response "
          "tokens; give one flag per response token, at least one True (or None: all trained).")
    if len(ex.prompt_ids) >= max_length:
      raise ValueError(
          f"{where} has a prompt of {len(ex.prompt_ids)} tokens, which leaves no room for a "
          f"response in max_length={max_length}; raise max_length or shorten the prompt."
      )
    if ex.num_tokens > max_length:
      keep = max_length - len(ex.prompt_ids)
      ex = SFTExample(ex.prompt_ids, ex.response_ids[:keep],
                      None if ex.response_mask is None else ex.response_mask[:keep])
      cut.append(where)
    out.append(ex)
  warn_cut(cut, len(examples), max_length=max_length, what="SFT examples",
           how="their responses were cut (and lose their EOS)")
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
      # Slot j predicts token j + 1 of the same example; the response's tokens carry the loss
      # (those of its mask), the first token none (no prompt: no BOS either).
      targets[r, offset : offset + m - 1] = ids[1:]
      trained = np.zeros(m, bool)
      trained[p:] = True if ex.response_mask is None else ex.response_mask
      loss_mask[r, offset : offset + m - 1] = trained[1:]
      offset += m
  return SFTRows(input_ids, mask, positions, segment_ids, targets, loss_mask)


def _check_length(max_length: int) -> None:
  if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 2:
    raise ValueError(f"max_length={max_length!r} is invalid: use an int >= 2.")


def pad_examples(
    examples: Sequence[SFTExample], *, max_length: int, pad_token_id: int = 0,
    places: Sequence[str] | None = None,
) -> SFTRows:
  """One example per row, right-padded to `max_length` (longer responses are cut; errors and
  the warning name an example by `places[i]`, e.g. "'train.jsonl', line 3", when given)."""
  _check_length(max_length)
  return _rows([[ex] for ex in _truncate(examples, max_length, places)], max_length,
               pad_token_id)


def pack_examples(
    examples: Sequence[SFTExample], *, max_length: int, pad_token_id: int = 0,
    places: Sequence[str] | None = None,
) -> SFTRows:
  """Consecutive examples share a row of `max_length` slots while they fit (greedy, in order).

  Every example keeps its own segment id, positions from 0 and in-example targets, so a model
  run with `segment_ids` computes each example's logits as if it were alone in its row. Longer
  responses are cut, as by `pad_examples`.
  """
  _check_length(max_length)
  groups: list[list[SFTExample]] = []
  used = max_length
  for ex in _truncate(examples, max_length, places):
    if used + ex.num_tokens > max_length:
      groups.append([])
      used = 0
    groups[-1].append(ex)
    used += ex.num_tokens
  return _rows(groups, max_length, pad_token_id)


__all__ = [
    "ASSISTANT_TURNS",
    "SFTExample",
    "SFTRows",
    "chat_prompt_response",
    "chat_segments",
    "encode_record",
    "encode_records",
    "example_from_ids",
    "pack_examples",
    "pad_examples",
]
