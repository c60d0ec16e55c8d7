"""Degenerate records through the stage runs (`jax-ppo sft`, `reward`, `dpo`), as a user writes
them: each is one error whose first line names the config field, the file, the line (or row)
and the record's field, through the command line and the Python API, before any weights load,
and the model and data folders hash the same afterwards. A Parquet file that mixes text and
chat records trains as its JSONL twin does; records cut to `max_length` are named in one warning
and counted in the run's summary.
"""

import json
import logging
import pathlib
import shutil

import pytest

pytest.importorskip("torch", reason="torch builds the tiny Hugging Face models")
transformers = pytest.importorskip("transformers")

from jax_ppo.cli import main  # noqa: E402
from jax_ppo.runs import dpo, reward, sft  # noqa: E402
from tests.tiny_hf_run import make_checkpoint, tree_hashes  # noqa: E402


def turn(role, content):
  return {"role": role, "content": content}


CHAT = [turn("user", "the film was"), turn("assistant", "good fun")]
TEXT = {"prompt": "the film was", "response": " good fun"}
PAIR = {"prompt": "the film was", "chosen": " good fun", "rejected": " dull"}

# (stage, the file's records, the bad line, the first line's end after "..., line N: ")
CASES = [
    ("sft", [TEXT, {"messages": [turn("user", "hi"), turn("bot", "good")]}], 2,
     "message 1 of \"messages\" has role 'bot'; use one of ['system', 'user', 'assistant', "
     "'tool']"),
    ("sft", [TEXT, {"messages": [{"from": "human", "value": "hi"}, turn("assistant", "x")]}], 2,
     "\"messages\" mixes role/content and ShareGPT's from/value messages (message 1)"),
    ("sft", [TEXT, TEXT, {"messages": [turn("user", "hi"), turn("assistant", " ")]}], 3,
     "message 1 of \"messages\" (assistant) is empty or only whitespace; give its text or "
     "remove the line."),
    ("sft", [{**TEXT, "response": "\t"}], 1,
     "\"response\" (the response) is empty or only whitespace; give some text or remove the "
     "line."),
    ("sft", [TEXT, {"prompt": "the film was", "output": " good"}], 2,
     "expected an object with \"prompt\" and \"response\" or \"completion\" strings (or chats) "
     "or a \"messages\" list, got keys ['prompt', 'output']; name the record's field with "
     "sft.response_field=..."),
    ("reward", [PAIR, {**PAIR, "rejected": " good fun"}], 2,
     "\"chosen\" and \"rejected\" are the same response, so the pair teaches nothing (its loss "
     "gradient is 0); give two different responses or remove the line."),
    ("reward", [PAIR, {**PAIR, "margin": -1}], 2,
     "\"margin\" must be a finite number >= 0, got -1 (int); leave it out for 0."),
    ("reward", [PAIR, {"prompt": "a", "chosen": [turn("assistant", "x")], "rejected": " y"}], 2,
     "\"chosen\" is a chat but \"rejected\" is not"),
    ("dpo", [PAIR, {**PAIR, "chosen": " dull"}], 2,
     "\"chosen\" and \"rejected\" are the same response"),
    ("dpo", [PAIR, {"chosen": [turn("user", "hi"), turn("gpt", "x")],
                    "rejected": [turn("user", "hi"), turn("assistant", "y")]}], 2,
     "message 1 of \"chosen\" has role 'gpt' (ShareGPT's name, read only in from/value messages: "
     "here write role 'assistant'); use one of"),
    ("dpo", [{**PAIR, "prompt": ""}], 1, "\"prompt\" (the prompt) is empty or only whitespace"),
]
CONFIG = {"sft": "SFTRunConfig", "reward": "RewardRunConfig", "dpo": "DPORunConfig"}
BLOCK = {"sft": ["sft.batch_size=2"], "reward": ["reward.batch_size=2"],
         "dpo": ["dpo.batch_size=2", "dpo.max_length=16"]}
COMMON = ["dtype=float32", "run.progress=false", "run.tensorboard=false"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  return make_checkpoint(tmp_path_factory.mktemp("records_model"), "llama")


def _jsonl(path: pathlib.Path, records) -> str:
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path)


