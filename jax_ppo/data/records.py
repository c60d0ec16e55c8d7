"""One record, checked: the single path every stage and every reader takes.

A record is a plain mapping (a JSONL line, a Parquet or `datasets` row, or a dict handed to a
trainer) with the place it came from (`Record.where`: `"'train.jsonl', line 12"`,
`"'train.parquet', row 3"`, `"train_data[4]"`). The file readers (`jax_ppo.data.files`) and the
trainers of the SFT, reward-model and DPO stages check every record through the functions here,
so a record is refused (or accepted) alike however it arrives, and every refusal is one
`ValueError` naming the place, the field and the fix:

* `prompt_record`: `{"prompt": str}` or `{"messages": chat}` (a chat in the prompt field too);
* `sft_record`: `{"prompt": str, "response": str}`, the same with two chats (TRL's
  conversational prompt-completion; the response may be TRL's "completion") or
  `{"messages": chat}` ending with the assistant's turn;
* `preference_record`: `{"prompt", "chosen", "rejected"}` with text or chat responses (the
  prompt implicit in whole conversations, `jax_ppo.data.preferences`), token ids where the
  trainer takes them, and an optional margin.

What is refused: a missing field (with the nearest existing key), a wrong type, an empty or
whitespace-only text, message or token list, a chat message that is not `{"role": str,
"content": str}`, a role outside `KNOWN_ROLES`, a chat mixing the role/content and the ShareGPT
from/value forms, a pair whose chosen and rejected responses are the same (it teaches nothing:
its loss gradient is 0), and a margin that is not a finite number >= 0.

ShareGPT chats (`{"from": "human" | "gpt" | "system", "value": str}` messages) are read as
role/content messages (`SHAREGPT_ROLES`), as TRL and most converters map them.

A record that is too long for `max_length` is not an error: the trainers cut it, and
`warn_cut` names the records and how many were cut (the stage runs' summaries count them).
"""

from __future__ import annotations

import difflib
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from jax_ppo.data.preferences import explicit_preference

logger = logging.getLogger("jax_ppo.data")


class Record(NamedTuple):
  """One record and where it came from.

  Attributes:
    where: the file and line (JSONL, .txt, from 1) or row (Parquet, datasets, from 0), or the
      trainer argument and index (`"train_data[4]"`), as error messages name it.
    data: the record, a plain mapping (Parquet/datasets: null columns included as None).
    raw: the JSONL line (shown in errors), None for other forms.
  """

  where: str
  data: Mapping[str, Any]
  raw: str | None = None


KNOWN_ROLES = ("system", "user", "assistant", "tool")
"""The roles a chat message may have (those the chat templates of the supported model families
render)."""
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
"""ShareGPT's `from` values and the roles they are read as."""

RESPONSE_FIELD = "response"
"""The default name of a record's response field."""
COMPLETION_FIELD = "completion"
"""TRL's name of the response in its prompt-completion datasets (`{"prompt", "completion"}`,
strings or chats), read wherever the response field is the default `RESPONSE_FIELD`."""


def response_fields(response_field: str = RESPONSE_FIELD) -> tuple[str, ...]:
  """The record fields that may hold the response: `("response", "completion")` for the default
  field name, else `(response_field,)` alone."""
  if response_field == RESPONSE_FIELD:
    return (RESPONSE_FIELD, COMPLETION_FIELD)
  return (response_field,)


def response_field_of(record: Mapping[str, Any], response_field: str = RESPONSE_FIELD,
                      where: str = "record") -> str:
  """The field of `record` that holds its response: `response_field`, or, where that is the
  default "response" and the record has no "response", TRL's "completion" (a None value counts
  as absent, as a null Parquet column).

  Raises:
    ValueError: naming `where`, for a record with both "response" and "completion" (which one
      is the response is ambiguous).
  """
  fields = response_fields(response_field)
  present = [f for f in fields if record.get(f) is not None]
  if len(present) > 1:
    raise ValueError(
        f"{where}: the record has both {RESPONSE_FIELD!r} and {COMPLETION_FIELD!r}; give the "
        f"response in one of them ({COMPLETION_FIELD!r} as in TRL's prompt-completion datasets, "
        f"or {RESPONSE_FIELD!r}), or name another field with response_field=...")
  return present[0] if present else response_field


# -- fields ---------------------------------------------------------------------------------------


def value(record: Record, field: str) -> Any:
  """The record's `field`; None when absent or null (a Parquet/datasets column) alike."""
  return record.data.get(field)


