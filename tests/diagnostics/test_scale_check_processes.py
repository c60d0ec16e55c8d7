"""Two processes x 4 fake CPU devices over 127.0.0.1 (`jax.distributed`, gloo collectives) run
the same tiny PPO update as one device, with the batch split over all 8 devices, and agree on
the updated parameters and the loss within 1e-4 (issue #11 item 4;
`jax_ppo.diagnostics.scale_check`).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jax_ppo.diagnostics import scale_check

SIZE = {"batch_size": 8, "hidden_size": 16, "num_layers": 1, "max_new_tokens": 4, "ppo_epochs": 1}


@pytest.mark.slow
def test_two_processes_match_one_device():
  tiny = scale_check.tiny_update(**SIZE)
  before = scale_check._flat(tiny.state.params)
  reference = scale_check.run_update(tiny)
  assert reference.devices == 1
  moved = max(float(np.max(np.abs(reference.params[k] - before[k]))) for k in before)
  assert moved > 1e-3  # the update changed the parameters: agreeing is not trivial
  result = scale_check.run_processes(2, 4, timeout=240, size=SIZE)
  assert result.devices == 8
  assert scale_check.max_param_diff(result, reference) < 1e-4
  assert result.loss == pytest.approx(reference.loss, abs=1e-4)
  assert jax.device_count() == 1  # (this process never joined the job)


def test_a_failing_process_is_reported():
  with pytest.raises(RuntimeError, match=r"(?s)A process failed \(exit codes.*--- process 1 ---"
                                         r".*MeshConfig"):
    scale_check.run_processes(2, 1, timeout=120, size=SIZE, mesh="data=3")
