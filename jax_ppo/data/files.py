"""Records from data files: JSONL, Parquet, or a local Hugging Face `datasets` folder.

One reader (`iter_records` / `read_records`) turns a file into plain dicts, each with the place it
came from (`"'train.jsonl', line 12"`, `"'train.parquet', row 3"`, rows counted from 0 as
`datasets` and pandas count them). Three typed front-ends check every record and return what the
trainers consume, with the trainers' default field names:

* prompts (`read_prompts`): `{"prompt": str}` or `{"messages": [{role, content}, ...]}` (or a
  chat in the prompt field, TRL's conversational prompt), also a `.txt` file of one prompt per
  line; tokenized into a `jax_ppo.data.PromptDataset` (a chat is rendered by the tokenizer's
  chat template with the generation prompt);
* SFT pairs (`read_sft_records`, `read_sft_examples`): `{"prompt": str, "response": str}`, the
  same with two chats (TRL's conversational prompt-completion) or `{"messages": [...]}` ending
  with the assistant's turn: records for `jax_ppo.sft.SFTTrainer`, or `SFTExample`s
  tokenized by `jax_ppo.data.sft.encode_record`;
* preference triples (`read_preference_records`): `{"prompt": str | messages, "chosen": str,
  "rejected": str, "margin": float}` (margin optional, 0 when absent or null), or conversational
  ones with `messages` responses, with or without the prompt (`jax_ppo.data.preferences`), for
  `jax_ppo.reward_model.RewardModelTrainer`.

Field names are configurable (`prompt_field="question"` reads the file's `question` column and
returns it as `prompt`). Every malformed record is one `ValueError` naming the file, the line or
row, the field and the fix: invalid JSON, bytes that are not UTF-8, and what
`jax_ppo.data.records` refuses in every record, read here or handed to a trainer (a missing
field with the nearest existing key, a wrong type, an empty text, a malformed chat or role, an
identical pair, a margin out of range). A held-out split is the trainers' own `eval_fraction`
(seeded), so none is made here.

Nothing is ever downloaded: a path that does not exist locally (a Hub id such as `org/name`, a
URL) is refused. Parquet needs `pyarrow`, dataset folders `datasets` (`pip install
'jax_ppo[data]'`); both are imported only when such a file is read.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from jax_ppo.data.prompts import PromptDataset
from jax_ppo.data.records import (
    Record,
    preference_form,
    preference_record,
    prompt_form,
    prompt_record,
    sft_form,
    sft_record,
)
from jax_ppo.data.sft import SFTExample, encode_record

RECORD_SUFFIXES = (".jsonl", ".parquet")
"""File suffixes of record files (besides `datasets` folders)."""
RECORD_FORMATS = ("a .jsonl file (one JSON object per line), a .parquet file or a local Hugging "
                  "Face datasets folder (written by Dataset.save_to_disk)")
PROMPT_SUFFIXES = (".txt", *RECORD_SUFFIXES)
PROMPT_FORMATS = ('a .txt file (one prompt per line), or a .jsonl file, a .parquet file or a '
                  'local Hugging Face datasets folder (save_to_disk) with a "prompt" string or '
                  'a "messages" list per record')
_INSTALL = "pip install 'jax_ppo[data]'"


# -- paths ----------------------------------------------------------------------------------------


def _label(path: str | os.PathLike, name: str | None) -> str:
  return f"{name}={str(path)!r}" if name else repr(str(path))


def check_data_path(
    path: str | os.PathLike,
    *,
    name: str | None = None,
    suffixes: Sequence[str] = RECORD_SUFFIXES,
    formats: str = RECORD_FORMATS,
) -> pathlib.Path:
  """The data source as a local path: an existing file with one of `suffixes`, or a folder.

  Args:
    path: the file or `datasets` folder.
    name: how errors name the path (a config field or CLI flag; None: the path alone).
    suffixes: accepted file suffixes.
    formats: what errors ask for instead.

  Raises:
    FileNotFoundError: nothing at `path` (a Hub id or URL is named as such: never downloaded).
    ValueError: an unsupported suffix.
  """
  text = str(path)
  where = _label(path, name)
  if "://" in text or text.startswith("hf:"):
    raise ValueError(f"{where}: not a local path; data is only read from local files, never "
                     f"downloaded. Give {formats}.")
  p = pathlib.Path(path)
  if p.is_dir():
    return p
  if not p.is_file():
    hub = re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", text) and p.suffix.lower() not in (
        *suffixes, ".json", ".csv")
    hint = (" It looks like a Hugging Face Hub id: this reader never downloads; save the dataset "
            "locally first (datasets.load_dataset(...).save_to_disk(DIR)) and give DIR." if hub
            else "")
    raise FileNotFoundError(f"{where}: no such file; give {formats}.{hint}")
  if p.suffix.lower() not in suffixes:
    raise ValueError(f"{where}: unsupported suffix {p.suffix!r}; give {formats}.")
  return p


# -- the reader -----------------------------------------------------------------------------------


def _jsonl(path: pathlib.Path, where: str, text_field: str | None,
           expected: str) -> Iterator[Record]:
  txt = path.suffix.lower() == ".txt"
  content = path.read_bytes()
  if content.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark (Windows editors)
    content = content[3:]
  for number, raw in enumerate(content.splitlines(), start=1):
    here = f"{where}, line {number}"
    try:
      line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise ValueError(
          f"{here}: not valid UTF-8 (byte {raw[e.start:e.start + 1]!r} at column {e.start + 1}); "
          "save the file as UTF-8."
      ) from None
    if not line.strip():
      continue
    if txt:
      yield Record(here, {text_field: line}, line)
      continue
    try:
      data = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{here}, column {e.colno}: invalid JSON ({e.msg}); write one JSON object "
                       "per line.") from None
    if not isinstance(data, dict):
      raise ValueError(f"{here}: expected {expected}, got {line[:80]!r}; write one object per "
                       "line.")
    yield Record(here, data, line)


def _parquet(path: pathlib.Path, where: str) -> Iterator[Record]:
  try:
    import pyarrow.parquet as pq
  except ImportError:
    raise ImportError(f"{where}: reading Parquet needs pyarrow; {_INSTALL}.") from None
  try:
    batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
    row = 0
    for batch in batches:
      for data in batch.to_pylist():
        yield Record(f"{where}, row {row}", data)
        row += 1
  except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid / ArrowIOError
    raise ValueError(f"{where}: not a readable Parquet file ({type(e).__name__}: "
                     f"{str(e)[:200]}); write it with pyarrow.parquet.write_table or "
                     "pandas.DataFrame.to_parquet.") from None


def _dataset(path: pathlib.Path, where: str) -> Iterator[Record]:
  if (path / "dataset_dict.json").is_file():
    splits = sorted(p.name for p in path.iterdir() if p.is_dir())
    raise ValueError(f"{where} is a DatasetDict with the splits {splits}; give one split's "
                     f"folder (e.g. {str(path / splits[0]) if splits else 'DIR/train'!r}).")
  if not (path / "state.json").is_file() or not (path / "dataset_info.json").is_file():
    raise ValueError(f"{where} is a folder but not a Hugging Face datasets folder (no state.json "
                     f"and dataset_info.json, as Dataset.save_to_disk writes); give "
                     f"{RECORD_FORMATS}.")
  try:
    import datasets
  except ImportError:
    raise ImportError(f"{where}: reading a datasets folder needs `datasets`; {_INSTALL}.") from None
  try:
    ds = datasets.load_from_disk(str(path))
  except Exception as e:  # noqa: BLE001 (datasets raises many kinds; one clear error)
    raise ValueError(f"{where}: datasets.load_from_disk failed ({type(e).__name__}: "
                     f"{str(e)[:200]}); write the folder with Dataset.save_to_disk.") from None
  for row, data in enumerate(ds):
    yield Record(f"{where}, row {row}", dict(data))


def iter_records(
    path: str | os.PathLike,
    *,
    name: str | None = None,
    text_field: str | None = None,
    expected: str = "a JSON object",
) -> Iterator[Record]:
  """The records of a JSONL or Parquet file or a local `datasets` folder, in order.

  Blank JSONL lines are skipped. With `text_field`, a `.txt` file is accepted too: each non-blank
  line is the record `{text_field: line}`.

  Args:
    path: the file or folder (local; see `check_data_path`).
    name: how errors name the path (e.g. "RunConfig.prompts_path").
    text_field: the field of a `.txt` line (None: `.txt` files are refused).
    expected: what errors say a JSONL line should be (e.g. 'an object with a "prompt" string').

  Raises:
    FileNotFoundError / ValueError: the path (see `check_data_path`), bytes that are not UTF-8,
      invalid JSON, a line that is not a JSON object, an unreadable Parquet file or folder; each
      names the file and line.
  """
  txt = (".txt",) if text_field is not None else ()
  formats = PROMPT_FORMATS if txt else RECORD_FORMATS
  p = check_data_path(path, name=name, suffixes=(*txt, *RECORD_SUFFIXES), formats=formats)
  where = _label(path, name)
  if p.is_dir():
    return _dataset(p, where)
  if p.suffix.lower() == ".parquet":
    return _parquet(p, where)
  return _jsonl(p, where, text_field, expected)


def read_records(
    path: str | os.PathLike,
    *,
    name: str | None = None,
    fields: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
  """Every record of `path` as a plain dict (see `iter_records`).

  Args:
    fields: `{name returned: name in the file}`; each record's file field is renamed (fields of
      the file that a record lacks stay absent; other fields are kept as they are).
  """
  out = []
  for record in iter_records(path, name=name):
    data = dict(record.data)
    for new, old in (fields or {}).items():
      if old != new and old in data:
        data[new] = data.pop(old)
    out.append(data)
  return out


# -- prompts --------------------------------------------------------------------------------------


def read_prompt_records(
    path: str | os.PathLike,
    *,
    name: str | None = None,
    prompt_field: str = "prompt",
    messages_field: str = "messages",
) -> list[dict[str, Any]]:
  """Prompt records `{"prompt": str}` or `{"messages": [...]}` of a .txt (one prompt per line),
  JSONL or Parquet file or a `datasets` folder; a record with both is a text prompt.

  Raises:
    ValueError: naming the file, line or row, field and fix (see the module docstring), or a
      file without prompts.
  """
  out = [prompt_record(r, prompt_field, messages_field)
         for r in iter_records(path, name=name, text_field=prompt_field,
                               expected=prompt_form(prompt_field, messages_field))]
  if not out:
    raise ValueError(f"{_label(path, name)} holds no prompts; give {PROMPT_FORMATS}.")
  return out


def read_prompts(
    path: str | os.PathLike,
    tokenizer: Any,
    *,
    name: str | None = None,
    prompt_field: str = "prompt",
    messages_field: str = "messages",
    seed: int = 0,
    max_tokens: int | None = None,
    max_tokens_note: str = "",
    too_long_fix: str = "shorten it",
    configurable_fields: bool = True,
    lazy: bool = False,
) -> PromptDataset:
  """A tokenized `PromptDataset` of a prompts file or folder (see `read_prompt_records`).

  A text prompt is tokenized with the tokenizer's special tokens; a chat is rendered by the
  chat template with the generation prompt (`jax_ppo.models.encode_chat`) and its text (for
  logging) is the decoded template.

  Args:
    path: the file or folder.
    tokenizer: the policy's tokenizer.
    name: how errors name the path (a config field or CLI flag).
    prompt_field, messages_field: the file's field names.
    seed: shuffling seed of the dataset.
    max_tokens: the longest prompt allowed (None: not checked).
    max_tokens_note, too_long_fix: what the too-long error adds after "the N that fit" (e.g.
      " (the policy's context minus ppo.sampling.max_new_tokens)") and the fix it gives.
    configurable_fields: errors suggest `prompt_field=` (False where the caller cannot set it).
    lazy: read and check every record now but tokenize each prompt when a batch first needs it
      (`PromptDataset.lazy`; a process of a multi-host run then tokenizes only its own rows);
      the errors of a prompt that tokenizes to nothing or too much come then, naming its line.

  Raises:
    ValueError: a malformed record (file, line/row, field, fix), a prompt that tokenizes to no
      token or to more than `max_tokens`, or no prompts.
  """
  from jax_ppo.models.tokenizer import encode_chat  # data stays importable without models

  def encode(where: str, prompt: dict[str, Any]) -> tuple[list[int], str]:
    if "messages" in prompt:
      row = [int(t) for t in encode_chat(tokenizer, [prompt["messages"]])[0]]
      text = tokenizer.decode(row)
    else:
      text = prompt["prompt"]
      row = [int(t) for t in tokenizer(text)["input_ids"]]
    if not row:
      raise ValueError(f"{where}: the prompt tokenizes to no tokens; give text the "
                       "policy's tokenizer can encode.")
    if max_tokens is not None and len(row) > max_tokens:
      raise ValueError(f"{where}: the prompt has {len(row)} tokens, more than the "
                       f"{max_tokens} that fit{max_tokens_note}; {too_long_fix}.")
    return row, text

  records, ids, texts = [], [], []
  for record in iter_records(path, name=name, text_field=prompt_field,
                             expected=prompt_form(prompt_field, messages_field)):
    prompt = prompt_record(record, prompt_field, messages_field,
                           option=configurable_fields)
    if lazy:
      records.append((record.where, prompt))
    else:  # (checked in file order: the first bad line is the one reported)
      row, text = encode(record.where, prompt)
      ids.append(row)
      texts.append(text)
  if not (records or ids):
    raise ValueError(f"{_label(path, name)} holds no prompts; give {PROMPT_FORMATS}.")
  if lazy:
    return PromptDataset.lazy(len(records), lambda i: encode(*records[i]), seed=seed)
  return PromptDataset(ids, texts=texts, seed=seed)


# -- SFT pairs ------------------------------------------------------------------------------------


def read_sft_records(
    path: str | os.PathLike,
    *,
    name: str | None = None,
    prompt_field: str = "prompt",
    response_field: str = "response",
    messages_field: str = "messages",
) -> list[dict[str, Any]]:
  """SFT records `{"prompt": str, "response": str}` or `{"messages": [...]}` (the last turn the
  assistant's), as `SFTTrainer(train_data=...)` takes them with its default field names. With
  the default `response_field`, a file's response may be "completion" (TRL's prompt-completion
  datasets; `jax_ppo.data.sft.response_field_of`), read as "response".

  Raises:
    ValueError: naming the file, line or row, field and fix, or a file without records.
  """
  out = [sft_record(r, prompt_field, response_field, messages_field)
         for r in iter_records(path, name=name,
                               expected=sft_form(prompt_field, response_field, messages_field))]
  if not out:
    raise ValueError(f"{_label(path, name)} holds no records; give {RECORD_FORMATS}.")
  return out


def read_sft_examples(
    path: str | os.PathLike,
    tokenizer: Any,
    *,
    name: str | None = None,
    prompt_field: str = "prompt",
    response_field: str = "response",
    messages_field: str = "messages",
    add_eos: bool = True,
    assistant_turns: str = "all",
) -> list[SFTExample]:
  """`SFTExample`s of the file's SFT records, tokenized by `jax_ppo.data.sft.encode_record` (so
  tokenizer errors, e.g. a chat template that cannot be split, also name the file and line;
  `add_eos` and `assistant_turns` as there)."""
  out = []
  want = sft_form(prompt_field, response_field, messages_field)
  for record in iter_records(path, name=name, expected=want):
    data = sft_record(record, prompt_field, response_field, messages_field)
    out.append(encode_record(data, tokenizer, add_eos=add_eos, assistant_turns=assistant_turns,
                             where=record.where))
  if not out:
    raise ValueError(f"{_label(path, name)} holds no records; give {RECORD_FORMATS}.")
  return out


# -- preference triples ---------------------------------------------------------------------------


def read_preference_records(
    path: str | os.PathLike,
    *,
    name: str | None = None,
    prompt_field: str = "prompt",
    chosen_field: str = "chosen",
    rejected_field: str = "rejected",
    margin_field: str = "margin",
) -> list[dict[str, Any]]:
  """Preference records `{"prompt", "chosen", "rejected", "margin"}` as
  `RewardModelTrainer(train_data=...)` takes them with its default field names.

  A record is text or conversational (`jax_ppo.data.preferences`): chosen and rejected are
  strings after a prompt string or chat, or chats ending with the assistant's turn, after a
  prompt chat or, without one, holding the whole conversations (their shared turns become the
  returned prompt, their last turns the responses). The margin is a finite number >= 0, 0 when
  absent or null.

  Raises:
    ValueError: naming the file, line or row, field and fix, or a file without records.
  """
  fields = (prompt_field, chosen_field, rejected_field)
  out = [preference_record(r, fields, margin_field)
         for r in iter_records(path, name=name, expected=preference_form(fields))]
  if not out:
    raise ValueError(f"{_label(path, name)} holds no records; give {RECORD_FORMATS}.")
  return out


__all__ = [
    "PROMPT_FORMATS",
    "PROMPT_SUFFIXES",
    "RECORD_FORMATS",
    "RECORD_SUFFIXES",
    "check_data_path",
    "iter_records",
    "read_preference_records",
    "read_prompt_records",
    "read_prompts",
    "read_records",
    "read_sft_examples",
    "read_sft_records",
]
