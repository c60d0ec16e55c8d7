"""jax_ppo.diagnostics: checks that stand on the stages.

`memory` (the per-device memory plan of a PPO update, compiled without running it),
`scale_check` (does the sharded update equal the single-device one on this machine's devices),
`plan` (a run's programs compiled ahead of time for a TPU slice from a CPU host: per-chip HBM,
fit, loop-corrected FLOPs and bytes, roofline time; `jax-ppo plan`), `shapes` (the
architectures of common models, to plan one without downloading it: `jax-ppo plan --model`),
`topology` (the slice's devices from libtpu); the accelerators' datasheet table is
`jax_ppo.parallel.chips`.
"""
