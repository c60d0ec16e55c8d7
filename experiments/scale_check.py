"""Scale check: the same PPO update on 1 device, on an 8-device mesh and over 2 processes.

A diagnostic to run on your own machine or cluster node before a sharded or multi-host run: one
fused PPO update of a tiny random Llama-shaped policy with a value head (fixed synthetic rollout,
scores and keys; `jax_ppo.diagnostics.scale_check`) on

  (a) 1 device,
  (b) 8 fake CPU devices in one process, mesh data=2, fsdp=2, tensor=2 (parameters and optimizer
      state sharded by the logical-axis rules, rows split over data x fsdp),
  (c) 2 processes with 4 fake CPU devices each, joined through `jax.distributed` over 127.0.0.1
      with gloo CPU collectives, the same mesh over their 8 devices,

then prints a table and exits 1 when (b) or (c) differs from (a) by more than `--tolerance` in
any updated parameter. `--json PATH` writes

  {"max_param_diff_8dev": ..., "max_param_diff_2proc": ...,
   "loss": {"1dev": ..., "8dev": ..., "2proc": ...},
   "bytes_per_device": {"1dev": ..., "8dev": ..., "2proc": ...}}

(bytes per device: arguments + outputs + temporaries of the compiled update, from XLA's memory
analysis). Everything runs on the CPU (`JAX_PLATFORMS=cpu`, fake devices through
`--xla_force_host_platform_device_count`), so it needs no accelerator; what it checks is that the
partitioned programs and the cross-process collectives compute what one device computes.

    python experiments/scale_check.py [--json scale_check.json] [--hidden-size 32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--json", help="write the figures to this JSON file")
  p.add_argument("--mesh", default="data=2,fsdp=2,tensor=2", help="mesh of (b) and (c)")
  p.add_argument("--processes", type=int, default=2, help="processes of case (c)")
  p.add_argument("--devices-per-process", type=int, default=4, help="fake devices each, (c)")
  p.add_argument("--batch-size", type=int, default=8)
  p.add_argument("--hidden-size", type=int, default=32)
  p.add_argument("--num-layers", type=int, default=2)
  p.add_argument("--max-new-tokens", type=int, default=6)
  p.add_argument("--ppo-epochs", type=int, default=2)
  p.add_argument("--tolerance", type=float, default=1e-4)
  p.add_argument("--timeout", type=float, default=600, help="seconds for case (c)")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = _parse(argv)
  os.environ["JAX_PLATFORMS"] = "cpu"
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  os.environ["XLA_FLAGS"] = " ".join([*flags, "--xla_force_host_platform_device_count=8"])
  from jax_ppo.diagnostics import scale_check  # after XLA_FLAGS: 8 fake devices
  from jax_ppo.parallel import make_mesh

  size = {"batch_size": args.batch_size, "hidden_size": args.hidden_size,
          "num_layers": args.num_layers, "max_new_tokens": args.max_new_tokens,
          "ppo_epochs": args.ppo_epochs}
  tiny = scale_check.tiny_update(**size)
  results = {
      "1dev": scale_check.run_update(tiny),
      "8dev": scale_check.run_update(tiny, mesh=make_mesh(scale_check.parse_mesh(args.mesh))),
      "2proc": scale_check.run_processes(args.processes, args.devices_per_process,
                                       timeout=args.timeout, size=size, mesh=args.mesh),
  }
  diffs = {k: scale_check.max_param_diff(results["1dev"], r) for k, r in results.items()}
  report = {
      "max_param_diff_8dev": diffs["8dev"],
      "max_param_diff_2proc": diffs["2proc"],
      "loss": {k: r.loss for k, r in results.items()},
      "bytes_per_device": {k: r.bytes_per_device for k, r in results.items()},
  }
  labels = {"1dev": "(a) 1 device", "8dev": f"(b) 8 devices, {args.mesh}",
            "2proc": f"(c) {args.processes} processes x {args.devices_per_process}, {args.mesh}"}
  width = max(map(len, labels.values()))
  print(f"{'case':<{width}}  {'devices':>7}  {'loss':>12}  {'max |dparam|':>12}  "
        f"{'bytes/device':>12}")
  for key, r in results.items():
    diff = "-" if key == "1dev" else f"{diffs[key]:.3g}"
    nbytes = "n/a" if r.bytes_per_device is None else str(r.bytes_per_device)
    print(f"{labels[key]:<{width}}  {r.devices:>7}  {r.loss:>12.8f}  {diff:>12}  {nbytes:>12}")
  ok = max(diffs["8dev"], diffs["2proc"]) <= args.tolerance
  print(f"{'OK' if ok else 'FAILED'}: max parameter difference "
        f"{max(diffs['8dev'], diffs['2proc']):.3g} (tolerance {args.tolerance:g}).")
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(report, f, indent=2)
      f.write("\n")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
