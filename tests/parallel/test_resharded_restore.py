"""`jax-ppo train ... mesh.data=2 mesh.fsdp=2 mesh.tensor=2` on 8 fake CPU devices writes
sharded Orbax checkpoints that restore, array for array, on 1 device and on 4 devices with
another layout (fsdp=4), where the run then resumes (docs: issue 11 item 5)."""

import pytest
from multidevice import run_on_devices


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  root = tmp_path_factory.mktemp("resharded")
  return root, run_on_devices("resharded_restore.py", "train", str(root))


@pytest.mark.slow
def test_cli_trains_on_a_mesh(trained):
  _, r = trained
  assert r["devices"] == 8 and r["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
  assert r["step"] == 2
  # Parameters and their Adam moments are split over fsdp and tensor.
  assert r["specs"] == {"param": "P(None, 'fsdp', 'tensor')", "moment": "P(None, 'fsdp', 'tensor')"}


@pytest.mark.slow
def test_restore_on_one_device(trained):
  root, _ = trained
  r = run_on_devices("resharded_restore.py", "restore", str(root), "none", devices=1)
  assert r["devices"] == 1 and r["step"] == 2 and r["same_keys"]
  assert r["max_diff"] == 0.0
  assert r["specs"] == {"param": "one device", "moment": "one device"}


@pytest.mark.slow
def test_restore_on_four_devices_with_another_layout(trained):
  root, _ = trained
  r = run_on_devices("resharded_restore.py", "restore", str(root), "1", "4", "1", devices=4)
  assert r["devices"] == 4 and r["step"] == 2 and r["same_keys"]
  assert r["max_diff"] == 0.0
  assert r["specs"] == {"param": "P(None, 'fsdp', None)", "moment": "P(None, 'fsdp', None)"}
  # The run resumes on the new mesh (`mesh` may change between invocations of a run).
  assert r["resumed_steps"] == [3] and r["resumed_finite"]
