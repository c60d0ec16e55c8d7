"""End-to-end tests of the `jax-ppo` command line (in process, through `jax_ppo.cli.main`; the
installed program, `jax_ppo.cli.run`, in subprocesses).

A tiny random GPT-2 policy, a tiny GPT-2 SequenceClassification reward model and a word-level
tokenizer are built locally (transformers, CPU torch, tokenizers; no downloads).
"""

import dataclasses
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest
import yaml
from flax import nnx

torch = pytest.importorskip("torch", reason="torch builds the tiny Hugging Face models")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from jax_ppo.checkpoint import CheckpointConfigMismatch, check_config  # noqa: E402
from jax_ppo.cli import main  # noqa: E402
from jax_ppo.config_io import config_to_dict  # noqa: E402
from jax_ppo.models import from_pretrained  # noqa: E402
from jax_ppo.ppo import PPOOptimizer, PPOSampling  # noqa: E402
from jax_ppo.rewards import specs  # noqa: E402
from jax_ppo.runs import ppo as run  # noqa: E402
from jax_ppo.runs import ppo_config as run_config  # noqa: E402
from jax_ppo.runs.common import PPO_RUN_FIELDS, PPORunFolder  # noqa: E402

WORDS = ("the a movie film plot actor story was is very really not quite good great fun bad "
         "dull boring long short and but I liked hated it").split()
PROMPTS = ["the movie was", "I liked the plot and", "the actor is", "it was really",
           "a story", "the film is not", "I hated it but", "a very long"]


pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")