def _run(stage, argv):
  if stage == "sft":
    return sft.run_sft(sft.load_sft_config(argv))
  if stage == "reward":
    return reward.run_reward(reward.load_reward_config(argv))
  return dpo.run_dpo(dpo.load_dpo_config(argv))


@pytest.mark.parametrize("stage, records, line, message", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_degenerate_records_are_one_error_naming_file_line_and_field(
    stage, records, line, message, model, tmp_path, capsys, no_weights):
  data = _jsonl(tmp_path / "data.jsonl", records)
  run_dir = tmp_path / "run"
  argv = [f"model_path={model}", f"train_path={data}", f"run_dir={run_dir}", *BLOCK[stage],
          *COMMON]
  first = f"{CONFIG[stage]}.train_path={data!r}, line {line}: {message}"
  before = tree_hashes(model, tmp_path)
  assert main([stage, *argv]) == 2
  out, err = capsys.readouterr()
  assert out == "" and err.count("\n") == 1, err
  assert err.startswith(f"jax-ppo {stage}: error: {first}"), err
  with pytest.raises(ValueError) as error:
    _run(stage, argv)
  assert str(error.value).splitlines()[0].startswith(first)
  assert tree_hashes(model, tmp_path) == before and not run_dir.exists()


def test_a_parquet_file_mixing_text_and_chat_records_trains_as_its_jsonl_twin(model, tmp_path):
  pa = pytest.importorskip("pyarrow")
  pq = pytest.importorskip("pyarrow.parquet")
  records = [TEXT, {"messages": CHAT}, TEXT, {"messages": CHAT}]
  # Every row has every column: nulls where a record lacks the field.
  table = pa.table({k: [r.get(k) for r in records] for k in ("prompt", "response", "messages")})
  assert table.column("messages").null_count == 2
  pq.write_table(table, tmp_path / "mixed.parquet")
  chat_model = tmp_path / "chat_model"
  shutil.copytree(model, chat_model)
  tok = transformers.AutoTokenizer.from_pretrained(chat_model)
  tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
  tok.save_pretrained(chat_model)
  rows = []
  for path in (str(tmp_path / "mixed.parquet"), _jsonl(tmp_path / "mixed.jsonl", records)):
    config = sft.load_sft_config([f"model_path={chat_model}", f"train_path={path}",
                                  f"run_dir={tmp_path / pathlib.Path(path).stem}{len(rows)}",
                                  "sft.batch_size=2", "sft.max_length=32", *COMMON])
    trainer = sft.build_sft_trainer(config)
    rows.append(trainer.train_rows)
  assert rows[0].num_rows == rows[1].num_rows == 4
  for a, b in zip(rows[0], rows[1], strict=True):
    assert (a == b).all()


@pytest.mark.slow
def test_records_cut_to_max_length_are_named_and_counted_in_the_summary(
    model, tmp_path, capsys, caplog):
  long = {"prompt": "the film was", "response": " good fun and great and liked it"}
  data = _jsonl(tmp_path / "data.jsonl", [TEXT, long, TEXT, long, long])
  argv = ["sft", f"model_path={model}", f"train_path={data}", f"run_dir={tmp_path / 'run'}",
          "sft.batch_size=2", "sft.max_length=8", "sft.total_steps=1", *COMMON]
  with caplog.at_level(logging.WARNING, logger="jax_ppo.data"):
    assert main(argv) == 0
  summary = json.loads([x for x in capsys.readouterr().out.splitlines() if x.startswith("{")][-1])
  assert summary["cut_records"] == 3
  (warning,) = [m for m in (r.getMessage() for r in caplog.records)
                if "longer than max_length" in m]
  assert warning.startswith("3 of 5 SFT examples are longer than max_length=8; their responses "
                            "were cut (and lose their EOS)")
  assert warning.endswith(f"Cut: SFTRunConfig.train_path={data!r}, line 2; "
                          f"SFTRunConfig.train_path={data!r}, line 4; "
                          f"SFTRunConfig.train_path={data!r}, line 5")
