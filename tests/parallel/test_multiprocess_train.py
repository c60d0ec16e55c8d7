"""`jax-ppo train` over 2 processes x 4 fake CPU devices (`jax.distributed`, gloo collectives on
127.0.0.1) equals the same run in one process with 8 devices and the same mesh (issue #11 item
4): a tiny random Llama policy, a text reward function plus a reward model with a tokenizer of
its own (both score each process's rows on the host), GRPO, 2 updates, a checkpoint, the resume
to 3 updates with a greedy evaluation of held-out prompts after updates 2 and 3, then the export
of the policy and a greedy evaluation.

Each process reads only its own rows of every prompt batch, and only process 0 writes the
metrics, samples, config, plots, evaluation and the exported model (the processes record their
file writes with an audit hook, `scripts/multiprocess_train.py`).
"""

import json

import numpy as np
import pytest
import safetensors.numpy
import yaml
from multidevice import read_process_result, run_job_beside_reference

from tests import tiny_hf_run

SCRIPT = "multiprocess_train.py"


def _reward_model_with_own_tokenizer(root) -> str:
  """A tiny reward model whose tokenizer numbers the words in reverse order: its scorer decodes
  each process's rows and re-tokenizes them (docs/rlhf_details.md item 21)."""
  import tokenizers
  import transformers

  path = tiny_hf_run.make_reward_checkpoint(root)
  vocab = {w: i for i, w in enumerate([*tiny_hf_run.SPECIAL, *reversed(tiny_hf_run.WORDS)])}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
  transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<pad>", unk_token="<unk>",
  ).save_pretrained(path)
  return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("multiprocess_train")
  data = tiny_hf_run.write_data(root)
  config = {
      "policy_path": tiny_hf_run.make_checkpoint(root),
      "rewards": [{"function": "tiny_hf_run:score_good_words", "weight": 1.0, "name": "words"},
                  {"model_path": _reward_model_with_own_tokenizer(root), "weight": 0.5,
                   "name": "rm"}],
      "prompts_path": data["prompts"], "run_dir": str(root / "unused"),
      "eval_path": data["prompts"], "eval_every": 2,  # held-out metrics at steps 2 and 3
      "ppo": {"batch_size": 8, "n_samples": 2, "advantage_mode": "grpo", "num_minibatches": 1,
              "ppo_epochs": 1, "sampling": {"max_new_tokens": 4}, "total_updates": 3,
              "optimizer": {"learning_rate": 1e-2}},
      # fsdp spans both processes: parameters, optimizer state and rows are split over them
      "mesh": {"data": 1, "fsdp": 4, "tensor": 2},
      "run": {"save_every": 1, "log_samples_every": 1, "tensorboard": False, "progress": False,
              "plots": True},
      "compilation_cache_dir": str(root / "xla_cache"),
  }
  (root / "config.yaml").write_text(yaml.safe_dump(config))
  run_job_beside_reference(SCRIPT, root, devices=8)
  return root


@pytest.mark.slow
def test_two_processes_train_resume_and_export_like_one(runs):
  root = runs
  for name, pids in (("one", [0]), ("two", [0, 1])):
    for pid in pids:
      r = read_process_result(root, name, pid)
      assert r["codes"] == [0, 0] and r["step"] == 3 and r["devices"] == 8
      assert r["processes"] == len(pids) and r["process"] == pid
      assert r["retokenize"] == [None, True]  # (the reward model re-tokenizes the texts)
      # Each process read only its rows of each batch of 4 prompts (x 2 samples): with fsdp=4
      # over both processes' devices, process i holds prompts [2i, 2i + 2) (shard i of 2).
      shard = [None, None, 4] if name == "one" else [pid, 2, 2]
      assert r["batches"] == [[position, 4, *shard] for position in range(3)]
      # ... and tokenized only those (one process: every prompt at start, no lazy dataset).
      assert r["tokenized"] == ([] if name == "one" else [2, 2, 2])
  # The trained parameters agree (the same SPMD program, over gloo instead of in-process).
  one, two = np.load(root / "one_params.npz"), np.load(root / "two_params.npz")
  assert sorted(one.files) == sorted(two.files) and len(one.files) > 10
  for key in one.files:
    np.testing.assert_allclose(two[key], one[key], atol=1e-5, rtol=1e-5, err_msg=key)
  # ... and so do the logged metrics, step by step.
  logs = [[json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
          for name in ("one", "two")]
  assert [m["step"] for m in logs[1]] == [1, 2, 3] == [m["step"] for m in logs[0]]
  for a, b in zip(*logs, strict=True):
    for key in ("objective/scores", "objective/kl", "loss/total_avg", "reward/words", "reward/rm",
                "rollout/response_length"):
      assert b[key] == pytest.approx(a[key], abs=1e-4), key
  # The evaluation during training (every process samples and scores all held-out prompts):
  # after update 2 (eval_every) and 3 (the last), before and after the resume.
  for log in logs:
    assert [m["step"] for m in log if "eval/kl" in m] == [2, 3]
  for a, b in zip(*logs, strict=True):
    for key in [k for k in a if k.startswith("eval/")]:
      assert b[key] == pytest.approx(a[key], abs=1e-4), key
  samples = [[json.loads(line) for line in (root / name / "samples.jsonl").read_text().splitlines()]
             for name in ("one", "two")]
  assert len(samples[1]) == 3 * 4 == len(samples[0])
  for a, b in zip(*samples, strict=True):
    assert {**b, "reward": None} == {**a, "reward": None}
    assert b["reward"] == pytest.approx(a["reward"], abs=1e-4)
  # The greedy evaluation of the final checkpoint gives the same samples and metrics.
  evals = [json.loads((root / name / "eval" / "step_3.json").read_text())
           for name in ("one", "two")]
  responses = [[s["response"] for s in e["samples"]] for e in evals]
  assert responses[1] == responses[0]
  assert len(evals[0]["samples"]) == 8
  for key, value in evals[0]["metrics"].items():
    assert evals[1]["metrics"][key] == pytest.approx(value, abs=1e-4), key
  # The exported models are the same.
  exported = [safetensors.numpy.load_file(root / f"{name}_export" / "model.safetensors")
              for name in ("one", "two")]
  assert sorted(exported[0]) == sorted(exported[1])
  for key in exported[0]:
    np.testing.assert_allclose(exported[1][key], exported[0][key], atol=1e-5, err_msg=key)


@pytest.mark.slow
def test_only_process_zero_writes_files(runs):
  root = runs
  main, other = (read_process_result(root, "two", pid)["writes"] for pid in (0, 1))
  outside_checkpoints = [w for w in other if "/checkpoints" not in w[1]]
  assert outside_checkpoints == []
  written = {w[1].removeprefix(str(root) + "/") for w in main if w[0] in ("open", "os.rename")}
  # The export is written beside its folder and renamed into place (jax_ppo.training.export).
  assert "two_export.export-tmp" in written and "two_export" in written
  written = {p.replace(".export-tmp/", "/") for p in written}
  # (safetensors and tokenizers write from Rust, unseen by the audit hook)
  for path in ("two/metrics.jsonl", "two/samples.jsonl", "two/config.yaml", "two/eval/step_3.json",
               "two_export/config.json", "two_export/generation_config.json",
               "two_export/tokenizer_config.json"):
    assert path in written, (path, sorted(written))
  assert any(p.startswith("two/plots/") and p.endswith(".png") for p in written)
  assert sorted(p.name for p in (root / "two").iterdir()) == sorted(
      p.name for p in (root / "one").iterdir())