def _tokenizer():
  vocab = {w: i for i, w in enumerate(["<pad>", "<|endoftext|>", "<unk>", *WORDS])}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<pad>", unk_token="<unk>"
  )


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """Policy and reward-model folders, prompt files and a YAML config."""
  root = tmp_path_factory.mktemp("cli")
  tok = _tokenizer()
  config = transformers.GPT2Config(
      vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2, n_positions=64,
      bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
  )
  torch.manual_seed(0)
  policy = transformers.GPT2LMHeadModel(config)
  policy.save_pretrained(root / "policy")
  tok.save_pretrained(root / "policy")
  config.num_labels = 1
  reward = transformers.GPT2ForSequenceClassification(config)
  with torch.no_grad():
    reward.score.weight.normal_(0.0, 1.0)
  reward.save_pretrained(root / "reward")
  tok.save_pretrained(root / "reward")
  (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
  (root / "eval.jsonl").write_text(
      "\n".join(json.dumps({"prompt": p}) for p in ("the plot was", "a good", "I liked")) + "\n")
  cfg = {
      "policy_path": str(root / "policy"),
      "reward_model_path": str(root / "reward"),
      "prompts_path": str(root / "prompts.txt"),
      "run_dir": str(root / "run"),
      "run": {"save_every": 1, "keep_last": 2, "log_samples_every": 1, "progress": False},
      "ppo": {"batch_size": 4, "num_minibatches": 1, "ppo_epochs": 1,
              "sampling": {"max_new_tokens": 4, "temperature": 1.0},
              "total_updates": 4, "optimizer": {"learning_rate": 1e-3}},
  }
  (root / "run.yaml").write_text(yaml.safe_dump(cfg))
  return root


def _jsonl(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def _last_json(text):
  return json.loads(text.strip().splitlines()[-1])


def test_train_resume_eval_export(files, capsys):
  run_dir = files / "run"
  command = ["train", str(files / "run.yaml"), "run.updates_per_run=2"]
  assert main(command) == 0
  summary = _last_json(capsys.readouterr().out)
  assert summary["run_dir"] == str(run_dir)
  assert summary["updates_run"] == 2 and summary["step"] == 2
  assert [r["step"] for r in _jsonl(run_dir / "metrics.jsonl")] == [1, 2]
  saved = run_config.saved_run_config(run_dir)
  assert saved.ppo.batch_size == 4 and saved.run.updates_per_run == 2

  # The same command again continues the run.
  assert main(command) == 0
  assert _last_json(capsys.readouterr().out)["step"] == 4
  logged = _jsonl(run_dir / "metrics.jsonl")
  assert [r["step"] for r in logged] == [1, 2, 3, 4]  # continued, no duplicates
  assert all(np.isfinite(r["objective/scores"]) for r in logged)
  assert {s["step"] for s in _jsonl(run_dir / "samples.jsonl")} == {1, 2, 3, 4}
  assert isinstance(_jsonl(run_dir / "samples.jsonl")[0]["response"], str)
  assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["3", "4"]
  assert any((run_dir / "tensorboard").iterdir())
  assert main(command) == 0  # complete: nothing to do
  assert _last_json(capsys.readouterr().out)["updates_run"] == 0

  # A different configuration on the same run folder is refused; nothing is touched.
  before = (run_dir / "metrics.jsonl").read_bytes()
  assert main([*command, "ppo.optimizer.learning_rate=0.5"]) == 2
  err = capsys.readouterr().err
  assert "ppo.optimizer.learning_rate: saved 0.001, now 0.5" in err and "another directory" in err
  assert (run_dir / "metrics.jsonl").read_bytes() == before

  out = files / "eval.json"
  assert main(["eval", "--run-dir", str(run_dir), "--prompts", str(files / "eval.jsonl"),
               "--greedy", "--out", str(out)]) == 0
  printed = _last_json(capsys.readouterr().out)
  result = json.loads(out.read_text())
  assert result["step"] == printed["step"] == 4 and result["greedy"]
  assert set(result["metrics"]) == {"eval/score_mean", "eval/score_std", "eval/response_length",
                                    "eval/kl", "eval/entropy", "eval/best_of_n", "eval/n",
                                    "eval/distinct_1", "eval/distinct_2", "eval/repetition_rate"}
  assert result["metrics"]["eval/best_of_n"] == result["metrics"]["eval/score_mean"]  # n=1
  assert len(result["samples"]) == 3 and result["samples"][0]["prompt"] == "the plot was"
  scores = [s["reward"] for s in result["samples"]]
  assert result["metrics"]["eval/score_mean"] == pytest.approx(np.mean(scores))
  assert main(["eval", "--run-dir", str(run_dir), "--prompts", str(files / "eval.jsonl"),
               "--temperature", "0.7", "--step", "3"]) == 0
  assert _last_json(capsys.readouterr().out)["step"] == 3
  assert (run_dir / "eval" / "step_3.json").is_file()

  hf_dir = files / "exported"
  assert main(["export", "--run-dir", str(run_dir), "--out", str(hf_dir)]) == 0
  assert _last_json(capsys.readouterr().out) == {"step": 4, "out": str(hf_dir)}
  exported = from_pretrained(str(hf_dir))
  trainer = run.build_trainer(run_config.saved_run_config(run_dir), open_run=False)
  assert trainer.load_checkpoint(run_dir) == 4
  ids = np.asarray([[0, 0, 5, 9], [7, 8, 11, 3]])
  mask = (ids != 0).astype(np.int32)

  def logits(model):
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda s: nnx.merge(graphdef, s)(ids, attention_mask=mask))(state))

  np.testing.assert_array_equal(logits(exported), logits(trainer.policy_model()))
  initial = from_pretrained(str(files / "policy"))
  assert not np.allclose(logits(exported), logits(initial))  # training changed the policy
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir))
  tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
  assert tok.decode(tok("the movie")["input_ids"]) == "the movie"
  with torch.no_grad():
    hf_logits = hf(torch.tensor(ids[1:])).logits.numpy()
  np.testing.assert_allclose(hf_logits, logits(exported)[1:], atol=1e-4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["prompts_path=/nonexistent/prompts.txt"],
         "RunConfig.prompts_path='/nonexistent/prompts.txt': no such file; give a .txt file"),
        (["reward_model_path=null", "reward_function=smiles"],
         "RunConfig.reward_function='smiles' is invalid: unknown reward function 'smiles'; "
         "choose one of length, count:<token>"),
        (["reward_function=length"], "RunConfig needs exactly one reward source"),
        (["reward_model_path=null", "reward_function=count"],
         "write it as 'count:<token>'"),
        (["reward_model_path=null", "reward_function=count:zebra"],
         "'zebra' is not one token of the policy's tokenizer"),
        (["ppo.optimizer.learnin_rate=1e-3"], "Did you mean 'learning_rate'?"),
        (["ppo.learning_rate=1e-3"], "Config key 'ppo.learning_rate' has moved to "
                                     "'ppo.optimizer.learning_rate'"),
        (["ppo.max_new_tokens=64"], "Config key 'ppo.max_new_tokens' has moved to "
                                    "'ppo.sampling.max_new_tokens' "
                                    "(PPOConfig.sampling.max_new_tokens); write "
                                    "'ppo.sampling.max_new_tokens' instead."),
        (["preset=poetry"], "RunConfig.preset='poetry' is invalid: choose one of"),
        (["policy_path=/nonexistent"], "RunConfig.policy_path='/nonexistent': no Hugging Face"),
        (["ppo.num_minibatches=3"], "PPOConfig.batch_size=4 is invalid"),
        (["run.save_every=0"], "RunConfig.run.save_every=0 is invalid: use an int >= 1"),
        (["updates_per_run=1"], "Config key 'updates_per_run' has moved to 'run.updates_per_run' "
                                "(RunConfig.run.updates_per_run); write 'run.updates_per_run' "
                                "instead."),
        (["run.updates_per_run=0"], "RunConfig.run.updates_per_run=0 is invalid: use an int >= 1 "
                                    "or null"),
    ],
)
def test_bad_inputs_get_one_clear_error(files, capsys, tmp_path, overrides, message):
  status = main(["train", str(files / "run.yaml"), f"run_dir={tmp_path / 'run'}", *overrides])
  err = capsys.readouterr().err
  assert status == 2
  assert message in err, err
  assert err.startswith("jax-ppo train: error: ")
  assert not (tmp_path / "run").exists()  # failed before writing anything


