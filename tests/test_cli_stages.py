"""`jax-ppo sft` and `jax-ppo reward` (jax_ppo.runs.sft / reward_run) and the pipeline
loader (jax_ppo.runs.pipeline), on tiny random Hugging Face checkpoints built locally.

Stage runs resume (`steps_per_run`), refuse a changed configuration, export Hugging Face folders
that transformers reads, and the reward stage's normalisation gives SFT-policy samples mean 0 and
std 1 (docs/rlhf_details.md item 16). Every bad input is one line naming the field and the fix.
"""

import hashlib
import json
import math
import pathlib
import re
import shutil

import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch", reason="torch builds the tiny Hugging Face models")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from jax_ppo.cli import main  # noqa: E402
from jax_ppo.models import load_scalar_model  # noqa: E402
from jax_ppo.runs.pipeline import load_pipeline  # noqa: E402
from jax_ppo.runs.reward import (  # noqa: E402
    _prompts,
    build_reward_trainer,
    load_reward_config,
    policy_samples,
)
from jax_ppo.runs.sft import build_sft_trainer, load_sft_config  # noqa: E402
from tests.tiny_hf_run import make_checkpoint, write_data  # noqa: E402

pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")

SFT = ["dtype=float32", "sft.max_length=16", "sft.batch_size=4",
       "sft.optimizer.warmup_steps=0", "run.progress=false", "run.tensorboard=false"]
REWARD = ["dtype=float32", "reward.max_length=16", "reward.batch_size=4", "reward.total_steps=2",
          "normalise_max_new_tokens=4", "run.progress=false"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
  root = tmp_path_factory.mktemp("stages")
  return {"root": root, "model": make_checkpoint(root, "llama"), **write_data(root)}


def _summary(capsys) -> tuple[dict, str]:
  out, err = capsys.readouterr()
  lines = [line for line in out.splitlines() if line.startswith("{")]
  return (json.loads(lines[-1]) if lines else {}), err


@pytest.mark.slow
def test_sft_resumes_refuses_a_changed_config_and_exports(assets, tmp_path, capsys):
  run_dir = tmp_path / "sft"
  argv = ["sft", f"model_path={assets['model']}", f"train_path={assets['sft']}",
          f"run_dir={run_dir}", "sft.total_steps=3", "sft.eval_fraction=0.25",
          "run.steps_per_run=2", *SFT]
  assert main(argv) == 0
  first, _ = _summary(capsys)
  assert (first["step"], first["complete"], first["export_dir"]) == (2, False, None)
  assert not (run_dir / "hf_model").exists()
  assert (run_dir / "config.yaml").is_file() and (run_dir / "metrics.jsonl").is_file()

  # A computing field changed: refused, naming the field; nothing trained.
  assert main([*argv, "sft.optimizer.learning_rate=1e-3"]) == 2
  out, err = capsys.readouterr()
  assert "learning_rate" in err and len(err.strip().splitlines()) == 1

  assert main(argv) == 0  # the same command resumes and finishes
  second, _ = _summary(capsys)
  assert (second["step"], second["steps_run"], second["complete"]) == (3, 1, True)
  assert math.isclose(second["eval/perplexity"], math.exp(second["eval/loss"]), rel_tol=1e-6)
  steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text()
           .splitlines() if "train/loss" in line]
  assert steps == [1, 2, 3]
  assert main(argv) == 0  # complete: nothing more is trained, the model is exported again
  third, _ = _summary(capsys)
  assert (third["step"], third["steps_run"], third["complete"]) == (3, 0, True)
  export = pathlib.Path(second["export_dir"])
  assert export == run_dir / "hf_model"
  hf = transformers.AutoModelForCausalLM.from_pretrained(export)
  tok = transformers.AutoTokenizer.from_pretrained(export)
  ids = torch.tensor([tok("the movie was good")["input_ids"]])
  assert torch.isfinite(hf(ids).logits).all()


