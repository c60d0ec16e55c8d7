"""`jax-ppo reward` over 2 processes x 4 fake CPU devices (`jax.distributed`, gloo collectives on
127.0.0.1) equals the same run in one process with 8 devices and the same mesh (data=2, fsdp=2,
tensor=2): a tiny random Llama trunk with a new score head, gradient accumulation 2, 2 steps,
the held-out evaluation, the normalisation on policy samples drawn on the mesh, the export.

Each process puts only its own rows of every batch into the global arrays, and only process 0
writes the metrics, config, normalisation record and exported model (the processes record their
file writes with an audit hook, `scripts/multiprocess_reward.py`).
"""

import json
import pathlib

import numpy as np
import pytest
import yaml

from tests import tiny_hf_run
from tests.parallel.multidevice import read_process_result, run_job_beside_reference

SCRIPT = pathlib.Path(__file__).resolve().parent / "scripts" / "multiprocess_reward.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  pytest.importorskip("torch", reason="torch builds the tiny Hugging Face model")
  root = tmp_path_factory.mktemp("multiprocess_reward")
  data = tiny_hf_run.write_data(root)
  config = {
      "model_path": tiny_hf_run.make_checkpoint(root), "train_path": data["prefs"],
      "eval_path": data["prefs"], "run_dir": str(root / "unused"), "dtype": "float32",
      "reward": {"batch_size": 8, "gradient_accumulation_steps": 2, "total_steps": 2,
                 "max_length": 16, "eval_batch_size": 8,
                 # adam_eps = 1: steps proportional to the gradient (the score head's bias has
                 # a zero gradient up to rounding, which eps = 1e-8 would turn into +-lr).
                 "optimizer": {"learning_rate": 0.1, "lr_schedule": "constant", "adam_eps": 1.0}},
      "normalise_samples": 8, "normalise_max_new_tokens": 4,
      # data spans both processes: process i holds rows [4i, 4i + 4) of each batch of 8
      "mesh": {"data": 2, "fsdp": 2, "tensor": 2},
      "run": {"save_every": 1, "tensorboard": False, "progress": False},
      "compilation_cache_dir": str(root / "xla_cache"),
  }
  (root / "config.yaml").write_text(yaml.safe_dump(config))
  run_job_beside_reference(SCRIPT, root, devices=8)
  return root


def _metrics(root, name):
  return [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_processes_train_normalise_and_export_like_one(runs):
  import safetensors.numpy

  root = runs
  for name, pids in (("one", [0]), ("two", [0, 1])):
    for pid in pids:
      r = read_process_result(root, name, pid)
      assert r["code"] == 0 and r["devices"] == 8
      assert r["processes"] == len(pids) and r["process"] == pid
      # Each process put only its own rows of each training batch of 8 (and each eval or
      # scoring batch) into the global arrays: 4 rows with 2 processes, all 8 with one.
      assert r["rows"] and all(rows[0] == 8 for rows in r["rows"]), r["rows"]
      assert all(rows[1] == (8 if name == "one" else 4) for rows in r["rows"]), r["rows"]
  logs = [_metrics(root, name) for name in ("one", "two")]
  train = [[m for m in log if "train/loss" in m] for log in logs]
  assert [m["step"] for m in train[1]] == [1, 2] == [m["step"] for m in train[0]]
  for a, b in zip(*train, strict=True):
    for key in ("train/loss", "train/accuracy", "train/grad_norm", "lr"):
      assert b[key] == pytest.approx(a[key], abs=1e-5), key
  norms = [json.loads((root / name / "hf_model" / "reward_normalisation.json").read_text())
           for name in ("one", "two")]
  assert norms[0]["samples"] == norms[1]["samples"] == 8
  for key in ("gain", "bias", "mean", "std"):
    assert norms[1][key] == pytest.approx(norms[0][key], abs=1e-5, rel=1e-5), key
  exported = [safetensors.numpy.load_file(root / name / "hf_model" / "model.safetensors")
              for name in ("one", "two")]
  assert sorted(exported[0]) == sorted(exported[1]) and len(exported[0]) > 5
  for key in exported[0]:
    np.testing.assert_allclose(exported[1][key], exported[0][key], atol=1e-5, err_msg=key)


@pytest.mark.slow
def test_only_process_zero_writes_files(runs):
  root = runs
  main, other = (read_process_result(root, "two", pid)["writes"] for pid in (0, 1))
  assert [w for w in other if "/checkpoints" not in w[1]] == []
  written = {w[1].removeprefix(str(root) + "/") for w in main if w[0] in ("open", "os.rename")}
  # The export is written beside its folder and renamed into place (jax_ppo.training.export).
  assert "two/hf_model.export-tmp" in written and "two/hf_model" in written
  written = {p.replace(".export-tmp/", "/") for p in written}
  # (safetensors and tokenizers write from Rust, unseen by the audit hook)
  for path in ("two/metrics.jsonl", "two/config.yaml", "two/reward_normalisation.json",
               "two/hf_model/config.json", "two/hf_model/reward_normalisation.json",
               "two/hf_model/tokenizer_config.json"):
    assert path in written, (path, sorted(written))
  assert sorted(p.name for p in (root / "two").iterdir()) == sorted(
      p.name for p in (root / "one").iterdir())
