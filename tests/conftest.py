"""Test-suite configuration shared by every test package.

Hypothesis profiles: `jax_ppo` (the default) is deterministic (derandomized, no example database)
and sized so that the core suite runs in well under three minutes on two CPU cores; `thorough`
runs many more examples for a local bug hunt. Select one with `HYPOTHESIS_PROFILE=thorough`.
"""

import os
import tempfile

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "jax_ppo",
    deadline=None,
    max_examples=30,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=(HealthCheck.too_slow, HealthCheck.data_too_large),
)
settings.register_profile(
    "thorough",
    parent=settings.get_profile("jax_ppo"),
    max_examples=500,
    derandomize=False,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "jax_ppo"))

# Runs turn JAX's persistent compilation cache on by default (`jax_ppo.compile_cache`, folder
# `~/.cache/jax_ppo/xla`); tests keep theirs in a temporary folder instead of the user's home,
# one for the whole test run: pytest-xdist's workers and the runs that tests start in
# subprocesses inherit it from the process that loaded this file first.
if not os.environ.get("JAX_PPO_CACHE_DIR"):
  os.environ["JAX_PPO_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax_ppo_test_cache_")


@pytest.fixture(scope="module")
def persistent_compilation_cache():
  """JAX's persistent compilation cache, in the test run's folder (`JAX_PPO_CACHE_DIR` above),
  for one test module (JAX's settings are restored afterwards).

  Modules that build many trainers with identical programs opt in with
  `pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")`: later trainers, in this
  module or another module of the run, on either worker, load their compiled programs from the
  cache instead of recompiling them (the cache is keyed by the program and the JAX version: it
  never serves another program).
  """
  import jax
  from jax.experimental.compilation_cache import compilation_cache as cc

  keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
          "jax_persistent_cache_min_entry_size_bytes")
  old = {k: getattr(jax.config, k) for k in keys}
  jax.config.update(keys[0], os.environ["JAX_PPO_CACHE_DIR"])
  jax.config.update(keys[1], 0.0)
  jax.config.update(keys[2], 0)
  cc.reset_cache()
  yield
  for k, v in old.items():
    jax.config.update(k, v)
  cc.reset_cache()
