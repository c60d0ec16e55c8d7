"""The repository's own docs point only at things that exist.

`docs/rlhf_details.md` links every implementation detail (items 1-30) to the tests that verify
it, as `[tests/x/test_y.py::test_name](../tests/x/test_y.py)`; `docs/core_api.md` states the
signatures of the core functions and gives runnable examples. These tests parse both (test
names with `ast`, signatures with `inspect`), so a renamed or deleted test, a changed signature
or a broken example fails CI instead of leaving the docs wrong.
"""

from __future__ import annotations

import ast
import inspect
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CORE_API = DOCS / "core_api.md"
DETAILS_DOC = DOCS / "rlhf_details.md"
N_ITEMS = 30
NOT_TESTED = "**Not yet tested:**"

LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
ITEM_HEADING = re.compile(r"^## (\d+)\. .*$", re.M)
SECTION_HEADING = re.compile(r"^## ", re.M)
CODE_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
TABLE_SIGNATURE = re.compile(r"^\| `([A-Za-z_]\w*)\((.*?)\)` \|", re.M)


def _read(path: Path) -> str:
  assert path.is_file(), f"{path.relative_to(ROOT)} is missing"
  return path.read_text(encoding="utf-8")


def _relative_links(text: str) -> list[tuple[str, str]]:
  """`(label, target)` of every markdown link that points inside the repository."""
  return [
      (label, target)
      for label, target in LINK.findall(text)
      if not re.match(r"[a-z]+:", target) and not target.startswith("#")
  ]


def _test_links(text: str) -> list[tuple[str, str]]:
  """`(label, target)` of links whose label names a test, `path::test_name`."""
  return [(label, target) for label, target in _relative_links(text) if "::" in label]


def _test_names(path: Path) -> set[str]:
  """Test functions of a file: `test_x` and `TestClass::test_x`, as pytest node ids name them."""
  names = set()
  for node in ast.parse(path.read_text(encoding="utf-8")).body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
      names.add(node.name)
    elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
      for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith(
            "test"
        ):
          names.add(f"{node.name}::{item.name}")
  return names


def _items(text: str) -> dict[int, str]:
  """Item number -> the text of its section (up to the next `## ` heading)."""
  items: dict[int, str] = {}
  for match in ITEM_HEADING.finditer(text):
    number = int(match.group(1))
    assert number not in items, f"docs/rlhf_details.md numbers item {number} twice"
    end = SECTION_HEADING.search(text, match.end())
    items[number] = text[match.start() : end.start() if end else len(text)]
  return items


def _metrics_section(text: str) -> str:
  start = text.index("## Metrics")
  end = SECTION_HEADING.search(text, start + 1)
  return text[start : end.start() if end else len(text)]


@pytest.mark.parametrize("doc", [*sorted(DOCS.glob("*.md")), ROOT / "README.md"],
                         ids=lambda p: p.name)
def test_relative_links_point_at_existing_files(doc):
  text = _read(doc)
  missing = [
      target
      for _, target in _relative_links(text)
      if not (doc.parent / target.split("#")[0]).exists()
  ]
  assert not missing, f"{doc.relative_to(ROOT)} links to missing files: {missing}"


def test_readme_points_at_the_docs():
  links = {target for _, target in _relative_links(_read(ROOT / "README.md"))}
  pages = {f"docs/{path.name}" for path in DOCS.glob("*.md")}
  assert {"docs/core_api.md", "docs/rlhf_details.md", "docs/runs.md"} <= pages
  assert pages <= links, f"the README does not link {sorted(pages - links)}"


@pytest.mark.parametrize("doc", [CORE_API, DETAILS_DOC], ids=lambda p: p.name)
def test_linked_tests_are_defined_in_the_linked_file(doc):
  problems = []
  for label, target in _test_links(_read(doc)):
    file_part, name = label.split("::", 1)
    path = (doc.parent / target).resolve()
    if path != (ROOT / file_part).resolve():
      problems.append(f"[{label}] links to {target}, not to {file_part}")
    elif not path.is_file():
      problems.append(f"[{label}]: {file_part} does not exist")
    elif name not in _test_names(path):
      problems.append(f"[{label}]: {file_part} defines no test function {name!r}")
  assert not problems, f"{doc.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_every_detail_links_a_test_or_says_it_is_untested():
  items = _items(_read(DETAILS_DOC))
  assert sorted(items) == list(range(1, N_ITEMS + 1)), (
      f"docs/rlhf_details.md must number its items 1..{N_ITEMS} once each, got {sorted(items)}"
  )
  bare = [n for n, text in items.items() if not _test_links(text) and NOT_TESTED not in text]
  assert not bare, f"docs/rlhf_details.md items {bare} neither link a test nor say '{NOT_TESTED}'"
  gaps = {}
  for number, text in items.items():
    if NOT_TESTED in text:
      what = " ".join(text.split(NOT_TESTED, 1)[1].split("\n\n", 1)[0].split())
      assert what, f"docs/rlhf_details.md item {number}: '{NOT_TESTED}' must say what is untested"
      gaps[number] = what
  if gaps:  # Visible in pytest's warnings summary, so the gaps are not forgotten.
    listing = "\n".join(f"  item {n}: {what}" for n, what in sorted(gaps.items()))
    warnings.warn(
        f"docs/rlhf_details.md: parts of {len(gaps)} items have no test yet:\n{listing}",
        UserWarning,
        stacklevel=1,
    )


