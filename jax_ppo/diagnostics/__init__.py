"""jax_ppo.diagnostics: checks that stand on the stages.

`memory` (the per-device memory plan of a PPO update, compiled without running it),
`scale_check` (does the sharded update equal the single-device one on this machine's devices).
"""