@pytest.mark.slow
def test_reward_stage_normalises_on_sft_policy_samples(assets, tmp_path, capsys):
  argv = [f"model_path={assets['model']}", f"train_path={assets['prefs']}",
          f"eval_path={assets['prefs']}", f"run_dir={tmp_path / 'rm'}", "normalise_samples=8",
          *REWARD]
  assert main(["reward", *argv]) == 0
  summary, _ = _summary(capsys)
  assert summary["complete"] and summary["normalisation"]["samples"] == 8
  assert 0.0 <= summary["eval/accuracy"] <= 1.0
  # The exported model scores the same policy samples with mean 0 and std 1.
  config = load_reward_config(argv)
  trainer = build_reward_trainer(config)
  try:
    ids, mask = policy_samples(config, _prompts(config, trainer.train_records),
                               seed=config.reward.seed, reward_tokenizer=trainer.tokenizer)
  finally:
    trainer.close()
  model = load_scalar_model(summary["export_dir"])
  scores = np.asarray(model.score(ids, mask))
  assert scores.shape == (8,)
  np.testing.assert_allclose([scores.mean(), scores.std()], [0.0, 1.0], atol=1e-3)
  hf = transformers.AutoModelForSequenceClassification.from_pretrained(summary["export_dir"])
  assert hf.config.num_labels == 1
  # The normalisation settings only change the export: a run may resume with other ones.
  assert main(["reward", *argv, "normalise_samples=4"]) == 0
  again, _ = _summary(capsys)
  assert again["steps_run"] == 0 and again["normalisation"]["samples"] == 4


def test_reward_stage_reads_conversational_preferences(assets, tmp_path, capsys):
  """A preference file of whole conversations (no prompt field) trains on the same pairs as its
  explicit form, and the normalisation samples the policy on the shared turns; a record whose
  conversations differ before the responses is one line naming the record."""
  import shutil

  model = tmp_path / "chat_model"
  shutil.copytree(assets["model"], model)
  tok = transformers.AutoTokenizer.from_pretrained(model)
  tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
  tok.save_pretrained(model)
  turn = lambda role, text: {"role": role, "content": text}  # noqa: E731
  users = [[turn("user", "the movie was")], [turn("user", "the plot is")]]
  explicit = [{"prompt": u, "chosen": [turn("assistant", "good fun")],
               "rejected": [turn("assistant", "dull")]} for u in users * 2]
  implicit = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
              for r in explicit]
  pairs, prompts = [], []
  for name, records in (("explicit", explicit), ("implicit", implicit)):
    path = _write(tmp_path / f"{name}.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    config = load_reward_config([f"model_path={model}", f"train_path={path}",
                                 f"run_dir={tmp_path / name}", *REWARD])
    trainer = build_reward_trainer(config)
    try:
      pairs.append(trainer.train_pairs)
      prompts.append(_prompts(config, trainer.train_records))
    finally:
      trainer.close()
  np.testing.assert_array_equal(pairs[0].chosen_ids, pairs[1].chosen_ids)
  np.testing.assert_array_equal(pairs[0].rejected_ids, pairs[1].rejected_ids)
  assert prompts[0] == prompts[1] == users
  bad = _write(tmp_path / "bad.jsonl", json.dumps(implicit[0]) + "\n" + json.dumps(
      {"chosen": implicit[0]["chosen"], "rejected": implicit[1]["rejected"]}) + "\n")
  assert main(["reward", f"model_path={model}", f"train_path={bad}",
               f"run_dir={tmp_path / 'bad'}", *REWARD]) == 2
  _, err = capsys.readouterr()
  assert len(err.strip().splitlines()) == 1 and "differ before their last turns" in err, err


def _write(path: pathlib.Path, text: str) -> str:
  path.write_text(text, encoding="utf-8")
  return str(path)


