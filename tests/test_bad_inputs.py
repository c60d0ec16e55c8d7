"""Bad inputs, each one clear error (issue 13 item 6): prompts files, configs, model folders and
run folders, as a new user would get them wrong, through `jax_ppo.runs.ppo` and the `jax-ppo`
command line (one line `jax-ppo CMD: error: ...` on stderr, exit status 2, no traceback, nothing
written). Also the policy and the reward model with different tokenizers, end to end: the reward
model must score its own tokenizer's ids of the decoded text.

Tiny random GPT-2 models and word-level tokenizers are built locally (no downloads).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch", reason="torch builds the tiny Hugging Face models")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from jax_ppo.cli import main  # noqa: E402
from jax_ppo.models import load_tokenizer  # noqa: E402
from jax_ppo.ppo import PPOConfig, PPOOptimizer, PPOSampling  # noqa: E402
from jax_ppo.runs import ppo as run  # noqa: E402
from jax_ppo.runs import ppo_config as run_config  # noqa: E402

WORDS = ("the a movie film plot actor story was is very really not quite good great fun bad "
         "dull boring long short and but I liked hated it").split()
PROMPTS = ["the movie was", "I liked the plot and", "the actor is", "it was really"]
N_POSITIONS, MAX_NEW = 32, 4

pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")


def _tokenizer(words):
  vocab = {w: i for i, w in enumerate(["<pad>", "<|endoftext|>", "<unk>", *words])}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<pad>", unk_token="<unk>"
  )


def _gpt2_config(tok):
  return transformers.GPT2Config(
      vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2, n_positions=N_POSITIONS,
      bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
  )


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """A policy (tokenizer A), a reward model with its own tokenizer B (the same words in reverse
  order, so every id differs), prompts and a config using the built-in `length` reward."""
  root = tmp_path_factory.mktemp("bad_inputs")
  torch.manual_seed(0)
  tok_a = _tokenizer(WORDS)
  transformers.GPT2LMHeadModel(_gpt2_config(tok_a)).save_pretrained(root / "policy")
  tok_a.save_pretrained(root / "policy")
  tok_b = _tokenizer(WORDS[::-1])
  config_b = _gpt2_config(tok_b)
  config_b.num_labels = 1
  reward = transformers.GPT2ForSequenceClassification(config_b)
  with torch.no_grad():
    reward.score.weight.normal_(0.0, 1.0)
  reward.save_pretrained(root / "reward")
  tok_b.save_pretrained(root / "reward")
  (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
  cfg = {
      "policy_path": str(root / "policy"), "reward_function": "length",
      "prompts_path": str(root / "prompts.txt"), "run_dir": str(root / "run"),
      "run": {"save_every": 1, "log_samples_every": 1, "progress": False, "tensorboard": False},
      "ppo": {"batch_size": 4, "num_minibatches": 1, "ppo_epochs": 1,
              "sampling": {"max_new_tokens": MAX_NEW, "temperature": 1.0},
              "total_updates": 2, "optimizer": {"learning_rate": 1e-3}},
  }
  (root / "run.yaml").write_text(yaml.safe_dump(cfg))
  return root


def _train_fails(files, tmp_path, capsys, *args) -> str:
  """Runs `jax-ppo train` expecting a bad-input error; returns the one stderr line."""
  run_dir = tmp_path / "run"
  status = main(["train", str(files / "run.yaml"), f"run_dir={run_dir}", *args])
  captured = capsys.readouterr()
  assert status == 2, captured
  err = captured.err
  assert err.startswith("jax-ppo train: error: ") and err.count("\n") == 1, err
  assert "Traceback" not in err
  assert not run_dir.exists()  # failed before writing anything
  return err


# ---- prompts files -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.txt", b"", r"empty.txt' holds no prompts; give a .txt file"),
        ("blank.jsonl", b"\n  \n", r"blank.jsonl' holds no prompts"),
        ("empty_prompt.jsonl", b'{"prompt": "the movie"}\n{"prompt": "  "}\n',
         r"empty_prompt.jsonl', line 2: \"prompt\" \(the prompt\) is empty or only whitespace; "
         r"give some text or remove the line"),
        ("empty_messages.jsonl", b'{"prompt": "a"}\n\n{"messages": []}\n',
         r"line 3: \"messages\" is an empty chat"),
        ("utf8.txt", b"the movie\nthe \xff film\n", r"utf8.txt', line 2: not valid UTF-8 "
                                                     r"\(byte b'\\xff' at column 5\); save the "
                                                     r"file as UTF-8"),
        ("bad.jsonl", b'{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c",}\n',
         r"bad.jsonl', line 3, column 16: invalid JSON \(Expecting property name enclosed in "
         r"double quotes\); write one JSON object per line"),
        ("field.jsonl", b'{"prompt": "a"}\n{"promt": "b"}\n',
         r"line 2: expected an object with a \"prompt\" string or chat or a \"messages\" list, got "
         r"keys \['promt'\]; rename 'promt' to \"prompt\""),
        ("text.jsonl", b'{"text": "b"}\n', r"line 1: .* got keys \['text'\] \("),
        ("list.jsonl", b'["the movie"]\n', r"line 1: expected an object with a \"prompt\""),
        ("num.jsonl", b'{"prompt": 123}\n', r"line 1: \"prompt\" must be a string, got 123 "
                                            r"\(int\)"),
        ("chat.jsonl", b'{"messages": "hi"}\n', r"line 1: \"messages\" must be a list of "
                                                r"\{\"role\", \"content\"\} messages, got 'hi'"),
        ("long.txt", b"the movie\nthe movie was very very very long\n",
         r"long.txt', line 2: the prompt has 7 tokens, more than the 6 that fit \(the policy's "
         r"context minus ppo.sampling.max_new_tokens\); shorten it or lower "
         r"ppo.sampling.max_new_tokens"),
        ("unknown.txt", "\u00e9t\u00e9\n".encode(), None),  # one <unk> token: a valid prompt
    ],
)
def test_prompt_file_errors_name_the_file_and_line(files, tmp_path, name, content, message):
  tok = load_tokenizer(str(files / "policy"))
  path = tmp_path / name
  path.write_bytes(content)
  if message is None:
    assert run.load_prompts(path, tok, max_tokens=6).prompts == [[tok.unk_token_id]]
    return
  with pytest.raises(ValueError, match=message):
    run.load_prompts(path, tok, max_tokens=6)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "prompts.txt' holds no prompts"),
        (b"the movie\n\xfe\n", "prompts.txt', line 2: not valid UTF-8"),
        # The context is 32 positions, 4 of them for the response: 29 tokens do not fit.
        (b"the movie\n" + b"very " * 29 + b"\n",
         "prompts.txt', line 2: the prompt has 29 tokens, more than the 28 that fit"),
    ],
)
def test_prompt_file_errors_through_the_cli(files, tmp_path, capsys, content, message):
  (tmp_path / "prompts.txt").write_bytes(content)
  err = _train_fails(files, tmp_path, capsys, f"prompts_path={tmp_path / 'prompts.txt'}")
  assert f"RunConfig.prompts_path='{tmp_path / 'prompts.txt'}" in err
  assert message in err


def test_too_many_new_tokens_for_the_context(files, tmp_path, capsys):
  err = _train_fails(files, tmp_path, capsys, f"ppo.sampling.max_new_tokens={N_POSITIONS}")
  assert f"PPOConfig.sampling.max_new_tokens={N_POSITIONS} leaves no room for a prompt in the " \
         f"policy's context of {N_POSITIONS} tokens; lower ppo.sampling.max_new_tokens." in err


# ---- configs -------------------------------------------------------------------------------------


def test_unknown_config_key_in_a_file_suggests_the_nearest(files, tmp_path, capsys):
  data = yaml.safe_load((files / "run.yaml").read_text())
  data["reward_modle_path"] = data.pop("reward_function")
  (tmp_path / "typo.yaml").write_text(yaml.safe_dump(data))
  assert main(["train", str(tmp_path / "typo.yaml")]) == 2
  err = capsys.readouterr().err
  assert f"error: Config file '{tmp_path / 'typo.yaml'}': Unknown config key " \
         "'reward_modle_path' for RunConfig. Did you mean 'reward_model_path'?" in err
  data["ppo"]["clip_epsilon"] = 0.1
  del data["reward_modle_path"]
  (tmp_path / "typo.yaml").write_text(yaml.safe_dump(data))
  assert main(["train", str(tmp_path / "typo.yaml")]) == 2
  assert f"Config file '{tmp_path / 'typo.yaml'}': Unknown config key 'ppo.clip_epsilon' for " \
         "PPOConfig. Did you mean 'clip_eps'?" in capsys.readouterr().err
  # On the command line the override is named instead.
  assert main(["train", str(files / "run.yaml"), "ppo.clip_epsilon=0.1"]) == 2
  assert "Unknown config key 'ppo.clip_epsilon' for PPOConfig. Did you mean 'clip_eps'?" in (
      capsys.readouterr().err)


def test_yaml_and_json_syntax_errors_give_file_line_and_column(files, tmp_path, capsys):
  bad = tmp_path / "bad.yaml"
  bad.write_text("run_dir: x\nppo:\n  kl_coef: 1e-3\n   batch_size: 4\n")
  assert main(["train", str(bad)]) == 2
  err = capsys.readouterr().err
  assert err == (f"jax-ppo train: error: Config file '{bad}', line 4, column 14: invalid YAML "
                 "(mapping values are not allowed here).\n")
  bad.write_text("ppo: {kl_coef: 1e-3\n")
  assert main(["train", str(bad)]) == 2
  assert f"Config file '{bad}', line 2, column 1: invalid YAML (while parsing a flow mapping " \
         "expected ',' or '}'" in capsys.readouterr().err
  bad_json = tmp_path / "bad.json"
  bad_json.write_text('{"run_dir": "x",\n "ppo": }\n')
  assert main(["train", str(bad_json)]) == 2
  assert capsys.readouterr().err == (f"jax-ppo train: error: Config file '{bad_json}', line 2, "
                                     "column 9: invalid JSON (Expecting value).\n")
  bad.write_bytes(b"run_dir: caf\xe9\n")
  assert main(["train", str(bad)]) == 2
  assert f"Config file '{bad}', line 1, column 13: not valid UTF-8" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, message",
    [
        ("ppo.optimizer.learning_rate=-1e-3",
         "PPOOptimizer.learning_rate=-0.001 is invalid: use a value > 0 (1e-6 to 3e-6 for full "
         "PPO fine-tuning)"),
        ("ppo.clip_eps=0", "PPOConfig.clip_eps=0.0 is invalid: use a value > 0 (e.g. 0.2)"),
        ("ppo.clip_eps=-0.2", "PPOConfig.clip_eps=-0.2 is invalid"),
        ("ppo.num_minibatches=3",
         "PPOConfig.batch_size=4 is invalid: it must be divisible by num_minibatches (3)"),
        ("ppo.sampling.stop_token_ids=[-1]", "PPOConfig.sampling.stop_token_ids=(-1,) is invalid"),
        ("ppo.sampling.stop_token_ids=[1,300]", "RunConfig.ppo.sampling.stop_token_ids=(1, 300): "
                                               "id(s) [300] are outside the policy's vocabulary "
                                               "of 30 tokens"),
        ("ppo.sampling.temperature=0", "PPOConfig.sampling.temperature=0.0 is invalid: use a "
                                       "value > 0"),
        ("ppo.batch_size=four", "Config key 'ppo.batch_size' (PPOConfig.batch_size) in override "
                                "'ppo.batch_size=four': Couldn't parse 'four' into an int; "
                                "expected int."),
    ],
)
def test_invalid_values(files, tmp_path, capsys, override, message):
  assert message in _train_fails(files, tmp_path, capsys, override)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(sampling={"temperature": 1.0}), r"PPOConfig.sampling=\{'temperature': 1.0\} is "
                                              r"invalid: pass a PPOSampling"),
        (dict(target_kl="x"), r"PPOConfig.target_kl='x' is invalid: use a number or None"),
        (dict(clip_eps=True), r"PPOConfig.clip_eps=True is invalid: use a number"),
        (dict(optimizer={"learning_rate": 1e-6}), r"PPOConfig.optimizer=\{'learning_rate': "
                                                  r"1e-06\} is invalid: pass a PPOOptimizer"),
        (dict(total_updates=1, num_minibatches=1, ppo_epochs=1,
              optimizer=PPOOptimizer(warmup_steps=2)),
         r"PPOConfig.optimizer=.* is invalid: its warmup_steps \(2\) exceeds the run's 1 "),
        (dict(reward_shift=float("inf")), r"PPOConfig.reward_shift=inf is invalid: use a finite"),
        (dict(clip_eps=0.0), r"PPOConfig.clip_eps=0.0 is invalid"),
        (dict(batch_size=8, num_minibatches=3), r"PPOConfig.batch_size=8 is invalid: it must be "
                                                r"divisible by num_minibatches \(3\)"),
    ],
)
def test_ppo_config_refuses_bad_values_at_construction(kwargs, message):
  with pytest.raises(ValueError, match=message):
    PPOConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(pad_token_id=None), r"PPOConfig.sampling.pad_token_id=None is invalid: use the "
                                  r"tokenizer's pad id, an int >= 0"),
        (dict(pad_token_id=-1), r"PPOConfig.sampling.pad_token_id=-1 is invalid"),
        (dict(pad_token_id=True), r"PPOConfig.sampling.pad_token_id=True is invalid"),
        (dict(stop_token_ids=(2, None)), r"PPOConfig.sampling.stop_token_ids=\(2, None\) is "
                                         r"invalid: use a tuple of token ids, ints >= 0"),
        (dict(stop_token_ids=(0,), pad_token_id=0), r"PPOConfig.sampling.pad_token_id=0 is "
                                                    r"invalid: PAD must differ from every stop"),
        (dict(temperature="hot"), r"PPOConfig.sampling.temperature='hot' is invalid: use a "
                                  r"value > 0\."),
        (dict(temperature=0.0), r"PPOConfig.sampling.temperature=0.0 is invalid"),
        (dict(top_p=1.5), r"PPOConfig.sampling.top_p=1.5 is invalid: use a value in \(0, 1\]"),
        (dict(top_k=-1), r"PPOConfig.sampling.top_k=-1 is invalid: use an int >= 0"),
        (dict(max_new_tokens=True), r"PPOConfig.sampling.max_new_tokens=True is invalid: use an "
                                    r"int >= 1"),
    ],
)
def test_ppo_sampling_refuses_bad_values_at_construction(kwargs, message):
  """The sampling block's errors name the field by its place in the run
  (`PPOConfig.sampling.<field>`)."""
  with pytest.raises(ValueError, match=message):
    PPOSampling(**kwargs)
  normalised = PPOSampling(pad_token_id=np.int64(3), stop_token_ids=[np.int32(2)])
  assert normalised.pad_token_id == 3 and normalised.stop_token_ids == (2,)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(learning_rate=-1e-5), r"PPOOptimizer.learning_rate=-1e-05 is invalid: use a value "
                                    r"> 0 \(1e-6 to 3e-6 for full PPO fine-tuning\)"),
        (dict(learning_rate=float("nan")), r"PPOOptimizer.learning_rate=nan is invalid"),
        (dict(learning_rate="3e-6"), r"PPOOptimizer.learning_rate='3e-6' is invalid: use a "
                                     r"finite number"),
        (dict(adam_b2=1.0), r"PPOOptimizer.adam_b2=1.0 is invalid: use a value in \[0, 1\)"),
        (dict(lr_schedule="step"), r"PPOOptimizer.lr_schedule='step' is invalid: choose one of"),
    ],
)
def test_ppo_optimizer_refuses_bad_values_at_construction(kwargs, message):
  with pytest.raises(ValueError, match=message):
    PPOOptimizer(**kwargs)


# ---- model folders -------------------------------------------------------------------------------


def _policy_copy(files, tmp_path):
  folder = tmp_path / "policy"
  shutil.copytree(files / "policy", folder)
  return folder


def test_unsupported_architecture(files, tmp_path, capsys):
  folder = _policy_copy(files, tmp_path)
  config = json.loads((folder / "config.json").read_text())
  config["model_type"] = "bert"
  (folder / "config.json").write_text(json.dumps(config))
  err = _train_fails(files, tmp_path, capsys, f"policy_path={folder}")
  assert "'bert'" in err and str(folder / "config.json") in err
  assert "supported model types: " in err and "llama" in err


def test_missing_and_truncated_safetensors(files, tmp_path, capsys):
  folder = _policy_copy(files, tmp_path)
  weights = folder / "model.safetensors"
  data = weights.read_bytes()
  weights.unlink()
  err = _train_fails(files, tmp_path, capsys, f"policy_path={folder}")
  assert "model.safetensors" in err and str(folder) in err
  weights.write_bytes(data[: len(data) // 2])
  err = _train_fails(files, tmp_path, capsys, f"policy_path={folder}")
  assert "safetensors" in err


def test_run_folder_without_a_checkpoint(files, tmp_path, capsys):
  from jax_ppo.config_io import save_config

  config = run_config.load_run_config([str(files / "run.yaml"), f"run_dir={tmp_path / 'run'}"])
  (tmp_path / "run").mkdir()
  save_config(config, tmp_path / "run")
  assert main(["export", "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2
  err = capsys.readouterr().err
  assert err.startswith("jax-ppo export: error: No checkpoint in ") and "train first" in err
  assert not (tmp_path / "hf").exists()
  (tmp_path / "eval.txt").write_text("the movie\n")
  assert main(["eval", "--run-dir", str(tmp_path / "run"), "--prompts",
               str(tmp_path / "missing.txt")]) == 2
  assert "--prompts=" in capsys.readouterr().err


# ---- run and output folders over the inputs (issue 24 item 4) -----------------------------------


def _hashes(folder) -> dict[str, str]:
  """sha256 of every file under `folder`, by relative path."""
  return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_run_folder_over_an_input_is_refused_before_anything_loads(files, tmp_path, capsys):
  policy = _policy_copy(files, tmp_path)
  before = _hashes(tmp_path)
  for run_dir, how in ((policy, "is"), (policy / "run", "lies inside"), (tmp_path, "contains")):
    status = main(["train", str(files / "run.yaml"), f"run_dir={run_dir}",
                   f"policy_path={policy}"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert err.startswith(f"jax-ppo train: error: RunConfig.run_dir='{run_dir}' {how} "
                          f"RunConfig.policy_path='{policy}', which the run reads: the run would "
                          "write over its own input. Give RunConfig.run_dir a path outside"), err
  assert _hashes(tmp_path) == before and not (policy / "run").exists()
  # Through the Python API: the same error when the config is built, for every input.
  base = [str(files / "run.yaml"), f"run_dir={tmp_path / 'run'}"]
  for override, field in (
      (f"run_dir={files / 'prompts.txt'}", "prompts_path"),
      (f"run_dir={files / 'reward'}", "reward_model_path"),
      (f"value_model_path={tmp_path / 'run' / 'critic'}", "value_model_path"),
  ):
    extra = ["reward_function=null", f"reward_model_path={files / 'reward'}"]
    with pytest.raises(ValueError, match=rf"^RunConfig.run_dir='[^']*' (is|contains) "
                                         rf"RunConfig.{field}="):
      run_config.load_run_config([*base, *extra, override])
  config = run_config.load_run_config(base)
  with pytest.raises(ValueError, match=r"^RunConfig.run_dir='.*policy' is RunConfig.policy_path"):
    dataclasses.replace(config, run_dir=config.policy_path)
  with pytest.raises(ValueError, match=r"lies inside RunConfig.rewards\[1\].model_path="):
    run_config.load_run_config([*base, f"run_dir={files / 'reward' / 'run'}",
                                "reward_function=null", "rewards=[{function: length}, "
                                f"{{model_path: {files / 'reward'}}}]"])
  assert _hashes(files / "policy") == _hashes(policy)


def test_export_and_eval_outputs_over_inputs_are_refused(files, tmp_path, capsys):
  from jax_ppo.config_io import save_config

  policy = _policy_copy(files, tmp_path)
  run_dir = tmp_path / "run"
  config = run_config.load_run_config([str(files / "run.yaml"), f"run_dir={run_dir}",
                                       f"policy_path={policy}"])
  run_dir.mkdir()
  save_config(config, run_dir)
  notes = tmp_path / "notes"
  notes.mkdir()
  (notes / "todo.txt").write_text("keep me")
  before = _hashes(tmp_path)
  for out, message in (
      (policy, f"--out='{policy}' is RunConfig.policy_path='{policy}', which the run reads"),
      (policy / "hf", f"--out='{policy / 'hf'}' lies inside RunConfig.policy_path="),
      (run_dir, f"--out='{run_dir}' is --run-dir='{run_dir}': an export replaces its folder "
                "whole, so it would delete the run folder"),
      (notes, f"--out='{notes}' is a folder that holds no model (no config.json; it holds "
              "todo.txt): an export replaces its folder whole"),
  ):
    assert main(["export", "--run-dir", str(run_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jax-ppo export: error: {message}") and err.count("\n") == 1, err
  with pytest.raises(ValueError, match=r"^--out='.*policy' is RunConfig.policy_path="):
    run.export_run(run_dir, policy)
  prompts = files / "prompts.txt"
  assert main(["eval", "--run-dir", str(run_dir), "--prompts", str(prompts), "--out",
               str(prompts)]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"jax-ppo eval: error: --out='{prompts}' is --prompts='{prompts}', which "
                        "the run reads"), err
  assert _hashes(tmp_path) == before


# ---- tokenizers that differ ----------------------------------------------------------------------


@pytest.mark.slow
def test_reward_model_with_its_own_tokenizer_scores_its_own_ids(files, tmp_path):
  """End to end through `run_training`: every logged reward equals the Hugging Face reward model
  on the reward tokenizer's ids of the decoded prompt + response (docs/rlhf_details.md item 21)."""
  run_dir = tmp_path / "run"
  config = run_config.load_run_config([
      str(files / "run.yaml"), f"run_dir={run_dir}", "reward_function=null",
      f"reward_model_path={files / 'reward'}", "run.updates_per_run=1",
  ])
  history = run.run_training(config)
  assert len(history) == 1
  samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
  assert len(samples) == 4
  tok_a = load_tokenizer(str(files / "policy"))
  tok_b = load_tokenizer(str(files / "reward"))
  hf = transformers.GPT2ForSequenceClassification.from_pretrained(str(files / "reward"))
  own, foreign = [], []
  for s in samples:
    text = f"{s['prompt']} {s['response']}"  # word-level decode joins tokens with spaces
    # The policy's special tokens (its EOS) are dropped; the reward tokenizer adds its own.
    text = tok_a.decode(tok_a(text, add_special_tokens=False)["input_ids"],
                        skip_special_tokens=True)
    ids_b = tok_b(text)["input_ids"]
    ids_a = tok_a(text)["input_ids"]
    assert ids_a != ids_b and tok_b.unk_token_id not in ids_b  # every id differs, no unknowns
    with torch.no_grad():
      own.append(float(hf(torch.tensor([ids_b])).logits[0, 0]))
      foreign.append(float(hf(torch.tensor([ids_a])).logits[0, 0]))
  logged = [s["reward"] for s in samples]
  np.testing.assert_allclose(logged, own, atol=1e-4)
  assert not np.allclose(logged, foreign, atol=1e-2)  # the policy's ids would score otherwise
  assert np.mean(own) == pytest.approx(history[0]["objective/scores"], abs=1e-4)


