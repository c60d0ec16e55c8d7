"""jax_ppo's test suite, a regular package so that `import tests...` always means this folder.

Some dependencies' wheels (draccus 0.11.6) install a top-level `tests` package into
site-packages; without this file the repository's `tests` would be a namespace package, which a
regular package later on `sys.path` shadows (`from tests.ppo.conftest import ...` failed).
"""