def test_eval_and_export_errors(files, capsys, tmp_path):
  assert main(["eval", "--run-dir", str(tmp_path), "--prompts", str(files / "eval.jsonl")]) == 2
  assert "has no config.yaml; pass the run folder written by `jax-ppo train`" in (
      capsys.readouterr().err)
  for command in ("eval", "export"):
    extra = ["--prompts", str(files / "eval.jsonl")] if command == "eval" else ["--out",
                                                                               str(tmp_path)]
    assert main([command, "--run-dir", str(files / "missing"), *extra]) == 2
    err = capsys.readouterr().err
    assert err == (f"jax-ppo {command}: error: Run folder '{files / 'missing'}' does not exist; "
                   "pass the run_dir of a `jax-ppo train` run.\n")
  with pytest.raises(SystemExit):
    main(["eval", "--prompts", "x.txt"])  # --run-dir is required (argparse)


def test_presets_apply_below_the_file_and_the_overrides(files):
  cfg = run_config.load_run_config([str(files / "run.yaml"), "preset=creative", "ppo.clip_eps=0.3"])
  assert cfg.ppo.entropy_coef == 0.05  # from the preset
  assert cfg.ppo.batch_size == 4  # the file beats the preset (creative: 128)
  assert cfg.ppo.clip_eps == 0.3  # the command line beats both
  assert cfg.ppo.optimizer.learning_rate == 1e-3


def test_a_preset_merges_key_by_key_into_the_optimizer_block(tmp_path):
  path = tmp_path / "run.yaml"
  path.write_text("policy_path: p\nprompts_path: q.txt\nrun_dir: r\nreward_function: length\n"
                  "preset: creative\nppo: {optimizer: {adam_eps: 1.0e-8}}\n")
  cfg = run_config.load_run_config([str(path)])
  assert cfg.ppo.optimizer.adam_eps == 1e-8  # the file's
  assert cfg.ppo.optimizer.learning_rate == 5e-6  # the preset's, kept
  assert cfg.ppo.optimizer.lr_schedule == "linear"  # PPO's default
  assert cfg.ppo.clip_eps == 0.1


def test_a_run_folder_saved_with_flat_optimizer_keys_reads_with_the_same_meaning(tmp_path):
  """A config.yaml written before the optimizer block (`ppo.learning_rate`, ...) is read by
  `saved_run_config` (eval, export, resume) as the same run; a new file with the old key is one
  error naming the new one."""
  path = tmp_path / "config.yaml"
  path.write_text("policy_path: p\nprompts_path: q.txt\nrun_dir: r\nreward_function: length\n"
                  "ppo: {batch_size: 4, learning_rate: 1.0e-3, lr_schedule: constant, "
                  "warmup_steps: 2, max_grad_norm: null, total_updates: 3}\n")
  cfg = run_config.saved_run_config(tmp_path)
  assert cfg.ppo.optimizer == PPOOptimizer(learning_rate=1e-3, lr_schedule="constant",
                                           warmup_steps=2, max_grad_norm=None)
  assert cfg.ppo.batch_size == 4 and cfg.ppo.total_updates == 3
  with pytest.raises(ValueError, match="'ppo.learning_rate' has moved to "
                                       "'ppo.optimizer.learning_rate'"):
    run_config.load_run_config([str(path)])


