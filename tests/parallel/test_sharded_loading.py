"""`from_pretrained(path, mesh=...)` / `load_scalar_model(..., mesh=...)` read every tensor
slice by slice into its `NamedSharding`, with the values of a one-device load, and
`save_pretrained` of the sharded model writes the same files (8 fake CPU devices, subprocess)."""

import pytest
from multidevice import run_on_devices


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  return run_on_devices("sharded_loading.py", str(tmp_path_factory.mktemp("ckpt")))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_sharded_load_equals_host_load(results, family):
  r = results[family]
  assert r["equal"] and r["same_paths"] and r["on_mesh"]
  specs = r["specs"]
  assert specs["decoder/embed/embedding"] == "P('tensor', 'fsdp')"
  assert specs["decoder/layers/q/kernel"] == "P(None, 'fsdp', 'tensor')"
  assert specs["decoder/layers/down/kernel"] == "P(None, 'tensor', 'fsdp')"
  assert specs["decoder/layers/attn_norm/scale"] == "P(None, None)"
  # Each device read only its quarter of the embedding, never the whole tensor.
  assert r["embed_read_fraction"] == 0.25
  # Saving the sharded model gathers it tensor by tensor into the same files.
  assert r["files_equal"]
  if family == "llama":
    assert specs["lm_head/kernel"] == "P('fsdp', 'tensor')"
    assert r["scalar_equal"]
