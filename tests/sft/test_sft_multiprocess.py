"""`jax-ppo sft` over 2 processes x 2 fake CPU devices (`jax.distributed`, gloo collectives on
127.0.0.1) equals the same run in one process with 4 devices and the same mesh: a tiny random
Llama checkpoint, packed rows, gradient accumulation 2, 2 steps, a checkpoint, the resume to 3,
the held-out evaluation and the export.

The mesh (data=1, fsdp=2, tensor=2) puts `fsdp` across the processes: each holds half of every
parameter and optimizer moment and places only its own half of each batch's rows into the
global arrays; only process 0 writes the metrics, config and exported model (the processes
record their file writes with an audit hook, `scripts/multiprocess_sft.py`).
"""

import json
import pathlib

import numpy as np
import pytest
import safetensors.numpy
import yaml

from tests import tiny_hf_run
from tests.parallel.multidevice import read_process_result, run_job_beside_reference

SCRIPT = pathlib.Path(__file__).resolve().parent / "scripts" / "multiprocess_sft.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("multiprocess_sft")
  data = tiny_hf_run.write_data(root)
  config = {
      "model_path": tiny_hf_run.make_checkpoint(root), "train_path": data["sft"],
      "run_dir": str(root / "unused"), "dtype": "float32",
      "sft": {"max_length": 16, "batch_size": 4, "gradient_accumulation_steps": 2,
              "packing": True, "total_steps": 3, "eval_fraction": 0.25, "eval_every": 2,
              "optimizer": {"learning_rate": 1e-2, "lr_schedule": "constant"}},
      "mesh": {"data": 1, "fsdp": 2, "tensor": 2},
      "run": {"save_every": 1, "tensorboard": False, "progress": False},
      "compilation_cache_dir": str(root / "xla_cache"),
  }
  (root / "config.yaml").write_text(yaml.safe_dump(config))
  run_job_beside_reference(SCRIPT, root, devices=4)
  return root


@pytest.mark.slow
def test_two_processes_train_resume_evaluate_and_export_like_one(runs):
  root = runs
  for name, pids in (("one", [0]), ("two", [0, 1])):
    for pid in pids:
      r = read_process_result(root, name, pid)
      assert r["codes"] == [0, 0] and r["devices"] == 4
      assert r["processes"] == len(pids) and r["process"] == pid
      first, second = r["summaries"]
      assert (first["step"], first["complete"], first["export_dir"]) == (2, False, None)
      assert (second["step"], second["steps_run"], second["complete"]) == (3, 1, True)
      # Each process placed only its rows of every global batch (fsdp spans the processes).
      assert r["placed"] and all(local * len(pids) == rows for local, rows in r["placed"])
  one, two = (read_process_result(root, name, 0)["summaries"][1] for name in ("one", "two"))
  # The held-out evaluation is global: the same token mean on both.
  assert two["eval/loss"] == pytest.approx(one["eval/loss"], abs=1e-5)
  assert two["train/loss"] == pytest.approx(one["train/loss"], abs=1e-5)
  logs = [[json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
          for name in ("one", "two")]
  assert [m["step"] for m in logs[1] if "train/loss" in m] == [1, 2, 3]
  for a, b in zip(*logs, strict=True):
    assert a.keys() == b.keys()
    for key in ("train/loss", "train/tokens", "train/grad_norm", "eval/loss"):
      if key in a:
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), key
  # The exported models are the same, and training moved them away from the start.
  exported = [safetensors.numpy.load_file(root / name / "hf_model" / "model.safetensors")
              for name in ("one", "two")]
  start = safetensors.numpy.load_file(root / "llama" / "model.safetensors")
  assert sorted(exported[0]) == sorted(exported[1]) == sorted(start)
  for key in exported[0]:
    np.testing.assert_allclose(exported[1][key], exported[0][key], atol=1e-5, err_msg=key)
  assert max(float(np.max(np.abs(exported[0][k] - start[k]))) for k in start) > 1e-3


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
  for path in ("two/metrics.jsonl", "two/config.yaml", "two/hf_model/config.json",
               "two/hf_model/tokenizer_config.json"):
    assert path in written, (path, sorted(written))
  assert sorted(p.name for p in (root / "two").iterdir()) == sorted(
      p.name for p in (root / "one").iterdir())
  assert sorted(p.name for p in (root / "two" / "hf_model").iterdir()) == sorted(
      p.name for p in (root / "one" / "hf_model").iterdir())
