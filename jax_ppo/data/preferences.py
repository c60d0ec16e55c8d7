"""The two forms of a preference record, and the implicit prompt of a conversational one.

A preference record holds a prompt and two responses to it, chosen and rejected:

* **text**: chosen and rejected are strings (or token ids); the prompt is a string, token ids or
  a chat (a list of `{"role", "content"}` messages, rendered with the generation prompt);
* **conversational**: chosen and rejected are chats that end with the assistant's turn (the
  format of TRL's conversational preference data sets, e.g. UltraFeedback-binarized). The prompt
  is either given as a chat of the turns before them (explicit), or not (implicit): then chosen
  and rejected are whole conversations that share every turn but their last, and those shared
  turns are the prompt (the form of Anthropic-HH as messages). A prompt that is not a chat
  (UltraFeedback-binarized keeps the first user message as a string beside its conversations) is
  not used then, as TRL does not use it.

`explicit_preference` checks a record's form and returns it with an explicit prompt, so that the
readers and the reward-model trainer treat both conversational forms alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def is_chat(value: Any) -> bool:
  """True for a non-empty list of mappings (messages), False for text, token ids and the rest."""
  return (isinstance(value, Sequence) and not isinstance(value, str) and bool(value)
          and all(isinstance(m, Mapping) for m in value))


def explicit_preference(
    prompt: Any,
    chosen: Any,
    rejected: Any,
    *,
    where: str,
    fields: tuple[str, str, str] = ("prompt", "chosen", "rejected"),
) -> tuple[Any, Any, Any]:
  """`(prompt, chosen, rejected)` of one preference record, with its prompt made explicit.

  A text record and a conversational record with a chat prompt come back as they are. A
  conversational record without one (`prompt` None, or text) comes back as `(shared turns,
  [last chosen turn], [last rejected turn])`.

  Args:
    prompt: the record's prompt, None when the record has none (one that is not a chat is
      not used beside chat responses).
    chosen, rejected: the responses (strings, token ids or chats).
    where: how errors name the record (e.g. "'prefs.jsonl', line 3").
    fields: the record's names of the prompt, chosen and rejected fields, for the errors.

  Raises:
    ValueError: naming `where`, the field and the fix, when one response is a chat and the other
      is not, a chat does not end with the assistant's turn, or the two conversations of an
      implicit-prompt record differ before their last turns (or have no turn before them); or
      when a text record has no prompt.
  """
  p_field, c_field, r_field = fields
  chats = is_chat(chosen), is_chat(rejected)
  if chats[0] != chats[1]:
    chat_field, other = (c_field, r_field) if chats[0] else (r_field, c_field)
    raise ValueError(f"{where}: \"{chat_field}\" is a chat but \"{other}\" is not; give both "
                     "responses as chats (lists of {\"role\", \"content\"} messages) or both "
                     "as text.")
  if not chats[0]:
    if prompt is None:
      raise ValueError(f"{where}: no \"{p_field}\"; a record with text responses needs the "
                       f"prompt they answer (or give \"{c_field}\" and \"{r_field}\" as whole "
                       "conversations).")
    return prompt, chosen, rejected
  for field, chat in ((c_field, chosen), (r_field, rejected)):
    role = chat[-1].get("role")
    if role != "assistant":
      raise ValueError(f"{where}: the last message of \"{field}\" has role {role!r}; it must be "
                       "the assistant's response that the reward model scores.")
  if is_chat(prompt):
    return list(prompt), list(chosen), list(rejected)
  shared = list(chosen[:-1])
  if not shared or shared != list(rejected[:-1]):
    what = ("have no turn before the assistant's response" if not shared else
            "differ before their last turns")
    given = ("" if prompt is None else
             f" (a \"{p_field}\" that is not a chat, here {prompt!r:.40}, is not used with chat "
             "responses)")
    raise ValueError(f"{where}: without a \"{p_field}\" chat{given}, \"{c_field}\" and "
                     f"\"{r_field}\" are whole conversations that must share every turn but their "
                     f"last, but they {what}; give the turns before the responses as "
                     f"\"{p_field}\" (a list of {{\"role\", \"content\"}} messages), or "
                     "whole conversations as the responses.")
  return shared, list(chosen[-1:]), list(rejected[-1:])


__all__ = ["explicit_preference", "is_chat"]