def missing(record: Record, want: str, field: str, option: str | None,
            known: Sequence[str] = ()) -> ValueError:
  """The error of a record without `field`: its keys, the nearest one (not among `known`, the
  fields already read) and how to rename it (`option`: the setting that names the field)."""
  keys = [str(k) for k, v in record.data.items() if v is not None]
  spare = [k for k in keys if k not in known]
  close = difflib.get_close_matches(field, spare, n=1, cutoff=0.5)
  hint = f"; rename {close[0]!r} to \"{field}\"" if close else ""
  if option and close:
    hint += f" (or pass {option}={close[0]!r})"
  elif option:
    hint = f"; name the record's field with {option}=..."
  raw = f" ({record.raw[:80]!r})" if record.raw is not None else ""
  return ValueError(f"{record.where}: expected {want}, got keys {keys}{hint}{raw}.")


def _remove(record: Record) -> str:
  if record.raw is not None:
    return "remove the line"
  return "remove the row" if ", row " in record.where else "remove the record"


def text(record: Record, field: str, what: str) -> str:
  """The record's `field`, a string with some non-whitespace text (`what` names it in errors,
  e.g. "prompt")."""
  v = value(record, field)
  if not isinstance(v, str):
    raise ValueError(f"{record.where}: \"{field}\" must be a string, got {v!r:.60} "
                     f"({type(v).__name__}).")
  if not v.strip():
    raise ValueError(f"{record.where}: \"{field}\" (the {what}) is empty or only whitespace; "
                     f"give some text or {_remove(record)}.")
  return v


def messages(record: Record, field: str, *, last_role: str | None = None,
             why: str = "SFT trains on") -> list[dict[str, Any]]:
  """The record's `field` as a chat: a non-empty list of `{"role", "content"}` messages (other
  keys, e.g. "name", kept; ShareGPT's from/value messages read as role/content).

  Args:
    last_role: the role the last message must have (None: any).
    why: what the last message is for, in the error (e.g. "SFT trains on").

  Raises:
    ValueError: naming the place, the field and the message: not a list of messages, no
      message, a message that is not a role and a content string, a role outside
      `KNOWN_ROLES`, a chat mixing the role/content and from/value forms, an empty content
      (a system message may be empty), or a last message without `last_role`.
  """
  v = value(record, field)
  if not isinstance(v, Sequence) or isinstance(v, str):
    raise ValueError(f"{record.where}: \"{field}\" must be a list of {{\"role\", \"content\"}} "
                     f"messages, got {v!r:.60} ({type(v).__name__}).")
  if not v:
    raise ValueError(f"{record.where}: \"{field}\" is an empty chat; give at least one message "
                     f"or {_remove(record)}.")
  out, forms = [], set()
  for k, m in enumerate(v):
    if isinstance(m, Mapping) and m.get("role") is None and m.get("from") is not None:
      forms.add("ShareGPT's from/value")
      role = SHAREGPT_ROLES.get(m.get("from"), m.get("from"))
      if not isinstance(m.get("value"), str):
        raise ValueError(f"{record.where}: message {k} of \"{field}\" is {m!r:.60}; a ShareGPT "
                         "message is {\"from\": str, \"value\": str}.")
      m = {"role": role, "content": m["value"],
           **{key: x for key, x in m.items() if key not in ("from", "value")}}
    elif isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(
        m.get("content"), str):
      forms.add("role/content")
    else:
      raise ValueError(f"{record.where}: message {k} of \"{field}\" is {m!r:.60}; each message "
                       "is {\"role\": str, \"content\": str}.")
    if len(forms) > 1:
      raise ValueError(f"{record.where}: \"{field}\" mixes role/content and ShareGPT's "
                       f"from/value messages (message {k}); write every message of a chat in "
                       "one form.")
    if m["role"] not in KNOWN_ROLES:
      shown = f" (ShareGPT's from={m['role']!r})" if "ShareGPT's from/value" in forms else ""
      if not shown and m["role"] in SHAREGPT_ROLES:  # ShareGPT's name in a role/content message
        shown = (f" (ShareGPT's name, read only in from/value messages: here write role "
                 f"{SHAREGPT_ROLES[m['role']]!r})")
      raise ValueError(f"{record.where}: message {k} of \"{field}\" has role {m['role']!r}"
                       f"{shown}; use one of {list(KNOWN_ROLES)} (ShareGPT's "
                       f"{sorted(SHAREGPT_ROLES)} are read as such).")
    if m["role"] != "system" and not m["content"].strip():
      raise ValueError(f"{record.where}: message {k} of \"{field}\" ({m['role']}) is empty or "
                       f"only whitespace; give its text or {_remove(record)}.")
    # Nulls are fields of other messages in a Parquet/datasets column of structs.
    out.append({key: x for key, x in m.items() if x is not None})
  if last_role is not None and out[-1]["role"] != last_role:
    raise ValueError(f"{record.where}: the last message of \"{field}\" has role "
                     f"{out[-1]['role']!r}; it must be the {last_role}'s response that {why}.")
  return out


# -- prompts --------------------------------------------------------------------------------------


