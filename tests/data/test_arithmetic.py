"""The arithmetic task's problems and files (`jax_ppo.data.arithmetic`): the same seed gives the
same problems, the train and held-out splits never share one, a prompt states its problem so it
parses back, and the written files read back through the runs' own readers."""

from __future__ import annotations

import json

import pytest

from jax_ppo.data import arithmetic
from jax_ppo.data.arithmetic import ArithmeticConfig, Problem, generate, parse_problem
from jax_ppo.data.files import read_prompt_records, read_prompts, read_sft_records


def byte_tokenizer():
  """A GPT-2-style byte-level BPE tokenizer without merges (one token a byte), with PAD (0) and
  EOS (1): it decodes every text back exactly, as the policy's tokenizer does."""
  tokenizers = pytest.importorskip("tokenizers")
  transformers = pytest.importorskip("transformers")
  specials = ["<pad>", "<|endoftext|>"]
  alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
  vocab = {t: i for i, t in enumerate([*specials, *alphabet])}
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                              eos_token="<|endoftext|>")


def test_the_same_seed_gives_the_same_problems_and_a_longer_list_extends_a_shorter():
  config = ArithmeticConfig(digits=3, operations=("+", "*"))
  first = generate(300, split="train", seed=7, config=config)
  assert first == generate(300, split="train", seed=7, config=config)
  assert generate(100, split="train", seed=7, config=config) == first[:100]
  assert first != generate(300, split="train", seed=8, config=config)
  assert len(set(first)) == 300
  assert all(0 <= p.a < 1000 and 0 <= p.b < 1000 and p.op in "+*" for p in first)
  # Pinned: the stream is a hash of "seed/k", the same on every machine and Python version.
  assert generate(3, split="train", seed=0) == [Problem(44, "*", 91), Problem(43, "*", 51),
                                                Problem(73, "+", 45)]


@pytest.mark.parametrize("digits", [1, 2])
def test_train_and_held_out_problems_never_meet_whatever_the_seeds(digits):
  config = ArithmeticConfig(digits=digits)
  n_eval = 25 if digits == 1 else 200
  train = {p for seed in (0, 1) for p in generate(100, split="train", seed=seed, config=config)}
  held_out = {p for seed in (0, 1)
              for p in generate(n_eval, split="eval", seed=seed, config=config)}
  assert train and held_out and not train & held_out
  assert {p.split for p in train} == {"train"} and {p.split for p in held_out} == {"eval"}
  # About one problem in ten is held out.
  every = [Problem(a, op, b) for a in range(10) for b in range(10) for op in "+-*"]
  share = sum(p.split == "eval" for p in every) / len(every)
  assert 0.05 < share < 0.15


def test_a_split_too_small_for_the_count_is_an_error():
  config = ArithmeticConfig(digits=1)
  with pytest.raises(ValueError, match=r"Asked for 40 eval problems, but only \d+ distinct.*"
                                       r"raise digits"):
    generate(40, split="eval", seed=0, config=config)
  with pytest.raises(ValueError, match=r"split='test' is invalid"):
    generate(1, split="test")
  with pytest.raises(ValueError, match=r"count=-1 of train problems is invalid"):
    generate(-1, split="train")


@pytest.mark.parametrize("kwargs, message", [
    (dict(digits=0), r"digits=0 is invalid: give an integer from 1 to 9"),
    (dict(digits=10), r"digits=10 is invalid"),
    (dict(digits=True), r"digits=True is invalid"),
    (dict(operations=()), r"operations=\(\) is invalid"),
    (dict(operations=("/",)), r"operations=\('/',\) is invalid"),
    (dict(operations=("+", "+")), r"without repeats"),
    (dict(operations="+-"), r"operations='\+-' is invalid"),
])
def test_bad_configs_are_named(kwargs, message):
  with pytest.raises(ValueError, match=message):
    ArithmeticConfig(**kwargs)


def test_a_problem_has_a_prompt_an_answer_and_a_worked_answer():
  assert Problem(37, "+", 48).prompt == "Q: What is 37 + 48?\nA:"
  assert [Problem(3, op, 12).answer for op in "+-*"] == [15, -9, 36]
  assert Problem(3, "-", 12).worked_answer == " 3 - 12 = -9. Answer: -9"


def test_the_problem_parses_back_from_its_prompt_however_it_is_wrapped():
  for p in generate(50, split="train", seed=3):
    assert parse_problem(p.prompt) == p
    assert parse_problem(f"<s>{p.prompt}") == p
    chat = f"<|im_start|>user\nSolve.\n{p.prompt.lower()}<|im_end|>\n<|im_start|>assistant\n"
    assert parse_problem(chat) == p
  assert parse_problem("What is 1 + 2? Now: what is  12*3 ?") == Problem(12, "*", 3)
  assert parse_problem("Tell me a story.") is None


def test_the_files_read_back_through_the_runs_readers(tmp_path):
  paths = arithmetic.write_task(tmp_path / "task", seed=5, train=40, eval=10)
  assert sorted(p.name for p in paths.values()) == sorted(arithmetic.FILES.values())
  tok = byte_tokenizer()
  problems = {}
  for split, n in (("train", 40), ("eval", 10)):
    dataset = read_prompts(paths[split], tok)
    assert len(dataset) == n
    assert dataset.texts == [p.prompt for p in generate(n, split=split, seed=5)]
    problems[split] = {parse_problem(t) for t in dataset.texts}
    assert all(tok.decode(ids) == text for ids, text in zip(dataset.prompts, dataset.texts,
                                                             strict=True))
    records = read_prompt_records(paths[split])
    assert all(set(r) == {"prompt"} for r in records)  # the reader keeps the prompt only
    raw = [json.loads(line) for line in paths[split].read_text().splitlines()]
    assert [r["answer"] for r in raw] == [parse_problem(r["prompt"]).answer for r in raw]
    sft = read_sft_records(paths[f"sft_{split}"])
    assert [r["prompt"] for r in sft] == dataset.texts
    assert [r["response"] for r in sft] == [parse_problem(t).worked_answer
                                            for t in dataset.texts]
  assert len(problems["train"]) == 40 and not problems["train"] & problems["eval"]


def test_the_command_line_writes_the_files_and_names_a_bad_argument(tmp_path, capsys):
  out = tmp_path / "task"
  assert arithmetic.main(["--out", str(out), "--seed", "2", "--train", "30", "--eval", "5",
                          "--digits", "1", "--operations", "+-"]) == 0
  assert str(out / "train.jsonl") in capsys.readouterr().out
  rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
  expected = generate(30, split="train", seed=2, config=ArithmeticConfig(digits=1,
                                                                         operations=("+", "-")))
  assert [r["prompt"] for r in rows] == [p.prompt for p in expected]
  with pytest.raises(SystemExit) as e:
    arithmetic.main(["--out", str(out), "--operations", "+/"])
  assert e.value.code == 2 and "ArithmeticConfig.operations=('+', '/')" in capsys.readouterr().err