def test_a_run_folder_saved_with_flat_run_keys_resumes_with_the_same_meaning(tmp_path):
  """A config.yaml (or a checkpoint's config) written before the `run` block (`save_every`,
  `updates_per_run`, ...) reads as the same run, and resuming compares it with the new config:
  the run block may change, any other field may not; a config file with the old keys is one error
  naming the new key."""
  flat = {"policy_path": "p", "prompts_path": "q.txt", "run_dir": "r",
          "reward_function": "length", "updates_per_run": 2, "save_every": 5, "keep_last": 1,
          "best_metric": "objective/scores", "log_samples_every": 0, "tensorboard": False,
          "wandb": True, "wandb_init": {"project": "x"}, "plots": False, "progress": False,
          "rollback": True, "rollback_lr_factor": 0.25, "max_rollbacks": 1,
          "ppo": {"batch_size": 4, "total_updates": 3}}
  (tmp_path / "config.yaml").write_text(yaml.safe_dump(flat, sort_keys=False))
  cfg = run_config.saved_run_config(tmp_path)
  assert cfg.run == PPORunFolder(
      updates_per_run=2, save_every=5, keep_last=1, best_metric="objective/scores",
      log_samples_every=0, tensorboard=False, wandb=True, wandb_init={"project": "x"},
      plots=False, progress=False, rollback=True, rollback_lr_factor=0.25, max_rollbacks=1)
  assert set(run_config.RunConfig.MOVED_KEYS) == set(PPO_RUN_FIELDS) == (
      {f.name for f in dataclasses.fields(PPORunFolder)})
  with pytest.raises(ValueError, match="Config key 'updates_per_run' has moved to "
                                       "'run.updates_per_run'"):
    run_config.load_run_config([str(tmp_path / "config.yaml")])
  # Resuming: the saved flat keys against today's config (what the run loop and the checkpoints
  # compare): another run block resumes, another PPO field does not.
  now = dataclasses.replace(cfg, run=PPORunFolder(save_every=1, updates_per_run=None))
  check_config(flat, config_to_dict(now), where="r", ignore=now.run_options().resume_ignore,
               config_type=run_config.RunConfig)
  other = dataclasses.replace(now, ppo=dataclasses.replace(now.ppo, total_updates=4))
  with pytest.raises(CheckpointConfigMismatch, match=r"ppo\.total_updates: saved 3, now 4"):
    check_config(flat, config_to_dict(other), where="r", ignore=other.run_options().resume_ignore,
                 config_type=run_config.RunConfig)


def test_a_run_folder_saved_with_flat_sampling_keys_reads_with_the_same_meaning(tmp_path):
  """A config.yaml written before the sampling block (`ppo.temperature`, `ppo.max_new_tokens`,
  ...) is read by `saved_run_config` (eval, export, resume) as the same run; a config file
  with the old keys, or one giving a key both ways, is one error naming the new key."""
  head = "policy_path: p\nprompts_path: q.txt\nrun_dir: r\nreward_function: length\n"
  path = tmp_path / "config.yaml"
  path.write_text(head + "ppo: {batch_size: 4, max_new_tokens: 16, temperature: 0.9, top_k: 5, "
                  "top_p: 0.8, stop_token_ids: [2, 3], pad_token_id: 1, total_updates: 3}\n")
  cfg = run_config.saved_run_config(tmp_path)
  assert cfg.ppo.sampling == PPOSampling(max_new_tokens=16, temperature=0.9, top_k=5, top_p=0.8,
                                         stop_token_ids=(2, 3), pad_token_id=1)
  assert cfg.ppo.batch_size == 4 and cfg.ppo.total_updates == 3
  with pytest.raises(ValueError, match=r"Config key 'ppo.max_new_tokens' has moved to "
                                       r"'ppo.sampling.max_new_tokens' \(PPOConfig.sampling."
                                       r"max_new_tokens\); write 'ppo.sampling.max_new_tokens'"):
    run_config.load_run_config([str(path)])
  path.write_text(head + "ppo: {temperature: 0.9, sampling: {temperature: 0.5}}\n")
  with pytest.raises(ValueError, match="Config keys 'temperature' and 'sampling.temperature' of "
                                       "PPOConfig are both given"):
    run_config.saved_run_config(tmp_path)


