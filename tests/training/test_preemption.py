"""Preemption: SIGTERM or SIGINT during training saves a checkpoint and exits 0, and running the
same command again ends exactly where an uninterrupted run ends (replay buffer included).

The end-to-end tests run the real command line (`python -m jax_ppo.cli train cfg.yaml`) in a
subprocess on a tiny random GPT-2 folder built here, send the signal once the first update is in
`metrics.jsonl`, and compare with an uninterrupted run of the same command: every logged metric
(except timings) and every array of the final checkpoint (parameters, optimizer state, KL
controller, RNG) bit-equal on CPU. The subprocesses share a persistent compilation cache.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml
from flax import nnx

from jax_ppo.models.transformer import CausalLM
from jax_ppo.ppo import PPOTrainer
from jax_ppo.rewards import TokenScorer
from jax_ppo.training import RunOptions
from jax_ppo.training.loop import PREEMPTION_SIGNALS
from tests.ppo.conftest import CONFIG, MODEL, count_target, prompts

pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMING = ("time/", "tokens_per_s", "eps", "mfu")
WORDS = "the a movie film plot was is very good great fun bad dull and but I liked it".split()
PROMPTS = ["the movie was", "I liked the plot and", "the film is", "it was very", "a plot",
           "the film was not", "I liked it but", "a very"]


def _jsonl(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """A tiny random GPT-2 policy folder with its tokenizer, a prompts file and a run config."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  tokenizers = pytest.importorskip("tokenizers")
  root = tmp_path_factory.mktemp("preempt")
  vocab = {w: i for i, w in enumerate(["<pad>", "<|endoftext|>", "<unk>", *WORDS])}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<pad>", unk_token="<unk>"
  )
  config = transformers.GPT2Config(
      vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2, n_positions=64,
      bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
  )
  torch.manual_seed(0)
  transformers.GPT2LMHeadModel(config).save_pretrained(root / "policy")
  tok.save_pretrained(root / "policy")
  (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
  (root / "jax_cache").mkdir()
  return root


def _config(files, name: str) -> pathlib.Path:
  cfg = {
      "policy_path": str(files / "policy"),
      "reward_function": "count:good",
      "prompts_path": str(files / "prompts.txt"),
      "run_dir": str(files / name),
      # save_every: only the end of train() (or a preemption) saves
      "run": {"save_every": 1000, "log_samples_every": 0, "progress": False,
              "tensorboard": False},
      "ppo": {"batch_size": 4, "num_minibatches": 1, "ppo_epochs": 1,
              "sampling": {"max_new_tokens": 4, "temperature": 1.0},
              "total_updates": 40, "optimizer": {"learning_rate": 1e-3},
              "replay_buffer_size": 2, "replay_batches_per_update": 1},
  }
  path = files / f"{name}.yaml"
  path.write_text(yaml.safe_dump(cfg))
  return path


def _train(files, config: pathlib.Path, *, send: int | None = None):
  """Runs `python -m jax_ppo.cli train config`; with `send`, sends that signal once the first
  update is logged. Returns `(returncode, stdout, stderr, seconds from the signal to exit)`."""
  # XLA:CPU's cheaper code generation (compile-bound runs; every run compared uses it).
  flags = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]).strip()
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags,
         "JAX_COMPILATION_CACHE_DIR": str(files / "jax_cache"),
         "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
         "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
  proc = subprocess.Popen(
      [sys.executable, "-m", "jax_ppo.cli", "train", str(config)], cwd=ROOT, env=env,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
  )
  waited = None
  if send is not None:
    metrics = pathlib.Path(yaml.safe_load(config.read_text())["run_dir"]) / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.is_file() and metrics.read_text().strip()):
      assert proc.poll() is None, proc.communicate()
      assert time.monotonic() < deadline, "no update logged within 600 s"
      time.sleep(0.05)
    proc.send_signal(send)
    sent = time.monotonic()
  try:
    out, err = proc.communicate(timeout=900)
  except subprocess.TimeoutExpired:
    proc.kill()
    raise
  if send is not None:
    waited = time.monotonic() - sent
  return proc.returncode, out, err, waited


