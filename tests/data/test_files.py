"""Records from JSONL, Parquet and local `datasets` folders (issue 10 item 4): round trips, field
renaming, one clear error per malformed record (file, line or row, field, fix), and the records
feeding `SFTTrainer`, `RewardModelTrainer` and the prompt loader of `jax_ppo train`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flax import nnx

from jax_ppo.data import (
  iter_records,
  read_preference_records,
  read_prompt_records,
  read_prompts,
  read_records,
  read_sft_examples,
  read_sft_records,
)
from jax_ppo.data.sft import encode_records
from jax_ppo.models.heads import ScalarModel
from jax_ppo.models.transformer import CausalLM
from jax_ppo.reward_model import RewardModelConfig, RewardModelOptimizer, RewardModelTrainer
from jax_ppo.runs import ppo as run_module
from jax_ppo.sft import SFTConfig, SFTOptimizer, SFTTrainer
from tests.ppo.conftest import MODEL

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

FORMATS = ("jsonl", "parquet", "dataset")

SFT = [
    {"prompt": "the film was", "response": " very good"},
    {"prompt": "the plot", "response": " was dull"},
    {"prompt": "the film", "response": " was not bad"},
]
CHATS = [
    {"messages": [{"role": "system", "content": "the film", "name": "very"},
                  {"role": "user", "content": "the film"},
                  {"role": "assistant", "content": "was good"}]},
    {"messages": [{"role": "user", "content": "the plot"},
                  {"role": "assistant", "content": "was very dull"}]},
]
PREFS = [
    {"prompt": "the film was", "chosen": "very good", "rejected": "bad", "margin": 1.5},
    {"prompt": "the plot was", "chosen": "great", "rejected": "dull", "margin": 0.0},
]


def _write(tmp_path, fmt: str, records: list[dict], stem: str = "data"):
  """`records` written as `fmt`; returns the path. Parquet and datasets get one column per field
  of any record (null where a record lacks it: both infer the columns from the first record)."""
  keys = list(dict.fromkeys(k for r in records for k in r))
  if fmt != "jsonl":
    records = [{k: r.get(k) for k in keys} for r in records]
  if fmt == "jsonl":
    path = tmp_path / f"{stem}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
  elif fmt == "parquet":
    path = tmp_path / f"{stem}.parquet"
    pq.write_table(pa.Table.from_pylist(records), path)
  else:
    path = tmp_path / stem
    datasets.Dataset.from_list(records).save_to_disk(str(path))
  return path


def _where(fmt: str, index: int) -> str:
  """How an error names record `index` (0-based): JSONL lines count from 1, rows from 0."""
  return f"line {index + 1}" if fmt == "jsonl" else f"row {index}"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  pytest.importorskip("tokenizers")
  from tests.reward_model.test_reward_trainer import word_tokenizer

  return word_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


# ---- round trips and field names -----------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_round_trips_records(tmp_path, fmt):
  path = _write(tmp_path, fmt, PREFS)
  assert read_records(path) == PREFS
  assert [r.where for r in iter_records(path)] == [f"{str(path)!r}, {_where(fmt, i)}"
                                                   for i in range(2)]
  assert read_preference_records(path) == PREFS
  sft = _write(tmp_path, fmt, SFT, "sft")
  assert read_sft_records(sft) == SFT
  chats = _write(tmp_path, fmt, CHATS, "chats")
  assert read_sft_records(chats) == CHATS
  prompts = _write(tmp_path, fmt, [{"prompt": r["prompt"]} for r in SFT], "prompts")
  assert read_prompt_records(prompts) == [{"prompt": r["prompt"]} for r in SFT]


@pytest.mark.parametrize("fmt", FORMATS)
def test_mixed_text_and_chat_records_with_nulls(tmp_path, fmt):
  """Parquet and datasets store a column per field, null where a record lacks it: a null is an
  absent field (a chat record beside text records; a margin left out means 0)."""
  records = [SFT[0], CHATS[0]]
  assert read_sft_records(_write(tmp_path, fmt, records)) == records
  prefs = [PREFS[0], {k: v for k, v in PREFS[1].items() if k != "margin"}]
  assert [r["margin"] for r in read_preference_records(_write(tmp_path, fmt, prefs, "p"))] == [
      1.5, 0.0]
  chat_prompt = {"prompt": [{"role": "user", "content": "the film"}], "chosen": "good",
                 "rejected": "bad"}
  # A column is chats or strings in Parquet and datasets, not both: a file of chat prompts.
  assert read_preference_records(_write(tmp_path, fmt, [chat_prompt], "c"))[0]["prompt"] == (
      chat_prompt["prompt"])


def _turn(role: str, content: str) -> dict[str, str]:
  return {"role": role, "content": content}


USER = [_turn("system", "the film"), _turn("user", "the plot")]
GOOD, BAD = [_turn("assistant", "was good")], [_turn("assistant", "was dull")]
CONVERSATIONS = {  # one preference in the three conversational forms
    "explicit": {"prompt": USER, "chosen": GOOD, "rejected": BAD, "margin": 0.5},
    "implicit": {"chosen": USER + GOOD, "rejected": USER + BAD, "margin": 0.5},
    # UltraFeedback-binarized: the first user message as a string beside whole conversations.
    "string_prompt": {"prompt": "the plot", "chosen": USER + GOOD, "rejected": USER + BAD,
                      "margin": 0.5},
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("form", sorted(CONVERSATIONS))
def test_conversational_preferences_read_as_explicit_chats(tmp_path, fmt, form):
  """Chat responses with a prompt chat, without a prompt, or beside a prompt string: the same
  record, its prompt the turns before the responses."""
  records = read_preference_records(_write(tmp_path, fmt, [CONVERSATIONS[form]] * 2))
  assert records == [CONVERSATIONS["explicit"]] * 2


@pytest.mark.parametrize(
    "record, message",
    [
        ({"prompt": USER, "chosen": GOOD, "rejected": "was dull"},
         r"\"chosen\" is a chat but \"rejected\" is not; give both responses as chats"),
        ({"prompt": "the plot", "chosen": "was good", "rejected": BAD},
         r"\"rejected\" is a chat but \"chosen\" is not"),
        ({"prompt": USER, "chosen": GOOD, "rejected": [*BAD, _turn("user", "the film")]},
         r"the last message of \"rejected\" has role 'user'; it must be the assistant's response "
         r"that the reward model scores"),
        ({"chosen": USER + GOOD, "rejected": USER[1:] + BAD},
         r"without a \"prompt\" chat, \"chosen\" and \"rejected\" are whole conversations that "
         r"must share every turn but their last, but they differ before their last turns; give "
         r"the turns before the responses as \"prompt\""),
        ({"prompt": "the plot", "chosen": GOOD, "rejected": BAD},
         r"without a \"prompt\" chat \(a \"prompt\" that is not a chat, here 'the plot', is not "
         r"used with chat responses\), .* but they have no turn before the assistant's response"),
        ({"chosen": "was good", "rejected": "was dull"},
         r"expected an object with \"prompt\", \"chosen\" and \"rejected\" fields, got keys "
         r"\['chosen', 'rejected'\]"),
        ({"prompt": USER, "chosen": [], "rejected": BAD},
         r"\"chosen\" \(the chosen response\) is empty; give at least one message"),
    ],
    ids=["mixed", "mixed_rejected", "last_role", "prefix", "no_context", "text_no_prompt",
         "empty_chat"],
)
def test_malformed_conversational_preferences(tmp_path, record, message):
  path = _write(tmp_path, "jsonl", [CONVERSATIONS["explicit"], record])
  with pytest.raises(ValueError, match=message) as e:
    read_preference_records(path)
  assert str(e.value).startswith(f"{str(path)!r}, line 2: ")


@pytest.mark.parametrize("fmt", FORMATS)
def test_conversational_prompts_and_completions(tmp_path, fmt, tok):
  """TRL's conversational prompt-only and prompt-completion records: a chat in the prompt (and
  completion) field reads as a chat, and tokenizes as the trainers' own records do."""
  chat = CHATS[1]["messages"]
  prompts = _write(tmp_path, fmt, [{"prompt": chat[:1]}] * 2, "prompts")
  assert read_prompt_records(prompts) == [{"messages": chat[:1]}] * 2
  assert read_prompts(prompts, tok).prompts == [[14, 16, 4, 11, 15, 16]] * 2  # "user : the plot
  pairs = [{"prompt": chat[:1], "completion": chat[1:]}] * 2                 # assistant :"
  path = _write(tmp_path, fmt, pairs, "pairs")
  assert read_sft_records(path, response_field="completion") == [
      {"prompt": chat[:1], "response": chat[1:]}] * 2
  assert read_sft_examples(path, tok, response_field="completion") == encode_records(
      [{"messages": chat}] * 2, tok)