def test_prompt_files_and_builtin_rewards(files, tmp_path):
  from types import SimpleNamespace

  from jax_ppo.models import load_tokenizer

  tok = load_tokenizer(str(files / "policy"))
  tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}story"
  path = tmp_path / "chat.jsonl"
  path.write_text(json.dumps({"messages": [{"role": "user", "content": "the movie"}]}) + "\n\n"
                  + json.dumps({"prompt": "a good plot"}) + "\n")
  data = run.load_prompts(path, tok, seed=3)
  assert data.prompts == [tok("the movie story")["input_ids"], tok("a good plot")["input_ids"]]
  assert data.texts == ["the movie story", "a good plot"] and data.seed == 3
  path.write_text(json.dumps({"text": "x"}) + "\n")
  with pytest.raises(ValueError, match="chat.jsonl', line 1: expected an object with a "
                                       "\"prompt\" string"):
    run.load_prompts(path, tok)
  (tmp_path / "p.csv").write_text("a\n")
  with pytest.raises(ValueError, match="--prompts=.*unsupported suffix '.csv'"):
    run.load_prompts(tmp_path / "p.csv", tok, field="--prompts")
  (tmp_path / "empty.txt").write_text("\n \n")
  with pytest.raises(ValueError, match="holds no prompts"):
    run.load_prompts(tmp_path / "empty.txt", tok)

  good = tok.get_vocab()["good"]
  response = np.array([[good, 5, good, 0], [3, good, 0, 0]])
  rollout = SimpleNamespace(prompt_ids=np.ones((2, 2), np.int32),
                            prompt_mask=np.ones((2, 2), np.int32), response_ids=response,
                            response_mask=np.array([[1, 1, 1, 0], [1, 0, 0, 0]], bool))
  assert specs.reward_function("count:good", tok)(rollout).tolist() == [2.0, 0.0]
  assert specs.reward_function(f"count:{good}", tok)(rollout).tolist() == [2.0, 0.0]
  assert specs.reward_function("length", tok)(rollout).tolist() == [3.0, 1.0]


