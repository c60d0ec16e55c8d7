"""SFT on a (data=2, fsdp=2, tensor=2) mesh of 8 fake CPU devices equals SFT on one device
(`SFTTrainer(mesh=...)`): two steps with packing and gradient accumulation 2, then an evaluation.

The script (`scripts/sharded_sft.py`) runs in a subprocess (`tests/parallel/multidevice.py`): the
pytest process has one device.
"""

import pathlib

import pytest

from tests.parallel.multidevice import run_on_devices

SCRIPT = pathlib.Path(__file__).resolve().parent / "scripts" / "sharded_sft.py"
TOL = 1e-5


@pytest.fixture(scope="module")
def result():
  return run_on_devices(SCRIPT, "2", "2", "2")


@pytest.mark.slow
def test_sft_steps_on_a_mesh_equal_the_single_device_steps(result):
  r = result
  assert r["devices"] == 8 and r["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
  # The parameters (and Adam's moments) really are split, and each batch's rows too ...
  assert r["param_devices"] == 8
  assert any("fsdp" in s for s in r["param_specs"]) and any("tensor" in s for s in r["param_specs"])
  assert r["batch_spec"] == "P(('data', 'fsdp'), None)"
  assert r["segments"] >= 2  # (packed rows)
  # ... and two steps are the single-device steps: the loss is normalised by the token count of
  # the whole global batch, not by each device's rows.
  assert r["moved"] > 100 * TOL  # training changed the parameters: agreeing is not trivial
  assert r["max_param_diff"] < TOL
  assert r["max_opt_diff"] < TOL
  one, mesh = r["metrics"]
  assert len(one) == len(mesh) == 2
  for a, b in zip(one, mesh, strict=True):
    assert a.keys() == b.keys()
    assert b["train/tokens"] == a["train/tokens"]
    for key in a:
      assert b[key] == pytest.approx(a[key], rel=TOL, abs=TOL), key  # (perplexity: relative)
  # The evaluation sums are global too.
  assert r["eval"][1]["eval/tokens"] == r["eval"][0]["eval/tokens"]
  assert r["eval"][1]["eval/loss"] == pytest.approx(r["eval"][0]["eval/loss"], abs=TOL)
  assert r["train_programs"] == 1  # no recompilation from the second step on


@pytest.fixture(scope="module")
def lora_result():
  return run_on_devices(pathlib.Path(SCRIPT).parent / "sharded_lora_sft.py", "2", "2", "2")


@pytest.mark.slow
def test_lora_sft_on_a_mesh_equals_the_single_device_run(lora_result):
  r = lora_result
  assert r["devices"] == 8
  # Only the adapters train (two per adapted projection), and they moved ...
  assert r["trained_leaves"] > 0 and r["trained_paths_not_lora"] == []
  assert r["moved"] > 1e-4
  # ... by the same steps on the mesh as on one device, with the frozen base split over it.
  assert r["max_param_diff"] < TOL and r["max_opt_diff"] < TOL
  assert any("fsdp" in s for s in r["base_specs"]) and any("tensor" in s for s in r["base_specs"])
  for a, b in zip(*r["metrics"], strict=True):
    for key in a:
      assert b[key] == pytest.approx(a[key], rel=TOL, abs=TOL), key  # (perplexity: relative)
  eval1, eval8 = r["eval"]
  for key in eval1:
    assert eval8[key] == pytest.approx(eval1[key], rel=TOL, abs=TOL), key
