"""NVIDIA GPU nodes described on a host without GPUs, for compiling ahead of time.

`gpu_devices("h100:8")` asks JAX's CUDA plugin for the devices of one node of 8 H100s, and
`gpu_devices("h200:2x8")` for 2 nodes of 8 H200s (`jax.experimental.topologies.get_topology_desc`
with a `GpuTargetConfigProto` of the part: XLA compiles for that GPU without one). The programs
then compile as on the node, with their real per-GPU `memory_analysis()`; XLA's GPU compiler
gives no `cost_analysis()` without a GPU, so GPU plans have memory and fit, and no FLOPs or
roofline time.

The CUDA plugin comes with the `jax_ppo[plan-gpu]` extra (`jax[cuda12-local]`: the plugin
alone, about 180 MB, no CUDA libraries). On a host without CUDA the plugin refuses to start
unless its version check is skipped (`JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`, which `gpu_devices`
sets: compiling needs no CUDA library); JAX logs that refusal once, when it first looks for
devices, and keeps to the CPU.

Fit. JAX's GPU allocator takes a share of each GPU's memory, not all of it: 75% unless
`XLA_CLIENT_MEM_FRACTION` (older name `XLA_PYTHON_CLIENT_MEM_FRACTION`) says otherwise, whether or
not it preallocates (jax 0.10; later JAX versions may let the pool grow past 75% when neither
variable is set, which a plan does not count on). A GPU plan therefore judges its fit against
`allocator_fraction()` of the card's memory, read from the planning process's environment as JAX
reads it in the run's; `RAISED_MEM_FRACTION` is what its advice offers (the rest stays for the
CUDA context, cuBLAS workspaces and NCCL buffers, which live outside the allocator's pool).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from collections.abc import Mapping

from jax_ppo.diagnostics.topology import PlanError
from jax_ppo.parallel.chips import CHIPS, Chip

GPU_EXTRA = "jax_ppo[plan-gpu]"
"""The optional dependency that brings JAX's CUDA plugin (no CUDA libraries)."""
PLUGIN = "jax_plugins.xla_cuda12"
KiB, MiB = 2**10, 2**20
MEM_FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
"""The variables JAX's GPU client reads for its allocator's share of each GPU (the second is the
older name; JAX refuses both together)."""
DEFAULT_MEM_FRACTION = 0.75
"""The share JAX's GPU allocator takes when neither of `MEM_FRACTION_VARS` is set."""
RAISED_MEM_FRACTION = 0.95
"""The share a GPU plan's advice offers when a run fits that much of the card and not the
default's."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuPart:
  """What XLA's GPU compiler needs to know of a part (NVIDIA's architecture whitepapers)."""

  device_kind: str
  """`jax.Device.device_kind` of the part as the CUDA driver names it."""
  chip: str
  """Its row in `jax_ppo.parallel.chips.CHIPS` (HBM bytes and bandwidth)."""
  compute_capability: tuple[int, int]
  sms: int
  """Streaming multiprocessors."""
  fp32_cores_per_sm: int
  clock_ghz: float
  """Boost clock."""
  l2_bytes: int
  shared_memory_per_sm: int
  shared_memory_per_block_optin: int

  def row(self) -> Chip:
    return next(c for c in CHIPS if c.name == self.chip)

  def target_config(self) -> str:
    """The part as a `stream_executor.GpuTargetConfigProto` in text format."""
    major, minor = self.compute_capability
    chip = self.row()
    return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: {48 * KiB}
  shared_memory_per_core: {self.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {self.sms}
  fpus_per_core: {self.fp32_cores_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(chip.hbm_bytes_s)}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {chip.hbm_bytes}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{self.device_kind}"
"""


_HOPPER = dict(compute_capability=(9, 0), sms=132, fp32_cores_per_sm=128, clock_ghz=1.98,
               l2_bytes=50 * MiB, shared_memory_per_sm=228 * KiB,
               shared_memory_per_block_optin=227 * KiB)
GPU_PARTS: dict[str, GpuPart] = {
    "h100": GpuPart(device_kind="NVIDIA H100 80GB HBM3", chip="H100", **_HOPPER),
    "h200": GpuPart(device_kind="NVIDIA H200", chip="H200", **_HOPPER),
    "a100-80gb": GpuPart(device_kind="NVIDIA A100-SXM4-80GB", chip="A100-SXM4-80GB",
                         compute_capability=(8, 0), sms=108, fp32_cores_per_sm=64,
                         clock_ghz=1.41, l2_bytes=40 * MiB, shared_memory_per_sm=164 * KiB,
                         shared_memory_per_block_optin=163 * KiB),
}
"""The SXM parts `jax-ppo plan` compiles for, by the name a GPU topology starts with."""