@pytest.mark.parametrize("stage,extra,message", [
    ("sft", ["sft.optimizer.learning_rat=1e-5"], "Did you mean 'learning_rate'"),
    ("sft", ["sft.learning_rate=1e-5"], "Config key 'sft.learning_rate' has moved to "
                                        "'sft.optimizer.learning_rate'"),
    ("sft", ["dtype=float8"], "SFTRunConfig.dtype='float8' is invalid"),
    ("sft", ["run.steps_per_run=0"], "SFTRunConfig.run.steps_per_run=0 is invalid"),
    ("sft", ["sft.batch_size=0"], "SFTConfig.batch_size=0 is invalid"),
    ("sft", ["train_path=MISSING.jsonl"], "SFTRunConfig.train_path='MISSING.jsonl': no such file"),
    ("sft", ["train_path=BAD_SUFFIX"], "unsupported suffix '.csv'"),
    ("sft", ["train_path=NO_RESPONSE"], 'line 2: expected an object with "prompt" and "response" '
                                        'or "completion" strings (or chats) or a "messages" list, '
                                        "got keys ['prompt', 'answer']"),
    ("sft", ["train_path=BAD_JSON"], "line 3, column"),
    ("sft", ["train_path=BOTH"], "both.jsonl', line 2: the record has both 'response' and "
                                 "'completion'"),
    ("sft", ["model_path=NOT_A_MODEL"], "SFTRunConfig.model_path="),
    ("reward", ["normalise_samples=0"], "RewardRunConfig.normalise_samples=0 is invalid"),
    ("reward", ["reward.chosen_feild=x"], "Did you mean 'chosen_field'"),
    ("reward", ["train_path=NO_REJECTED"], 'line 1: expected an object with "prompt", "chosen" '
                                           "and \"rejected\" fields, got keys ['prompt', "
                                           "'chosen']; name the record's field with "
                                           "reward.rejected_field=..."),
    # The trainers' checks of a record (made when the file is read) name its file and line.
    ("sft", ["train_path=CHAT_AND_TEXT"], "chat.jsonl', line 2: \"prompt\" is a chat but "
                                          "\"response\" is not"),
    ("reward", ["train_path=CHAT_AND_TEXT"], "chat.jsonl', line 2: \"chosen\" is a chat but "
                                             "\"rejected\" is not"),
    ("reward", ["train_path=BAD_MARGIN"], "m.jsonl', line 1: \"margin\" must be a finite number "
                                          ">= 0, got 'big' (str); leave it out for 0."),
])
def test_bad_inputs_get_one_line_naming_the_field(stage, extra, message, assets, tmp_path,
                                                  capsys):
  files = {
      "MISSING.jsonl": str(tmp_path / "missing.jsonl"),
      "BAD_SUFFIX": _write(tmp_path / "data.csv", "prompt,response\n"),
      "NO_RESPONSE": _write(tmp_path / "a.jsonl", '{"prompt": "a", "response": "b"}\n'
                                                  '{"prompt": "a", "answer": "b"}\n'),
      "BAD_JSON": _write(tmp_path / "b.jsonl", '{"prompt": "a", "response": "b"}\n\n{"prompt": \n'),
      "NOT_A_MODEL": str(tmp_path),
      "BOTH": _write(tmp_path / "both.jsonl", '{"prompt": "a", "completion": "b"}\n'
                                              '{"prompt": "a", "response": "b", '
                                              '"completion": "c"}\n'),
      "NO_REJECTED": _write(tmp_path / "c.jsonl", '{"prompt": "a", "chosen": "b"}\n'),
      "CHAT_AND_TEXT": _write(tmp_path / "chat.jsonl", "\n".join(json.dumps(r) for r in (
          {"prompt": "the movie", "response": "good", "chosen": "good", "rejected": "bad"},
          {"prompt": [{"role": "user", "content": "the movie"}], "response": "good",
           "chosen": [{"role": "assistant", "content": "good"}], "rejected": "bad"}))),
      "BAD_MARGIN": _write(tmp_path / "m.jsonl", json.dumps(
          {"prompt": "a", "chosen": "good", "rejected": "bad", "margin": "big"})),
  }
  extra = [e.split("=")[0] + "=" + files.get(e.split("=")[1], e.split("=")[1]) for e in extra]
  message = message.replace("'MISSING.jsonl'", repr(files["MISSING.jsonl"]))
  data = assets["sft"] if stage == "sft" else assets["prefs"]
  argv = [stage, f"model_path={assets['model']}", f"train_path={data}",
          f"run_dir={tmp_path / 'run'}", *(SFT if stage == "sft" else REWARD), *extra]
  assert main(argv) == 2
  out, err = capsys.readouterr()
  assert out == ""
  assert err.startswith(f"jax-ppo {stage}: error: ") and len(err.strip().splitlines()) == 1
  assert message in err, err


