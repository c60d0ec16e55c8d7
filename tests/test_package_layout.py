"""`import tests` is this repository's test folder even when a dependency ships its own `tests`."""

import importlib
import pathlib


def test_tests_package_is_this_folder():
  here = pathlib.Path(__file__).resolve().parent
  tests = importlib.import_module("tests")
  assert pathlib.Path(tests.__file__).resolve().parent == here
  conftest = importlib.import_module("tests.ppo.conftest")
  assert pathlib.Path(conftest.__file__).resolve().parent == here / "ppo"