_NAME = re.compile(r"^(?P<part>[a-z0-9-]+):(?:(?P<nodes>\d+)x)?(?P<gpus>\d+)$")


def is_gpu_topology(topology: str) -> bool:
  """Whether `topology` names GPUs ("h100:8", "h200:2x8"), not a TPU slice."""
  found = _NAME.match(topology.strip().lower())
  return found is not None and found.group("part") in GPU_PARTS


def parse_gpu_topology(topology: str) -> tuple[GpuPart, int, int]:
  """`(part, nodes, gpus_per_node)` of "PART:GPUS" or "PART:NODESxGPUS"; PlanError otherwise."""
  found = _NAME.match(topology.strip().lower())
  if found is None or found.group("part") not in GPU_PARTS:
    raise PlanError(f"GPU topology {topology!r} is not PART:GPUS or PART:NODESxGPUS with PART "
                    f"one of {', '.join(GPU_PARTS)} (e.g. h100:8, h200:2x8).")
  nodes, gpus = int(found.group("nodes") or 1), int(found.group("gpus"))
  if nodes < 1 or not 1 <= gpus <= 8:
    raise PlanError(f"GPU topology {topology!r}: give 1 to 8 GPUs per node and at least one "
                    "node (e.g. h100:8, h100:2x8).")
  return GPU_PARTS[found.group("part")], nodes, gpus


def allocator_fraction(environ: Mapping[str, str] | None = None) -> float:
  """The share of each GPU's memory JAX's allocator may use in a process started with `environ`
  (default `os.environ`): `XLA_CLIENT_MEM_FRACTION` or its older name, else
  `DEFAULT_MEM_FRACTION` (module docstring). PlanError when both are set (JAX refuses that too)
  or the value is not a number in (0, 1]."""
  environ = os.environ if environ is None else environ
  given = {name: environ[name] for name in MEM_FRACTION_VARS if environ.get(name, "")}
  if len(given) > 1:
    raise PlanError(f"both {' and '.join(given)} are set, which JAX refuses: unset "
                    f"{MEM_FRACTION_VARS[1]} (the older name).")
  if not given:
    return DEFAULT_MEM_FRACTION
  (name, text), = given.items()
  try:
    fraction = float(text)
  except ValueError:
    fraction = float("nan")
  if not 0.0 < fraction <= 1.0:
    raise PlanError(f"{name}={text!r} is not the share of each GPU's memory JAX may use: give a "
                    f"number in (0, 1], e.g. {name}={RAISED_MEM_FRACTION}.")
  return fraction


def cuda_plugin_installed() -> bool:
  """Whether JAX's CUDA plugin is importable here (nothing is loaded)."""
  try:
    return importlib.util.find_spec(PLUGIN) is not None
  except ModuleNotFoundError:  # no `jax_plugins` package at all
    return False


def require_cuda_plugin() -> None:
  """PlanError naming the `plan-gpu` extra unless JAX's CUDA plugin is installed."""
  if not cuda_plugin_installed():
    raise PlanError(
        "planning for GPUs compiles with JAX's CUDA plugin, which is not installed here: "
        f"pip install \"{GPU_EXTRA}\" (jax[cuda12-local]: the plugin, no CUDA libraries).")


def gpu_devices(topology: str) -> list:
  """The devices of the GPU topology `topology` (module docstring), from JAX's CUDA plugin, on a
  host with or without GPUs; each node is one process (`process_index`). PlanError when the
  plugin is missing or the name is not a GPU topology."""
  part, nodes, gpus = parse_gpu_topology(topology)
  require_cuda_plugin()
  from jax.experimental import topologies

  # Before JAX looks for devices, this lets the plugin start without CUDA; after, the plugin has
  # refused once and is registered here (compiling needs no CUDA library).
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

  def describe():
    return topologies.get_topology_desc(topology, "cuda", target_config=part.target_config(),
                                        topology=f"1x{nodes}x{gpus}").devices

  try:
    return list(describe())
  except NotImplementedError:  # the plugin refused to start when JAX looked for devices
    from jax_plugins import xla_cuda12  # PLUGIN (installed: require_cuda_plugin above)

    xla_cuda12.initialize()
    return list(describe())


__all__ = ["DEFAULT_MEM_FRACTION", "GPU_EXTRA", "GPU_PARTS", "GpuPart", "MEM_FRACTION_VARS",
           "RAISED_MEM_FRACTION", "allocator_fraction", "cuda_plugin_installed", "gpu_devices",
           "is_gpu_topology", "parse_gpu_topology", "require_cuda_plugin"]