def test_field_names_and_json_files_are_configurable(assets, tmp_path):
  """Records with the user's own field names (sft.*_field, reward.*_field), as .json lists."""
  sft = _write(tmp_path / "sft.json", json.dumps(
      [{"question": "the movie was", "answer": "good"}] * 4))
  prefs = _write(tmp_path / "prefs.json", json.dumps(
      [{"q": "the plot", "better": "great fun", "worse": "dull"}] * 4))
  trainer = build_sft_trainer(load_sft_config([
      f"model_path={assets['model']}", f"train_path={sft}", f"run_dir={tmp_path / 's'}",
      "sft.prompt_field=question", "sft.response_field=answer", *SFT]))
  try:
    assert trainer.train_rows.num_rows == 4
  finally:
    trainer.close()
  # TRL's prompt-completion records train as the same records with "response" do.
  rows = []
  for key in ("completion", "response"):
    data = _write(tmp_path / f"{key}.jsonl", "".join(
        json.dumps({"prompt": p, key: r}) + "\n"
        for p, r in (("the movie was", " good"), ("the plot", " was dull"))))
    trainer = build_sft_trainer(load_sft_config([
        f"model_path={assets['model']}", f"train_path={data}",
        f"run_dir={tmp_path / key}", *SFT]))
    try:
      rows.append(trainer.train_rows)
    finally:
      trainer.close()
  assert rows[0].num_rows == 2 and rows[0].loss_mask.any()
  for a, b in zip(rows[0], rows[1], strict=True):
    np.testing.assert_array_equal(a, b)
  trainer = build_reward_trainer(load_reward_config([
      f"model_path={assets['model']}", f"train_path={prefs}", f"run_dir={tmp_path / 'r'}",
      "reward.prompt_field=q", "reward.chosen_field=better", "reward.rejected_field=worse",
      *REWARD]))
  try:
    assert trainer.train_pairs.num_pairs == 4
  finally:
    trainer.close()


def _hashes(folder: pathlib.Path) -> dict[str, str]:
  """sha256 of every file under `folder`, by relative path."""
  return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("stage", ["sft", "reward"])