@pytest.mark.parametrize("fmt", FORMATS)
def test_completion_is_the_response_of_trls_prompt_completion_records(tmp_path, fmt, tok):
  """TRL's `{"prompt", "completion"}` (strings or chats) reads as `{"prompt", "response"}`,
  beside records that use "response" (the other's column null); a record with both is refused
  naming its line or row."""
  path = _write(tmp_path, fmt, [{"prompt": SFT[0]["prompt"], "completion": SFT[0]["response"]},
                                SFT[1]])
  assert read_sft_records(path) == SFT[:2]
  assert read_sft_examples(path, tok) == encode_records(SFT[:2], tok)
  chat = CHATS[1]["messages"]
  chats = _write(tmp_path, fmt, [{"prompt": chat[:1], "completion": chat[1:]}], "chats")
  assert read_sft_records(chats) == [{"prompt": chat[:1], "response": chat[1:]}]
  assert read_sft_examples(chats, tok) == encode_records([{"messages": chat}], tok)
  both = _write(tmp_path, fmt, [SFT[0], {**SFT[1], "completion": " was great"}], "both")
  for read in (read_sft_records, lambda p: read_sft_examples(p, tok)):
    with pytest.raises(ValueError, match=f"{_where(fmt, 1)}: the record has both 'response' "
                                         "and 'completion'"):
      read(both)
  # A field name of the user's own is read alone: "response" is then not the response.
  with pytest.raises(ValueError, match=f"{_where(fmt, 1)}.*\"completion\""):
    read_sft_records(path, response_field="completion")