def test_library_errors_are_one_line_and_other_errors_keep_their_traceback(monkeypatch, capsys):
  from safetensors import SafetensorError

  from jax_ppo.checkpoint import CheckpointError

  def fail_with(error):
    def run_training(config):
      raise error
    monkeypatch.setattr(run, "run_training", run_training)
    monkeypatch.setattr(run_config, "load_run_config",
                        lambda argv: SimpleNamespace(run_dir="r", distributed=None))

  for error, line in [
      (ValueError("first\n  second"), "error: first second"),
      (FileNotFoundError("no such file"), "error: no such file"),
      (CheckpointError("step 3 is unreadable"), "error: step 3 is unreadable"),
      (SafetensorError("incomplete metadata"), "error: unreadable safetensors file: incomplete"),
  ]:
    fail_with(error)
    assert main(["train", "x.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jax-ppo train: " + line) and err.count("\n") == 1, err
  fail_with(KeyError("a bug"))
  with pytest.raises(KeyError, match="a bug"):  # unexpected: the traceback is shown
    main(["train", "x.yaml"])


@pytest.mark.parametrize("command", ["eval", "export"])
def test_eval_and_export_join_the_job_the_environment_describes(monkeypatch, capsys, tmp_path,
                                                                 command):
  """`jax-ppo eval/export` call `initialize()` (which reads JAX's variables, SLURM, a TPU pod)
  before any work, so every process of a multi-host job runs them together."""
  import jax_ppo.parallel.distributed as distributed

  calls = []

  def initialize(config=None, **kwargs):  # records the call instead of joining a job
    calls.append(config)
    return False

  monkeypatch.setattr(distributed, "initialize", initialize)
  extra = ["--prompts", "p.txt"] if command == "eval" else ["--out", str(tmp_path / "out")]
  assert main([command, "--run-dir", str(tmp_path / "missing"), *extra]) == 2
  assert calls == [None]  # default DistributedConfig: the environment decides
  assert "does not exist" in capsys.readouterr().err


PROGRAM = """
import json, sys
from jax_ppo import cli
try:
  cli.run()  # the `jax-ppo` program on sys.argv[1:]
except SystemExit as e:
  print("PROGRAM " + json.dumps({"status": e.code, "torch_imported": "torch" in sys.modules}))
"""
"""`python -c PROGRAM train ...`: runs the `jax-ppo` program, then says whether torch got in."""

LIBRARIES = """
import json, sys
from jax_ppo import cli
hidden = cli.hide_torch_from_libraries()
import tensorboardX
from transformers import AutoConfig, AutoTokenizer
AutoConfig.from_pretrained(sys.argv[1]); AutoTokenizer.from_pretrained(sys.argv[1])
tensorboardX.SummaryWriter(sys.argv[2]).close()
record = {"hidden": hidden, "torch_imported": "torch" in sys.modules}
import torch  # code of the user's may still import it
record["user_import"] = torch.ones(2).sum().item()
print("LIBRARIES " + json.dumps(record))
"""
"""`python -c LIBRARIES FOLDER LOGDIR`: what the libraries do after `hide_torch_from_libraries`."""


def _subprocess(code, args, marker, **env):
  from jax_ppo.cli import TORCH_ENV

  environ = {k: v for k, v in os.environ.items() if k != TORCH_ENV}
  environ.update(env)
  out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                       env=environ, timeout=900)
  lines = [line for line in out.stdout.splitlines() if line.startswith(marker + " ")]
  assert out.returncode == 0 and lines, out.stderr[-3000:]
  assert "PyTorch was not found" not in out.stderr  # transformers' advice: it is installed
  return json.loads(lines[-1].removeprefix(marker + " "))


@pytest.mark.parametrize("opt_in", [False, True])
def test_hide_torch_from_libraries(files, tmp_path, opt_in):
  """With torch installed (it is, here), transformers' config and tokenizer classes and
  tensorboardX's writer load without importing it once it is hidden, and the user can import it
  afterwards; with JAX_PPO_TORCH=1 nothing is hidden and transformers imports it again."""
  env = {"JAX_PPO_TORCH": "1"} if opt_in else {}
  record = _subprocess(LIBRARIES, [str(files / "policy"), str(tmp_path / "tb")], "LIBRARIES",
                       **env)
  assert record == {"hidden": not opt_in, "torch_imported": opt_in, "user_import": 2.0}


def test_the_program_trains_without_importing_torch(files, tmp_path):
  """`jax-ppo train` as installed (`cli.run`) where torch is installed: the policy and reward
  model load through transformers, TensorBoard logs (on by default), one update runs, and torch
  never enters the process."""
  record = _subprocess(PROGRAM, ["train", str(files / "run.yaml"), f"run_dir={tmp_path / 'run'}",
                                 "ppo.total_updates=1"], "PROGRAM")
  assert record == {"status": 0, "torch_imported": False}, record
  assert any((tmp_path / "run" / "tensorboard").iterdir())


def test_the_program_names_the_switch_when_a_hidden_torch_is_missed(monkeypatch, capsys):
  from jax_ppo import cli

  def needs_torch(argv):
    raise ImportError("this pipeline requires the PyTorch library but it was not found")

  monkeypatch.setattr(cli, "hide_torch_from_libraries", lambda: True)
  monkeypatch.setattr(cli, "main", needs_torch)
  monkeypatch.setattr(sys, "argv", ["jax-ppo", "train", "run.yaml"])
  with pytest.raises(ImportError, match="PyTorch"):  # the error itself keeps its traceback
    cli.run()
  assert "JAX_PPO_TORCH=1" in capsys.readouterr().err
  monkeypatch.setattr(sys, "argv", ["jax-ppo", "config", "train"])  # loads no model: no hiding
  with pytest.raises(ImportError, match="PyTorch"):
    cli.run()
  assert capsys.readouterr().err == ""