def test_a_stage_never_writes_over_its_inputs(stage, assets, tmp_path, capsys):
  """Issue 24 item 4: a run or export folder that is, contains or lies inside a path the stage
  reads, or an export that holds the run folder, is one error naming both fields and paths,
  through the command line and the Python API, before anything is written: every file of the
  model and data folders is byte-identical afterwards. (Before, an SFT run exporting to its
  own model folder overwrote model.safetensors.)"""
  name, load = (("SFTRunConfig", load_sft_config) if stage == "sft" else
                ("RewardRunConfig", load_reward_config))
  model = tmp_path / "model"
  shutil.copytree(assets["model"], model)
  data_dir = tmp_path / "data"
  data_dir.mkdir()
  data = data_dir / "train.jsonl"
  shutil.copy(assets["sft"] if stage == "sft" else assets["prefs"], data)
  base = [f"model_path={model}", f"train_path={data}", *(SFT if stage == "sft" else REWARD)]
  run_dir = tmp_path / "run"
  cases = [
      ([f"run_dir={run_dir}", f"export_dir={model}"],
       f"{name}.export_dir='{model}' is {name}.model_path='{model}', which the run reads: the run "
       f"would write over its own input. Give {name}.export_dir a path outside every folder"),
      ([f"run_dir={model}"], f"{name}.run_dir='{model}' is {name}.model_path='{model}'"),
      ([f"run_dir={model / 'run'}"], f"{name}.run_dir='{model / 'run'}' lies inside "
                                     f"{name}.model_path='{model}'"),
      ([f"run_dir={tmp_path}"], f"{name}.run_dir='{tmp_path}' contains {name}.model_path="),
      ([f"run_dir={run_dir}", f"export_dir={data_dir}"],
       f"{name}.export_dir='{data_dir}' contains {name}.train_path='{data}'"),
      ([f"run_dir={run_dir}", f"eval_path={data}", f"export_dir={data}"],
       f"{name}.export_dir='{data}' is {name}.train_path='{data}'"),
      ([f"run_dir={tmp_path / 'runs' / 'a'}", f"export_dir={tmp_path / 'runs'}"],
       f"{name}.export_dir='{tmp_path / 'runs'}' contains {name}.run_dir="
       f"'{tmp_path / 'runs' / 'a'}': an export replaces its folder whole, so it would delete "
       "the run folder"),
      ([f"run_dir={run_dir}", f"export_dir={run_dir}"],
       f"{name}.export_dir='{run_dir}' is {name}.run_dir='{run_dir}'"),
  ]
  if stage == "reward":
    cases += [
        ([f"run_dir={run_dir}", f"policy_path={run_dir / 'policy'}"],
         f"RewardRunConfig.run_dir='{run_dir}' contains RewardRunConfig.policy_path="),
        ([f"run_dir={run_dir}", f"normalise_prompts_path={run_dir / 'hf_model'}"],
         f"RewardRunConfig.export_dir='{run_dir / 'hf_model'}' is "
         "RewardRunConfig.normalise_prompts_path="),
    ]
  before = _hashes(tmp_path)
  for extra, message in cases:
    if stage == "reward" and "normalise_prompts_path" in extra[-1]:
      message = f"RewardRunConfig.run_dir='{run_dir}' contains RewardRunConfig.normalise_prompts"
    assert main([stage, *base, *extra]) == 2, extra
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"jax-ppo {stage}: error: {message}"), err
    with pytest.raises(ValueError, match="^" + re.escape(message)):
      load([*base, *extra])
  assert _hashes(tmp_path) == before
  assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "model"]
  # A non-empty export folder that holds no model is refused before anything loads, and kept.
  notes = tmp_path / "notes"
  notes.mkdir()
  (notes / "todo.txt").write_text("keep me")
  assert main([stage, *base, f"run_dir={run_dir}", f"export_dir={notes}"]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"jax-ppo {stage}: error: {name}.export_dir='{notes}' is a folder that "
                        "holds no model (no config.json; it holds todo.txt)"), err
  assert (notes / "todo.txt").read_text() == "keep me" and not run_dir.exists()


def test_pipeline_stages_never_write_over_each_others_inputs(assets, tmp_path):
  """Across stages (issue 24 item 4): a later stage's run or export folder over what an earlier
  stage reads, or an export holding another stage's run folder, names both stages' fields."""
  model = str(tmp_path / "model")
  sft_data = tmp_path / "sft_data"
  sft_data.mkdir()
  shutil.copy(assets["sft"], sft_data / "sft.jsonl")
  pipeline = {"model_path": model, "out_dir": str(tmp_path / "out"),
              "sft": {"train_path": str(sft_data / "sft.jsonl")},
              "reward": {"train_path": assets["prefs"]},
              "ppo": {"prompts_path": assets["prompts"], "reward_function": "length"}}
  path = tmp_path / "pipe.yaml"
  path.write_text(yaml.safe_dump(pipeline))
  load_pipeline([str(path)])  # the default layout is fine

  def error(*overrides):
    with pytest.raises(ValueError) as info:
      load_pipeline([str(path), *overrides])
    return str(info.value)

  source = f"Pipeline file {str(path)!r}: "
  assert error(f"reward.run_dir={model}").startswith(
      f"{source}reward.run_dir='{model}' is sft.model_path='{model}', which the run reads")
  assert error(f"ppo.run_dir={sft_data}").startswith(
      f"{source}ppo.run_dir='{sft_data}' contains sft.train_path='{sft_data / 'sft.jsonl'}'")
  parent = tmp_path / "parent"
  assert error(f"ppo.run_dir={parent / 'ppo'}", f"reward.export_dir={parent}").startswith(
      f"{source}reward.export_dir='{parent}' contains ppo.run_dir='{parent / 'ppo'}': an export "
      "replaces its folder whole")
  # A stage's own paths are checked by its config, named by the stage.
  assert error(f"sft.export_dir={model}").startswith(
      f"{source[:-2]}, sft stage: SFTRunConfig.export_dir='{model}' is SFTRunConfig.model_path=")