@pytest.mark.parametrize("record, message", [
    ({"prompt": [{"role": "user", "content": "a"}], "response": "b"},
     r"line 1: \"prompt\" is a chat but \"response\" is not; give both as chats"),
    ({"prompt": "a", "response": [{"role": "assistant", "content": "b"}]},
     r"line 1: \"response\" is a chat but \"prompt\" is not"),
    ({"prompt": [{"role": "user", "content": "a"}], "response": [{"role": "user", "content": "b"}]},
     r"line 1: the last message of \"response\" has role 'user'; it must be the assistant's"),
], ids=["chat_prompt", "chat_response", "last_role"])
def test_malformed_conversational_sft_records(tmp_path, record, message):
  with pytest.raises(ValueError, match=message):
    read_sft_records(_write(tmp_path, "jsonl", [record]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_field_names_are_configurable(tmp_path, fmt):
  renamed = [{"question": r["prompt"], "answer": r["response"], "id": i}
             for i, r in enumerate(SFT)]
  path = _write(tmp_path, fmt, renamed)
  assert read_sft_records(path, prompt_field="question", response_field="answer") == SFT
  assert read_records(path, fields={"prompt": "question"})[0] == {
      "prompt": SFT[0]["prompt"], "answer": SFT[0]["response"], "id": 0}
  prefs = _write(tmp_path, fmt, [{"context": r["prompt"], "good": r["chosen"],
                                  "bad": r["rejected"], "weight": r["margin"]} for r in PREFS],
                 "prefs")
  assert read_preference_records(prefs, prompt_field="context", chosen_field="good",
                                 rejected_field="bad", margin_field="weight") == PREFS
  prompts = _write(tmp_path, fmt, [{"q": "the film"}, {"q": "the plot"}], "prompts")
  assert read_prompt_records(prompts, prompt_field="q") == [{"prompt": "the film"},
                                                           {"prompt": "the plot"}]


def test_txt_prompts_skip_blank_lines(tmp_path):
  path = tmp_path / "p.txt"
  path.write_text("\ufeffthe film\n\n  \nthe plot\n", encoding="utf-8")  # with a BOM
  assert read_prompt_records(path) == [{"prompt": "the film"}, {"prompt": "the plot"}]
  bom = tmp_path / "bom.jsonl"
  bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(SFT[0]).encode() + b"\n")
  assert read_sft_records(bom) == SFT[:1]
  with pytest.raises(ValueError, match=r"unsupported suffix '.txt'"):
    read_records(path)  # a .txt file holds prompts, not records


# ---- prompts through `jax-ppo train`'s loader ----------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_load_prompts_reads_every_format_and_chats(tmp_path, fmt, tok):
  path = _write(tmp_path, fmt, [{"prompt": "the film was"}, {"prompt": "the plot"}])
  data = run_module.load_prompts(path, tok, seed=3)
  assert data.prompts == [tok("the film was")["input_ids"], tok("the plot")["input_ids"]]
  assert data.texts == ["the film was", "the plot"] and data.seed == 3
  chats = _write(tmp_path, fmt, [{"messages": [{"role": "user", "content": "the film"}]}], "c")
  data = read_prompts(chats, tok)
  assert data.prompts == [[14, 16, 4, 5, 15, 16]]  # "user : the film assistant :"
  with pytest.raises(ValueError, match=rf"prompts_path={str(path)!r}, {_where(fmt, 0)}: the "
                                       r"prompt has 3 tokens, more than the 2 that fit"):
    run_module.load_prompts(path, tok, max_tokens=2)


# ---- malformed records: one error each, naming the file, the line or row and the fix ------------


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": "d",}\n',
         r"line 2, column 33: invalid JSON \(Expecting property name enclosed in double "
         r"quotes\); write one JSON object per line"),
        (b'{"prompt": "a", "response": "b"}\n{"prompt": "\xe9", "response": "d"}\n',
         r"line 2: not valid UTF-8 \(byte b'\\xe9' at column 13\); save the file as UTF-8"),
        (b'["a", "b"]\n', r"line 1: expected an object with \"prompt\" and \"response\" or "
                          r"\"completion\" strings \(or chats\) or a \"messages\" list, "
                          r"got '\[\"a\", \"b\"\]'"),
        (b'{"prompt": "a", "respons": "b"}\n',
         r"line 1: expected an object .* got keys \['prompt', 'respons'\]; rename 'respons' to "
         r"\"response\" \(or pass response_field='respons'\)"),
        (b'{"prompt": "a", "output": "b"}\n',
         r"line 1: .* got keys \['prompt', 'output'\]; name the record's field with "
         r"response_field=\.\.\. \('\{\"prompt\""),
        (b'{"prompt": "a", "response": 7}\n', r"line 1: \"response\" must be a string, got 7 "
                                              r"\(int\)"),
        (b'{"prompt": "a", "response": " "}\n', r"line 1: \"response\" \(the response\) is "
                                                r"empty or only whitespace; give some text or "
                                                r"remove the line"),
        (b'{"messages": [{"role": "user", "content": "a"}]}\n',
         r"line 1: the last message of \"messages\" has role 'user'; it must be the assistant's"),
        (b'{"messages": [{"role": "user", "text": "a"}]}\n',
         r"line 1: message 0 of \"messages\" is \{'role': 'user', 'text': 'a'\}; each message is "
         r"\{\"role\": str, \"content\": str\}"),
        (b"\n\n", r"holds no records; give a .jsonl file"),
    ],
    ids=["json", "utf8", "not_object", "typo", "unknown_key", "type", "empty", "last_turn",
         "message", "no_records"],
)
def test_malformed_jsonl_sft_records(tmp_path, content, message):
  path = tmp_path / "sft.jsonl"
  path.write_bytes(content)
  with pytest.raises(ValueError, match=message) as e:
    read_sft_records(path)
  assert str(e.value).startswith(repr(str(path)))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "records, message",
    [
        ([PREFS[0], {"prompt": "a", "chosen": "b", "rejectd": "c"}],
         r"{where1}: expected an object with \"prompt\", \"chosen\" and \"rejected\" fields, got "
         r"keys \['prompt', 'chosen', 'rejectd'\]; rename 'rejectd' to \"rejected\""),
        ([PREFS[0], {**PREFS[1], "chosen": ""}],
         r"{where1}: \"chosen\" \(the chosen response\) is empty or only whitespace; give some "
         r"text or remove the {unit}"),
        ([PREFS[0], {**PREFS[1], "margin": -1.0}],
         r"{where1}: \"margin\" must be a finite number >= 0, got -1.0 \(float\)"),
        ([PREFS[0], {**PREFS[1], "margin": math.nan}],
         r"{where1}: \"margin\" must be a finite number >= 0, got nan"),
        ([{**PREFS[0], "rejected": 3}, {**PREFS[1], "rejected": 4}],
         r"{where0}: \"rejected\" must be a string or a chat, got 3 \(int\)"),
    ],
)
def test_malformed_preference_records_in_every_format(tmp_path, fmt, records, message):
  path = _write(tmp_path, fmt, records)
  unit = "line" if fmt == "jsonl" else "row"
  message = message.format(where0=_where(fmt, 0), where1=_where(fmt, 1), unit=unit)
  with pytest.raises(ValueError, match=message) as e:
    read_preference_records(path)
  assert str(e.value).startswith(f"{str(path)!r}, ")