# ---- reward functions through the command line ---------------------------------------------------


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
  """A module `user_rewards_cli` on sys.path with good and bad reward functions."""
  (tmp_path / "user_rewards_cli.py").write_text(
      "import math\n\n"
      "def words(prompts, responses):\n"
      "  return [float(len(r.split())) for r in responses]\n\n"
      "def nan_for_the_actor(prompts, responses):\n"
      "  return [math.nan if 'actor' in p else 1.0 for p in prompts]\n\n"
      "def fails_on_the_actor(prompts, responses):\n"
      "  return [{'the actor is': None}.get(p, 0.0) + 1.0 for p in prompts]\n"
  )
  monkeypatch.syspath_prepend(str(tmp_path))
  yield "user_rewards_cli"
  sys.modules.pop("user_rewards_cli", None)


def test_a_nan_reward_stops_the_run_naming_the_row_and_prompt(files, tmp_path, capsys,
                                                              user_rewards):
  status = main(["train", str(files / "run.yaml"), f"run_dir={tmp_path / 'run'}",
                 f"reward_function={user_rewards}:nan_for_the_actor", "ppo.batch_size=8",
                 "prompts_path=" + str(files / "prompts.txt"), "run.save_every=1"])
  err = capsys.readouterr().err
  assert status == 2 and err.count("\n") == 1 and "Traceback" not in err, err
  # Prompts are shuffled: the actor's prompt is at some rows; every one of them is named.
  assert f"The reward function '{user_rewards}:nan_for_the_actor' returned non-finite scores " \
         "at rows [" in err and "(values nan, nan; 2 of 8 rows)" in err
  assert "(prompt 'the actor is')" in err and "nothing is replaced by zero" in err
  assert not list((tmp_path / "run").glob("checkpoints/*"))  # no update was applied


def test_an_exception_in_the_reward_function_keeps_its_traceback(files, tmp_path, user_rewards):
  from jax_ppo.rewards.scorers import RewardFunctionError

  with pytest.raises(RewardFunctionError, match=r"raised TypeError: unsupported operand type.* "
                                                r"at row \d \(prompt 'the actor is'\)") as info:
    main(["train", str(files / "run.yaml"), f"run_dir={tmp_path / 'run'}",
          f"reward_function={user_rewards}:fails_on_the_actor"])
  assert isinstance(info.value.__cause__, TypeError)


@pytest.mark.slow
def test_a_module_reward_trains_end_to_end(files, tmp_path, capsys, user_rewards):
  run_dir = tmp_path / "run"
  assert main(["train", str(files / "run.yaml"), f"run_dir={run_dir}", "run.updates_per_run=1",
               f"reward_function={user_rewards}:words"]) == 0
  samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
  assert [s["reward"] for s in samples] == [float(len(s["response"].split())) for s in samples]
  assert run_config.saved_run_config(run_dir).reward_function == f"{user_rewards}:words"
