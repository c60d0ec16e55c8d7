"""GPU topology names, the target configs handed to XLA and the one-line errors of
`jax-ppo plan --topology h100:8` where JAX's CUDA plugin is missing (no plugin needed; the
compiles themselves: tests/diagnostics/test_gpu_plan.py)."""

import re

import pytest
from tiny_plan_run import write_run

from jax_ppo import cli
from jax_ppo.diagnostics import gpu_topology, plan
from jax_ppo.diagnostics.topology import PlanError
from jax_ppo.parallel.chips import chip_for


@pytest.mark.parametrize("name, nodes, gpus, chip", [
    ("h100:8", 1, 8, "H100"), ("H200:2x8", 2, 8, "H200"), ("a100-80gb:4", 1, 4,
                                                            "A100-SXM4-80GB")])
def test_names_parse_to_nodes_and_gpus(name, nodes, gpus, chip):
  assert gpu_topology.is_gpu_topology(name)
  part, n, g = gpu_topology.parse_gpu_topology(name)
  assert (n, g, part.chip) == (nodes, gpus, chip)
  # the device kind XLA will report finds the part's own datasheet row
  assert chip_for(part.device_kind).name == chip


@pytest.mark.parametrize("name", ["v5e:2x4", "v5p:2x2x1", "h100", "b200:8", "h100:2x2x8"])
def test_tpu_slices_and_other_names_are_not_gpu_topologies(name):
  assert not gpu_topology.is_gpu_topology(name)


@pytest.mark.parametrize("name, match", [("h100:16", "1 to 8 GPUs per node"),
                                         ("h100:0x8", "at least one node"),
                                         ("b200:8", "PART one of h100, h200, a100-80gb")])
def test_bad_gpu_topologies_name_the_form(name, match):
  with pytest.raises(PlanError, match=match):
    gpu_topology.parse_gpu_topology(name)


def test_target_config_carries_the_parts_figures():
  for part in gpu_topology.GPU_PARTS.values():
    text = part.target_config()
    row = part.row()
    fields = dict(re.findall(r"^\s*(\w+): ([\w.\"]+)", text, flags=re.M))
    assert int(fields["device_memory_size"]) == row.hbm_bytes
    assert int(fields["memory_bandwidth"]) == int(row.hbm_bytes_s)
    assert int(fields["core_count"]) == part.sms
    assert f'device_description_str: "{part.device_kind}"' in text
    major, minor = part.compute_capability
    assert f"cuda_compute_capability {{ major: {major} minor: {minor} }}" in text


@pytest.mark.skipif(gpu_topology.cuda_plugin_installed(),
                    reason="JAX's CUDA plugin is installed in this venv")
def test_missing_plugin_is_one_line_naming_the_extra(tmp_path, capsys):
  config = write_run(tmp_path, layers=1)
  with pytest.raises(PlanError, match=r"pip install \"jax_ppo\[plan-gpu\]\""):
    plan.topology_devices("h100:8")
  assert cli.main(["plan", str(config), "--topology", "h200:2x8"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "jax_ppo[plan-gpu]" in err and "CUDA plugin" in err


def test_a_gpu_topology_with_bad_sizes_is_refused_before_anything_loads(capsys):
  with pytest.raises(PlanError, match="1 to 8 GPUs per node"):
    gpu_topology.gpu_devices("h100:9")
