"""Host-side rewards over 2 processes x 2 fake CPU devices (scripts/multiprocess_rewards.py):
a Python reward function scores only its process's rows of a global rollout, the global scores
are the single-process ones, a `CombinedScorer` logs the mean over every row, and a function
failing on one process's rows stops both processes with an error naming the cause; a trainer
without a mesh, or with roles on sub-meshes of their own, is refused in a multi-process job."""

import json

import numpy as np
import pytest
from multidevice import run_processes_of


@pytest.mark.slow
def test_function_rewards_score_local_rows_and_fail_together(tmp_path):
  run_processes_of("multiprocess_rewards.py", str(tmp_path), num_processes=2,
                   devices_per_process=2, timeout=240)
  results = [json.loads((tmp_path / f"result{i}.json").read_text()) for i in range(2)]
  expected = results[0]["expected"]
  assert len(set(expected)) > 2  # the rows differ: a mix-up of rows would show
  for pid, r in enumerate(results):
    assert r["global"] and r["rows"] == [4 * pid, 4 * pid + 4]
    assert r["rows_seen"] == [4, 4]  # each call decoded and scored this process's 4 rows only
    assert r["scores"] == expected
    assert r["combined"] == [2.0 * x for x in expected]
    assert r["metric"] == pytest.approx(np.mean(expected))
  failing, other = results[1]["error"], results[0]["error"]
  assert failing[0] == "ValueError"
  assert "'nan_on_process_1' (process 1: rows 4 to 7 of 8" in failing[1]
  assert "non-finite scores at rows [0]" in failing[1]
  assert other[0] == "RewardFunctionError"
  assert "'nan_on_process_1' failed on the rows of another process" in other[1]
  for r in results:  # a multi-process run needs a mesh: refused before any model loads
    assert r["no_mesh"].startswith("RunConfig.mesh=None, but this is one of several processes")
    assert r["split_roles"].startswith("RunConfig.placement: roles on sub-meshes of their own")