def prompt_form(prompt_field: str = "prompt", messages_field: str = "messages") -> str:
  """What a prompt record is, for errors."""
  return (f"an object with a \"{prompt_field}\" string or chat or a \"{messages_field}\" "
          "list")


def prompt_record(record: Record, prompt_field: str = "prompt",
                  messages_field: str = "messages", *, option: bool = True) -> dict[str, Any]:
  """`{"prompt": str}` or `{"messages": chat}` of a prompt record (a record with both is a text
  prompt; a chat in the prompt field is TRL's conversational prompt). `option`: errors suggest
  `prompt_field=`."""
  if value(record, prompt_field) is None and value(record, messages_field) is not None:
    return {"messages": messages(record, messages_field)}
  if isinstance(value(record, prompt_field), list):  # TRL's conversational prompt
    return {"messages": messages(record, prompt_field)}
  if value(record, prompt_field) is not None:
    return {"prompt": text(record, prompt_field, "prompt")}
  raise missing(record, prompt_form(prompt_field, messages_field), prompt_field,
                "prompt_field" if option else None, (messages_field,))


# -- SFT pairs ------------------------------------------------------------------------------------


def sft_form(prompt_field: str = "prompt", response_field: str = RESPONSE_FIELD,
             messages_field: str = "messages") -> str:
  """What an SFT record is, for errors."""
  response = " or ".join(f"\"{f}\"" for f in response_fields(response_field))
  return (f"an object with \"{prompt_field}\" and {response} strings (or chats) or a "
          f"\"{messages_field}\" list")


def sft_record(record: Record, prompt_field: str = "prompt",
               response_field: str = RESPONSE_FIELD,
               messages_field: str = "messages", *, prefix: str = "") -> dict[str, Any]:
  """`{"prompt": str, "response": str}`, `{"prompt": chat, "response": chat}` or `{"messages":
  chat}` of an SFT record (a chat's last message the assistant's; a record with a prompt and
  messages is a prompt-response record; a null field counts as absent, so Parquet files that
  mix text and chat records read as JSONL files do). `prefix`:
  where the field-name settings live, for the missing-field error (e.g. "sft.")."""
  if not isinstance(record.data, Mapping):
    want = sft_form(prompt_field, response_field, messages_field)
    raise ValueError(f"{record.where}: expected {want}, got {type(record.data).__name__}.")
  if value(record, messages_field) is not None and value(record, prompt_field) is None:
    return {"messages": messages(record, messages_field, last_role="assistant")}
  want = sft_form(prompt_field, response_field, messages_field)
  response_field = response_field_of(record.data, response_field, record.where)
  for field, option in ((prompt_field, f"{prefix}prompt_field"),
                        (response_field, f"{prefix}response_field")):
    if value(record, field) is None:
      raise missing(record, want, field, option, (prompt_field, response_field, messages_field))
  chats = [isinstance(value(record, f), list) for f in (prompt_field, response_field)]
  if chats[0] != chats[1]:
    chat, other = (prompt_field, response_field) if chats[0] else (response_field, prompt_field)
    raise ValueError(f"{record.where}: \"{chat}\" is a chat but \"{other}\" is not; give both "
                     "as chats (lists of {\"role\", \"content\"} messages) or both as strings.")
  if chats[0]:  # TRL's conversational prompt and completion
    return {"prompt": messages(record, prompt_field),
            "response": messages(record, response_field, last_role="assistant")}
  return {"prompt": text(record, prompt_field, "prompt"),
          "response": text(record, response_field, "response")}


# -- preference pairs -----------------------------------------------------------------------------


def _token_ids(record: Record, field: str, what: str, ids: Sequence[Any]) -> list[int]:
  if not all(isinstance(t, int) or type(t).__name__.startswith(("int", "uint")) for t in ids):
    raise ValueError(f"{record.where}: \"{field}\" must be a string, a chat or a list of token "
                     f"ids, got {ids!r:.60}.")
  if not len(ids):
    raise ValueError(f"{record.where}: \"{field}\" (the {what}) is an empty list of token ids; "
                     f"give its tokens or {_remove(record)}.")
  return [int(t) for t in ids]


def preference_form(fields: tuple[str, str, str] = ("prompt", "chosen", "rejected")) -> str:
  """What a preference record is, for errors."""
  return f"an object with \"{fields[0]}\", \"{fields[1]}\" and \"{fields[2]}\" fields"