def _final_state(run_dir: pathlib.Path):
  ckpt = run_dir / "checkpoints"
  step = max(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
  with ocp.StandardCheckpointer() as c:
    return step, jax.tree.map(np.asarray, c.restore(ckpt / str(step) / "state"))


@pytest.fixture(scope="module")
def reference(files):
  """The uninterrupted run."""
  code, out, err, _ = _train(files, _config(files, "ref"))
  assert code == 0, err
  assert json.loads(out.strip().splitlines()[-1])["step"] == 40
  return files / "ref"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_preempted_cli_run_resumes_to_the_uninterrupted_result(files, reference, sig):
  name = f"run_{sig.name}"
  config = _config(files, name)
  code, out, err, waited = _train(files, config, send=sig)
  assert code == 0, err
  assert waited < 60
  summary = json.loads(out.strip().splitlines()[-1])
  stopped_at = summary["step"]
  assert summary["preempted"] == sig.name and 1 <= stopped_at < 40
  assert f"stopped by {sig.name}" in err and "run the same command again" in err
  assert f"jax-ppo train {config}" in err
  run_dir = files / name
  assert _final_state(run_dir)[0] == stopped_at  # the preemption checkpoint
  assert [r["step"] for r in _jsonl(run_dir / "metrics.jsonl")] == list(range(1, stopped_at + 1))

  code, out, err, _ = _train(files, config)  # the same command again
  assert code == 0, err
  assert json.loads(out.strip().splitlines()[-1])["step"] == 40
  step, state = _final_state(run_dir)
  ref_step, ref_state = _final_state(reference)
  assert step == ref_step == 40
  jax.tree.map(np.testing.assert_array_equal, state, ref_state)
  logged, ref_logged = _jsonl(run_dir / "metrics.jsonl"), _jsonl(reference / "metrics.jsonl")
  assert [r["step"] for r in logged] == list(range(1, 41))
  for got, want in zip(logged, ref_logged, strict=True):
    exact = {k: v for k, v in want.items() if not k.startswith(TIMING)}
    assert {k: got[k] for k in exact} == exact


# -- in process: the handlers, abandoning an update ------------------------------------------------


def _trainer(run_dir, reward=None):
  return PPOTrainer(CONFIG, CausalLM(MODEL, rngs=nnx.Rngs(0)),
                    reward=reward if reward is not None else TokenScorer(count_target),
                    prompts=prompts(), peak_flops=1e11, run_dir=run_dir,
                    run_options=RunOptions(save_every=100, progress=False, tensorboard=False,
                                           log_samples_every=0))


def test_signal_during_train_checkpoints_and_restores_the_handlers(tmp_path):
  previous = {s: signal.getsignal(s) for s in PREEMPTION_SIGNALS}
  seen = []

  def preempt_at_step_2(metrics):
    seen.append({s: signal.getsignal(s) for s in PREEMPTION_SIGNALS})
    if metrics["step"] == 2:
      os.kill(os.getpid(), signal.SIGTERM)
      os.kill(os.getpid(), signal.SIGINT)  # a second signal while stopping changes nothing

  with _trainer(tmp_path) as trainer:
    history = trainer.train(5, callback=preempt_at_step_2)
    assert trainer.preempted == history.preempted == "SIGTERM"
    assert [m["step"] for m in history] == [1, 2]
    assert trainer.checkpointer.steps() == [2]
  assert all(h != previous[s] for h in seen for s, h in h.items())  # ours while training
  assert {s: signal.getsignal(s) for s in PREEMPTION_SIGNALS} == previous  # restored

  with _trainer(tmp_path) as resumed:
    assert resumed.step_count == 2 and resumed.preempted is None
    assert len(resumed.train(1)) == 1 and resumed.preempted is None


def test_a_signal_during_the_rollout_abandons_that_update(tmp_path):
  calls = []

  def reward(prompts, responses):
    calls.append(1)
    if len(calls) == 3:  # during the third update, before it changes anything
      os.kill(os.getpid(), signal.SIGINT)
    return [float(r.count(7)) for r in responses]

  with _trainer(tmp_path, reward=reward) as trainer:
    history = trainer.train(5)
    assert trainer.preempted == "SIGINT"
    assert [m["step"] for m in history] == [1, 2] and trainer.step_count == 2
    assert trainer.data_position == 2
    assert trainer.checkpointer.steps() == [2]


def test_no_handlers_outside_the_main_thread_or_without_a_run_folder(tmp_path):
  handlers = []

  def record(metrics):
    handlers.append(signal.getsignal(signal.SIGTERM))

  previous = signal.getsignal(signal.SIGTERM)
  trainer = _trainer(None)
  trainer.train(1, callback=record)
  with _trainer(tmp_path) as in_thread:
    worker = threading.Thread(target=lambda: in_thread.train(1, callback=record))
    worker.start()
    worker.join()
  assert handlers == [previous, previous]
