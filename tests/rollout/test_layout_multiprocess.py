"""The tensor-parallel rollout (`SamplingConfig.decode_tensor`) in a job of 2 processes x 4 fake
CPU devices (`jax.distributed`, gloo collectives on 127.0.0.1) draws the tokens and log-probs of
the rollout on the FSDP mesh, and both equal the same rollouts in one process with 8 devices
(`scripts/decode_tensor_multiprocess.py`): the regrouped mesh, the copy of the policy's matrices
it makes and the move of the rows back to the training mesh all span the processes.
"""

import pathlib

import numpy as np
import pytest

from tests.parallel.multidevice import read_process_result, run_job_beside_reference

SCRIPT = pathlib.Path(__file__).resolve().parent / "scripts" / "decode_tensor_multiprocess.py"
LAYOUTS = ("fsdp", "decode_tensor=2", "decode_tensor=4")
TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("decode_tensor_multiprocess")
  run_job_beside_reference(SCRIPT, root, devices=8)
  return {name: [read_process_result(root, name, pid) for pid in pids]
          for name, pids in (("one", [0]), ("two", [0, 1]))}


@pytest.mark.slow
def test_each_process_samples_its_rows_on_the_meshes_of_all_devices(runs):
  for name, results in runs.items():
    for pid, r in enumerate(results):
      assert (r["process"], r["processes"], r["devices"]) == (pid, len(results), 8)
      # 8 prompts over the 8 devices of the batch axes: each process filled only its 4
      assert r["rows"] == ([0, 8] if name == "one" else [4 * pid, 4 * pid + 4])
      assert sorted(r["layouts"]) == sorted(LAYOUTS)
      assert r["layouts"]["decode_tensor=2"]["mesh"] == {"data": 4, "fsdp": 1, "tensor": 2}
      assert r["layouts"]["decode_tensor=4"]["mesh"] == {"data": 2, "fsdp": 1, "tensor": 4}
      assert all(r["layouts"][k]["global"] == (name == "two") for k in LAYOUTS)


@pytest.mark.slow
def test_the_tensor_parallel_rollouts_of_two_processes_match_fsdp_and_one_process(runs):
  reference = runs["one"][0]["layouts"]["fsdp"]
  tokens = np.asarray(reference["tokens"])
  assert tokens.shape == (16, 9) and np.asarray(reference["mask"]).sum() > 16  # 8 prompts x 2
  for results in runs.values():
    for r in results:
      for layout in LAYOUTS:
        got = r["layouts"][layout]
        assert got["tokens"] == reference["tokens"], layout
        assert got["mask"] == reference["mask"], layout
        np.testing.assert_allclose(got["logprobs"], reference["logprobs"], atol=TOL,
                                   err_msg=layout)
