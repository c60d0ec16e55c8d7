"""Test-suite configuration shared by every test package.

Hypothesis profiles: `jax_ppo` (the default) is deterministic (derandomized, no example database)
and sized so that the core suite runs in well under three minutes on two CPU cores; `thorough`
runs many more examples for a local bug hunt. Select one with `HYPOTHESIS_PROFILE=thorough`.
"""

import os

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