@pytest.mark.parametrize("fmt", ["parquet", "dataset"])
def test_malformed_rows_name_the_row_and_field(tmp_path, fmt):
  path = _write(tmp_path, fmt, [{"prompt": "the film"}, {"prompt": "  "}])
  with pytest.raises(ValueError, match=rf"^{str(path)!r}, row 1: \"prompt\" \(the prompt\) is "
                                       r"empty or only whitespace; give some text or remove the "
                                       r"row\.$"):
    read_prompt_records(path)
  path = _write(tmp_path, fmt, [{"promt": "the film"}], "typo")
  with pytest.raises(ValueError, match=r"row 0: expected an object with a \"prompt\" string or "
                                       r"chat or a \"messages\" list, got keys \['promt'\]; "
                                       r"rename 'promt' to \"prompt\" \(or pass "
                                       r"prompt_field='promt'\)\.$"):
    read_prompt_records(path)


def test_bad_paths_and_folders(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"'org/reviews': no such file; .* looks like a "
                                              r"Hugging Face Hub id: this reader never downloads"):
    read_records("org/reviews")
  with pytest.raises(ValueError, match=r"'hf://datasets/org/x': not a local path; .* never "
                                       r"downloaded"):
    read_records("hf://datasets/org/x")
  with pytest.raises(ValueError, match=r"'https://x.org/d.jsonl': not a local path"):
    read_records("https://x.org/d.jsonl")
  with pytest.raises(FileNotFoundError, match=r"train.jsonl': no such file; give a .jsonl file"):
    read_records(tmp_path / "train.jsonl")
  with pytest.raises(FileNotFoundError, match=r"'data/train.jsonl': no such file") as e:
    read_records("data/train.jsonl")
  assert "Hub id" not in str(e.value)  # a missing local file, not a Hub id
  (tmp_path / "d.csv").write_text("a\n")
  with pytest.raises(ValueError, match=r"d.csv': unsupported suffix '.csv'; give a .jsonl"):
    read_records(tmp_path / "d.csv")
  (tmp_path / "plain").mkdir()
  with pytest.raises(ValueError, match=r"plain' is a folder but not a Hugging Face datasets "
                                       r"folder \(no state.json"):
    read_records(tmp_path / "plain")
  datasets.DatasetDict({"train": datasets.Dataset.from_list(SFT),
                        "test": datasets.Dataset.from_list(SFT)}).save_to_disk(
                            str(tmp_path / "dd"))
  with pytest.raises(ValueError, match=r"dd' is a DatasetDict with the splits \['test', "
                                       r"'train'\]; give one split's folder \(e.g. '.*dd/test'\)"):
    read_records(tmp_path / "dd")
  assert read_sft_records(tmp_path / "dd" / "train") == SFT
  (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
  with pytest.raises(ValueError, match=r"bad.parquet': not a readable Parquet file \("):
    read_records(tmp_path / "bad.parquet")
  with pytest.raises(ValueError, match=r"^RunConfig.prompts_path='.*plain' is a folder but not"):
    run_module.load_prompts(tmp_path / "plain", None)


# ---- the trainers consume the records ----------------------------------------------------------


def test_sft_examples_are_the_trainers_own_tokenisation(tmp_path, tok):
  path = _write(tmp_path, "parquet", SFT + CHATS)
  assert read_sft_examples(path, tok) == encode_records(SFT + CHATS, tok)
  broken = tmp_path / "broken.jsonl"
  tok_no_chat = type(tok).from_pretrained(tok.name_or_path)
  tok_no_chat.chat_template = None
  broken.write_text(json.dumps(SFT[0]) + "\n" + json.dumps(CHATS[0]) + "\n")
  with pytest.raises(ValueError, match=rf"^{str(broken)!r}, line 2: a `messages` chat needs a "
                                       "tokenizer with a chat template"):
    read_sft_examples(broken, tok_no_chat)


@pytest.mark.slow  # ~25 s on 2 cores: two trainers compile their steps
def test_sft_and_reward_model_trainers_train_on_file_records(tmp_path, tok):
  """A few steps of each trainer on records read from a Parquet file and a datasets folder: the
  records are accepted as they come, and training changes the loss (it runs for real)."""
  sft_path = _write(tmp_path, "parquet", SFT + CHATS)
  sft = SFTTrainer(SFTConfig(max_length=12, batch_size=5, total_steps=3, optimizer=SFTOptimizer(
                                 learning_rate=3e-2, lr_schedule="constant")),
                   CausalLM(MODEL, rngs=nnx.Rngs(0)), train_data=read_sft_records(sft_path),
                   tokenizer=tok)
  assert sft.train_rows.num_rows == 5
  losses = [sft.step()["train/loss"] for _ in range(3)]
  assert all(np.isfinite(losses)) and losses[-1] < losses[0]

  rm_path = _write(tmp_path, "dataset", PREFS * 2, "prefs")
  rm = RewardModelTrainer(RewardModelConfig(batch_size=4, total_steps=3, max_length=8,
                                            optimizer=RewardModelOptimizer(
                                                learning_rate=3e-2, lr_schedule="constant")),
                          ScalarModel(MODEL, rngs=nnx.Rngs(0)),
                          train_data=read_preference_records(rm_path), tokenizer=tok)
  np.testing.assert_array_equal(rm.train_pairs.margin, [1.5, 0.0, 1.5, 0.0])
  assert rm.train_pairs.chosen_ids[0].tolist()[:6] == [4, 5, 6, 12, 7, 2]  # "the film was very
  losses = [rm.step()["train/loss"] for _ in range(3)]  # good </s>"
  assert all(np.isfinite(losses)) and losses[-1] < losses[0]