def preference_record(
    record: Record,
    fields: tuple[str, str, str] = ("prompt", "chosen", "rejected"),
    margin_field: str | None = "margin",
    *,
    token_ids: bool = False,
    prefix: str = "",
) -> dict[str, Any]:
  """`{"prompt", "chosen", "rejected", "margin"}` of a preference record, its prompt made
  explicit (`jax_ppo.data.preferences.explicit_preference`).

  Args:
    record: the record.
    fields: its prompt, chosen and rejected field names.
    margin_field: its optional margin field (a finite number >= 0; absent or null: 0); None:
      margins are not read (the returned margin is 0).
    token_ids: a prompt or response may also be a list of token ids (the trainers take them;
      the file readers do not).
    prefix: where the field-name settings live, for the missing-field error (e.g.
      "reward.", "DPOConfig.").

  Raises:
    ValueError: naming the place, the field and the fix: a missing field, a text, chat or token
      list that is empty, a malformed chat, one response a chat and the other not, a pair whose
      chosen and rejected are the same, or a margin out of range.
  """
  p_field, c_field, r_field = fields
  if not isinstance(record.data, Mapping):
    raise ValueError(f"{record.where}: expected {preference_form(fields)}, got "
                     f"{type(record.data).__name__}.")
  chats = isinstance(value(record, c_field), list) and bool(value(record, c_field)) and all(
      isinstance(m, Mapping) for m in value(record, c_field))
  options = (f"{prefix}prompt_field", f"{prefix}chosen_field", f"{prefix}rejected_field")
  for field, option in zip(fields, options, strict=True):
    if value(record, field) is None and not (chats and field == p_field):
      raise missing(record, preference_form(fields), field, option,
                    (*fields, margin_field or ""))

  def read(field: str, what: str, *, last_role: str | None) -> Any:
    v = value(record, field)
    if token_ids and getattr(v, "ndim", None) == 1 and hasattr(v, "tolist"):
      v = v.tolist()  # a NumPy (or JAX) vector of token ids
    if isinstance(v, str):
      return text(record, field, what)
    if isinstance(v, Sequence) and not v:
      give = "at least one message or token id" if token_ids else "at least one message"
      raise ValueError(f"{record.where}: \"{field}\" (the {what}) is empty; give {give} or "
                       f"{_remove(record)}.")
    if isinstance(v, Sequence) and all(isinstance(m, Mapping) for m in v):
      return messages(record, field, last_role=last_role,
                      why="the reward model scores and DPO trains on")
    if token_ids and isinstance(v, Sequence):
      return _token_ids(record, field, what, v)
    kinds = "a string, a chat or a list of token ids" if token_ids else "a string or a chat"
    raise ValueError(f"{record.where}: \"{field}\" must be {kinds}, got {v!r:.60} "
                     f"({type(v).__name__}).")

  good = read(c_field, "chosen response", last_role=None)
  bad = read(r_field, "rejected response", last_role=None)
  prompt = None if value(record, p_field) is None else read(p_field, "prompt", last_role=None)
  prompt, good, bad = explicit_preference(prompt, good, bad, where=record.where, fields=fields)
  # Exactly equal: responses that differ in whitespace alone tokenize apart (sampled pairs do).
  if good == bad:
    raise ValueError(f"{record.where}: \"{c_field}\" and \"{r_field}\" are the same response, "
                     f"so the pair teaches nothing (its loss gradient is 0); give two different "
                     f"responses or {_remove(record)}.")
  margin = 0.0
  if margin_field is not None and value(record, margin_field) is not None:
    margin = value(record, margin_field)
    if (not isinstance(margin, int | float) or isinstance(margin, bool)
        or not math.isfinite(margin) or margin < 0):
      raise ValueError(f"{record.where}: \"{margin_field}\" must be a finite number >= 0, got "
                       f"{margin!r:.60} ({type(margin).__name__}); leave it out for 0.")
  return {"prompt": prompt, "chosen": good, "rejected": bad, "margin": float(margin)}


# -- records cut to fit ---------------------------------------------------------------------------


def warn_cut(places: Sequence[str], total: int, *, max_length: int, what: str,
             how: str) -> int:
  """Logs one warning for the records longer than `max_length` that were cut to fit, naming
  (up to five of) them and how many there were; returns that count.

  Args:
    places: where each cut record came from (`Record.where`).
    total: how many records there were.
    what: what the records are (e.g. "SFT examples of train_data").
    how: what was cut (e.g. "their responses were cut and lose their EOS").
  """
  if places:
    shown = "; ".join(places[:5]) + ("; ..." if len(places) > 5 else "")
    logger.warning("%d of %d %s are longer than max_length=%d; %s (raise max_length to keep "
                   "them whole). Cut: %s", len(places), total, what, max_length, how, shown)
  return len(places)


__all__ = [
    "COMPLETION_FIELD",
    "KNOWN_ROLES",
    "RESPONSE_FIELD",
    "Record",
    "SHAREGPT_ROLES",
    "messages",
    "missing",
    "preference_form",
    "preference_record",
    "prompt_form",
    "prompt_record",
    "response_field_of",
    "response_fields",
    "sft_form",
    "sft_record",
    "text",
    "value",
    "warn_cut",
]