def test_metric_names_are_ones_the_library_logs():
  section = _metrics_section(_read(DETAILS_DOC))
  names = re.findall(r"^\| `([^`]+)` \|", section, re.M)
  assert len(names) >= 20, names
  literals = set()
  for path in (ROOT / "jax_ppo").rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      if isinstance(node, ast.Constant) and isinstance(node.value, str):
        literals.add(node.value)
  unknown = [name for name in names if name not in literals]
  assert not unknown, f"docs/rlhf_details.md lists metrics that jax_ppo never logs: {unknown}"


def _documented_signature(name: str, params: str) -> list[tuple[str, str, object]]:
  """`(name, kind, default)` of each parameter of a signature written as `f(a, *, b=1.0)`."""
  args = ast.parse(f"def {name}({params}): pass").body[0].args
  out = []
  positional = args.posonlyargs + args.args
  defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults)) + [
      ast.literal_eval(d) for d in args.defaults
  ]
  for arg, default in zip(positional, defaults, strict=True):
    out.append((arg.arg, "positional", default))
  for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
    value = inspect.Parameter.empty if default is None else ast.literal_eval(default)
    out.append((arg.arg, "keyword-only", value))
  return out


def _actual_signature(fn) -> list[tuple[str, str, object]]:
  kinds = {
      inspect.Parameter.POSITIONAL_ONLY: "positional",
      inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
      inspect.Parameter.KEYWORD_ONLY: "keyword-only",
  }
  return [
      (p.name, kinds[p.kind], p.default) for p in inspect.signature(fn).parameters.values()
  ]


def test_core_api_signatures_match_the_code():
  import jax_ppo
  import jax_ppo.core as core

  text = _read(CORE_API)
  documented = dict(TABLE_SIGNATURE.findall(text))
  functions = {n for n in core.__all__ if inspect.isfunction(getattr(core, n))}
  assert functions <= set(documented), (
      f"docs/core_api.md's summary table lacks {sorted(functions - set(documented))}"
  )
  assert set(documented) <= functions, (
      f"docs/core_api.md documents names jax_ppo.core does not export: "
      f"{sorted(set(documented) - functions)}"
  )
  for name, params in documented.items():
    assert getattr(jax_ppo, name) is getattr(core, name), f"{name} is not re-exported by jax_ppo"
    assert _documented_signature(name, params) == _actual_signature(getattr(core, name)), (
        f"docs/core_api.md documents {name}({params}); the code has {name}"
        f"{inspect.signature(getattr(core, name))}"
    )
  others = [n for n in core.__all__ if n not in functions and f"`{n}`" not in text]
  assert not others, f"docs/core_api.md never mentions {others}"


@pytest.mark.parametrize("index", range(len(CODE_BLOCK.findall(_read(CORE_API)))))
def test_core_api_examples_run(index):
  code = CODE_BLOCK.findall(_read(CORE_API))[index]
  exec(compile(code, f"docs/core_api.md example {index}", "exec"), {})


def test_the_repository_cites_only_its_own_docs():
  """Docstrings and tests cite docs/core_api.md and docs/rlhf_details.md, never the project's
  internal planning files, which a user of the repository does not have."""
  old = re.compile(r"RLHF_DETAILS\.md|shared/API\.md|(?<![\w/])API\.md")
  offenders = []
  for folder in ("jax_ppo", "tests", "experiments"):
    for path in sorted((ROOT / folder).rglob("*.py")):
      if path == Path(__file__).resolve():
        continue
      for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if old.search(line):
          offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
  assert not offenders, "cite docs/rlhf_details.md or docs/core_api.md instead:\n" + "\n".join(
      offenders)
