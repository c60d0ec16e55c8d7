"""The rules that keep the package's layout readable (docs/architecture.md).

* The import layers (`[tool.importlinter]` in pyproject.toml, checked with import-linter): core
  at the bottom, then parallel, checkpoint, models, rollout and data, the training kit, the stages,
  the runs, and what stands on top; a stage's run never imports another's.
* The core imports only jax (and the standard library).
* A module's `__all__` lists only names the module defines: re-exports live in a package's
  `__init__.py` alone.
* No private name crosses a module boundary: no `from x import _name` between the package's
  modules, and no `obj._name` on an object whose `_name` is defined in another module.
"""

import ast
import pathlib
import sys

import pytest
from importlinter import configuration as importlinter_configuration
from importlinter.application import use_cases as importlinter

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jax_ppo"
SOURCES = sorted(PACKAGE.rglob("*.py"))


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _tree(path: pathlib.Path) -> ast.Module:
  return ast.parse(path.read_text(), filename=str(path))


def _top_level_names(tree: ast.Module) -> set[str]:
  names = set()
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, (ast.Assign, ast.AnnAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
  return names


def _dunder_all(tree: ast.Module) -> list[str]:
  for node in tree.body:
    if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                             for t in node.targets)):
      return [e.value for e in node.value.elts]
  return []


def _is_module(package: str, name: str) -> bool:
  base = ROOT.joinpath(*package.split("."), name)
  return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _is_private(name: str) -> bool:
  return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_import_layers_hold():
  importlinter_configuration.configure()
  sys.path.insert(0, str(ROOT))  # the checkout's package, not another installed copy
  try:
    passed = importlinter.lint_imports(config_filename=str(ROOT / "pyproject.toml"),
                                       cache_dir=None)
  finally:
    sys.path.remove(str(ROOT))
  assert passed, "an import contract is broken: see the report above (pyproject.toml)"


def test_core_imports_only_jax_and_the_standard_library():
  bad = []
  for path in sorted((PACKAGE / "core").rglob("*.py")):
    for node in ast.walk(_tree(path)):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0:
        names = [node.module]
      else:
        continue
      for name in names:
        top = name.split(".")[0]
        ok = (top == "jax" or top in sys.stdlib_module_names
              or name == "jax_ppo.core" or name.startswith("jax_ppo.core."))
        if not ok:
          bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
  assert not bad, bad


def test_all_lists_only_names_the_module_defines():
  bad = []
  for path in SOURCES:
    if path.name == "__init__.py":
      continue
    tree = _tree(path)
    missing = [n for n in _dunder_all(tree) if n not in _top_level_names(tree)]
    if missing:
      bad.append(f"{path.relative_to(ROOT)}: {missing} (re-exports belong in a package's "
                 "__init__.py; import them from the module that defines them)")
  assert not bad, bad


def _private_definitions() -> dict[str, set[str]]:
  """Private name -> the modules that define it (functions, classes, methods, attributes set
  on `self`)."""
  defined: dict[str, set[str]] = {}
  for path in SOURCES:
    module = _module_name(path)
    for node in ast.walk(_tree(path)):
      name = None
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        name = node.name
      elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name) and node.value.id == "self"):
        name = node.attr
      elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        name = node.id
      if name and _is_private(name):
        defined.setdefault(name, set()).add(module)
  return defined


def test_no_private_name_crosses_a_module_boundary():
  defined = _private_definitions()
  bad = []
  for path in SOURCES:
    module = _module_name(path)
    where = path.relative_to(ROOT)
    for node in ast.walk(_tree(path)):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jax_ppo"):
        # A package's private helper module (`core/_checks.py`) serves that package alone.
        parts = node.module.split(".")
        first = next((i for i, part in enumerate(parts) if _is_private(part)), len(parts))
        owner = ".".join(parts[:first])
        inside = module == owner or module.startswith(owner + ".")
        sibling = module.startswith(node.module + ".")
        private = [a.name for a in node.names if _is_private(a.name)
                   and not (sibling and _is_module(node.module, a.name))]
        if first < len(parts) and not inside:
          private.append(node.module)
        if private:
          bad.append(f"{where}:{node.lineno} imports {private} from {node.module}")
      elif (isinstance(node, ast.Attribute) and _is_private(node.attr)
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
        owners = defined.get(node.attr, set())
        if owners and module not in owners:
          bad.append(f"{where}:{node.lineno} uses .{node.attr}, private to "
                     f"{sorted(owners)}")
  assert not bad, "\n".join(bad)


@pytest.mark.parametrize("rule", ["__all__", "private"])
def test_the_checks_catch_a_violation(tmp_path, rule):
  """The ast checks above flag a module written to break them (they cannot pass vacuously)."""
  if rule == "__all__":
    tree = ast.parse("from os import path\n\n__all__ = ['path']\n")
    assert [n for n in _dunder_all(tree) if n not in _top_level_names(tree)] == ["path"]
  else:
    tree = ast.parse("from jax_ppo.checkpoint.integrity import _MISSING\n")
    node = tree.body[0]
    assert [a.name for a in node.names if _is_private(a.name)] == ["_MISSING"]
    assert _is_module("jax_ppo.core", "_checks") and not _is_module("jax_ppo.core", "_nothing")


def test_test_modules_outside_packages_have_unique_names():
  """pytest imports a test file of a folder without `__init__.py` by its bare name: two such files
  named alike (tests/ppo/test_trainer.py, tests/dpo/test_trainer.py) make the second an import
  error ("import file mismatch") in whichever worker collects both."""
  names: dict[str, list[str]] = {}
  for path in sorted((ROOT / "tests").rglob("test_*.py")):
    if not (path.parent / "__init__.py").exists():
      names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
  assert {n: p for n, p in names.items() if len(p) > 1} == {}