def test_pipeline_wiring_and_errors(tmp_path):
  (tmp_path / "sft.yaml").write_text("model_path: elsewhere\ntrain_path: s.jsonl\n"
                                     "run_dir: runs/sft\n")
  pipeline = {"model_path": "base", "out_dir": str(tmp_path / "out"), "sft": "sft.yaml",
              "reward": {"train_path": "p.jsonl"},
              "ppo": {"prompts_path": "q.jsonl", "reward_function": "length"}}
  path = tmp_path / "pipe.yaml"
  path.write_text(yaml.safe_dump(pipeline))
  configs = load_pipeline([str(path), "sft.sft.optimizer.learning_rate=1e-4"])
  sft, reward, ppo = configs["sft"], configs["reward"], configs["ppo"]
  assert (sft.model_path, sft.run_dir) == ("base", str(tmp_path / "out" / "sft"))
  assert sft.sft.optimizer.learning_rate == 1e-4
  assert reward.model_path == reward.policy_path == str(sft.export_path) == ppo.policy_path
  assert ppo.reward_model_path is None and ppo.reward_function == "length"
  # Without a reward function PPO reads the reward stage's export; an override still wins.
  del pipeline["ppo"]["reward_function"]
  path.write_text(yaml.safe_dump(pipeline))
  assert load_pipeline([str(path)])["ppo"].reward_model_path == str(reward.export_path)
  assert load_pipeline([str(path), "ppo.reward_model_path=mine"])["ppo"].reward_model_path == (
      "mine")

  swapped = load_pipeline([str(path), "ppo.reward_function=length"])["ppo"]
  assert (swapped.reward_function, swapped.reward_model_path) == ("length", None)

  def error(argv, text=None):
    if text is not None:
      path.write_text(text)
    with pytest.raises((ValueError, FileNotFoundError)) as info:
      load_pipeline(argv)
    return str(info.value)

  assert "Did you mean 'sft'" in error([str(path), "spt.run_dir=x"])
  assert "Did you mean 'reward'" in error([str(path)], "rewad: {}\n")
  assert "names no stage" in error([str(path)], "model_path: m\n")
  assert "does not exist" in error([str(path)], "sft: nowhere.yaml\n")
  message = error([str(path)], "reward: {train_path: p.jsonl, normalize: true}\n")
  assert "section 'reward'" in message and "Did you mean 'normalise'" in message
  message = error([str(path), "sft.sft.packing=maybe"], "sft: sft.yaml\n")
  assert "sft.packing" in message and "bool" in message
  message = error([str(path)], "reward: {model_path: m, train_path: p.jsonl}\n")
  assert "reward stage" in message and "run_dir" in message and "out_dir" in message


def test_pipeline_eval_section_is_checked_before_any_stage(tmp_path):
  held = tmp_path / "held.jsonl"
  held.write_text('{"prompt": "a b"}\n')
  pipeline = {"out_dir": str(tmp_path / "out"), "model_path": "base",
              "ppo": {"prompts_path": "q.jsonl", "reward_function": "length"},
              "eval": {"prompts_path": str(held), "temperature": 0.7, "n": 2}}
  path = tmp_path / "pipe.yaml"
  path.write_text(yaml.safe_dump(pipeline))
  evaluation = load_pipeline([str(path)])["eval"]
  assert (evaluation.prompts_path, evaluation.temperature, evaluation.n, evaluation.seed) == (
      str(held), 0.7, 2, 0)
  assert load_pipeline([str(path), "eval.n=4", "eval.seed=3"])["eval"].n == 4
  del pipeline["eval"]
  path.write_text(yaml.safe_dump(pipeline))
  assert load_pipeline([str(path)])["eval"] is None
  # An override alone adds the section (greedy by default).
  greedy = load_pipeline([str(path), f"eval.prompts_path={held}"])["eval"]
  assert greedy.temperature is None and greedy.n == 1

  def error(*overrides, text=None):
    with pytest.raises((ValueError, FileNotFoundError)) as info:
      other = path if text is None else _write(tmp_path / "other.yaml", text)
      load_pipeline([str(other), *overrides])
    return str(info.value)

  assert "eval.prompts_path" in error("eval.prompts_path=missing.jsonl")
  message = error(f"eval.prompts_path={held}", "eval.n=3")
  assert "eval.n=3 needs sampling" in message and "eval.temperature" in message
  assert "eval.temperature=-1.0 is invalid" in error(f"eval.prompts_path={held}",
                                                      "eval.temperature=-1")
  assert "Did you mean 'temperature'" in error(f"eval.prompts_path={held}", "eval.temprature=1")
  assert "Did you mean 'eval'" in error(text="evl: {prompts_path: x}\nppo: {prompts_path: q}\n")
  sft_only = "sft: {model_path: m, train_path: t.jsonl, run_dir: r}\n"
  assert "add a ppo stage" in error(text=f"{sft_only}eval: {{prompts_path: {held}}}\n")


def test_pipeline_command_reports_bad_input_in_one_line(tmp_path, capsys):
  assert main(["pipeline", str(tmp_path / "none.yaml")]) == 2
  err = capsys.readouterr().err
  assert err.startswith("jax-ppo pipeline: error: ") and "does not exist" in err
  assert len(err.strip().splitlines()) == 1
  (tmp_path / "p.yaml").write_text("sft: {model_path: m, train_path: t.jsonl, run_dir: r}\n")
  assert main(["pipeline", str(tmp_path / "p.yaml"), "sft.sft.batch_size=-1"]) == 2
  err = capsys.readouterr().err
  assert "sft stage" in err and "SFTConfig.batch_size=-1 is invalid" in err


def test_stage_records_from_parquet_and_datasets_folders(tmp_path):
  """Stage data may be JSONL, a .json list, Parquet or a local `datasets` folder: the same
  records come back, and a record without a required field is named by its row."""
  import datasets
  import pyarrow as pa
  import pyarrow.parquet as pq

  from jax_ppo.data.records import sft_record
  from jax_ppo.runs.common import read_records

  rows = [{"prompt": "a", "response": "b"}, {"prompt": "c", "response": "d"}]
  (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (tmp_path / "r.json").write_text(json.dumps(rows))
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "r.parquet")
  datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
  for name in ("r.jsonl", "r.json", "r.parquet", "ds"):
    got = read_records(str(tmp_path / name), field="SFTRunConfig.train_path",
                       check=sft_record)
    assert got == rows, name
  pq.write_table(pa.Table.from_pylist([rows[0], {"prompt": "e", "response": None}]),
                 tmp_path / "bad.parquet")
  with pytest.raises(ValueError, match=r"SFTRunConfig.train_path=.*bad\.parquet', row 1: "
                                       r"expected an object .* got keys \['prompt'\]"):
    read_records(str(tmp_path / "bad.parquet"), field="SFTRunConfig.train_path",
                 check=sft_record)
