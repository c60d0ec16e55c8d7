"""Security (issue 13 item 7).

1. A static scan of the package source (`ast`): weights and checkpoints load only through
   safetensors and Orbax (no pickle-family module, no `torch.load`, no `allow_pickle`, no unsafe
   `yaml.load`); `trust_remote_code` is never enabled and every `transformers` `Auto*` loader
   says `trust_remote_code=False`; nothing runs a command or evaluates text (no `subprocess`,
   `os.system`/`popen`/`exec*`/`spawn*`, `shell=True`, `eval`, `exec`, `compile`, `__import__`);
   the one `importlib.import_module` is the reward-function loader, and the one `subprocess` is
   `diagnostics.scale_check.run_processes`, which starts copies of its own module. The scanner is
   itself tested on snippets, so a violation cannot slip through a scanner that sees nothing.
2. `package.module:function` rewards import only the module the user named: nothing in the spec
   is evaluated, no other module is imported, standard-library and jax_ppo modules (`os:system`,
   `subprocess:run`, `builtins:eval`) and functions merely re-exported by the module are refused,
   and a `RunConfig` naming a module does not import it.
"""

from __future__ import annotations

import ast
import os
import pathlib
import sys
import textwrap
import uuid

import numpy as np
import pytest

import jax_ppo
from jax_ppo.rewards import specs
from jax_ppo.rewards.scorers import FunctionScorer
from jax_ppo.runs import ppo_config as run_config

PACKAGE = pathlib.Path(jax_ppo.__file__).parent

FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal",
                     "shelve", "subprocess", "pty", "commands"}
FORBIDDEN_BUILTINS = {"eval", "exec", "compile", "__import__"}
FORBIDDEN_OS = {"system", "popen", "startfile", "execl", "execle", "execlp", "execlpe", "execv",
                "execve", "execvp", "execvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe",
                "spawnv", "spawnve", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp"}
UNSAFE_YAML = {"load", "load_all", "unsafe_load", "unsafe_load_all", "full_load", "full_load_all"}
IMPORT_MODULE_ALLOWED = {("rewards/specs.py", "import_reward_function")}
"""The only (file, function) allowed to call importlib.import_module."""
SUBPROCESS_ALLOWED = {("diagnostics/scale_check.py", "run_processes")}
"""The only (file, function) allowed to import subprocess: it starts copies of its own module
(`python -m jax_ppo.diagnostics.scale_check`, fixed arguments, no shell) for the multi-process
check."""


def _dotted(node: ast.AST) -> str:
  """`a.b.c` for a Name/Attribute chain, else ''."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if isinstance(node, ast.Name):
    parts.append(node.id)
    return ".".join(reversed(parts))
  return ""


def _is_false(node: ast.AST) -> bool:
  return isinstance(node, ast.Constant) and node.value is False


def violations(source: str, filename: str = "<snippet>") -> list[str]:
  """Every forbidden construct in `source`, as `file:line: what`."""
  tree = ast.parse(source, filename=filename)
  found = []

  def report(node: ast.AST, what: str):
    found.append(f"{filename}:{node.lineno}: {what}")

  functions: list[str] = []

  class Visitor(ast.NodeVisitor):
    def visit_FunctionDef(self, node):
      functions.append(node.name)
      self.generic_visit(node)
      functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node):
      for alias in node.names:
        top = alias.name.partition(".")[0]
        allowed = (alias.name == "subprocess"
                   and (filename, functions[-1] if functions else "") in SUBPROCESS_ALLOWED)
        if top in FORBIDDEN_MODULES and not allowed:
          report(node, f"import {alias.name}")
      self.generic_visit(node)

    def visit_ImportFrom(self, node):
      top = (node.module or "").partition(".")[0]
      if top in FORBIDDEN_MODULES:
        report(node, f"from {node.module} import ...")
      for alias in node.names:
        if top == "os" and alias.name in FORBIDDEN_OS:
          report(node, f"from os import {alias.name}")
        if top == "yaml" and alias.name in UNSAFE_YAML | {"Loader", "UnsafeLoader", "FullLoader"}:
          report(node, f"from yaml import {alias.name}")
        if top == "torch" and alias.name == "load":
          report(node, "from torch import load")
        if top == "importlib" and alias.name == "import_module":
          report(node, "from importlib import import_module (call importlib.import_module)")
      self.generic_visit(node)

    def visit_Call(self, node):
      name = _dotted(node.func)
      last = name.rpartition(".")[2]
      if name in FORBIDDEN_BUILTINS or name in {f"builtins.{b}" for b in FORBIDDEN_BUILTINS}:
        report(node, f"{name}()")
      if name.startswith("os.") and last in FORBIDDEN_OS:
        report(node, f"{name}()")
      if name.startswith("torch.") and last == "load":
        report(node, f"{name}() (unpickles; use safetensors)")
      if name.startswith("yaml.") and last in UNSAFE_YAML:
        report(node, f"{name}() (use yaml.safe_load)")
      if last == "read_pickle":
        report(node, f"{name}()")
      if name.endswith("import_module"):
        if name != "importlib.import_module":
          report(node, f"{name}()")
        elif (filename, functions[-1] if functions else "") not in IMPORT_MODULE_ALLOWED:
          report(node, "importlib.import_module() outside the reward-function loader")
      for kw in node.keywords:
        if kw.arg == "allow_pickle" and not _is_false(kw.value):
          report(node, "allow_pickle not False")
        if kw.arg == "trust_remote_code" and not _is_false(kw.value):
          report(node, "trust_remote_code not False")
        if kw.arg == "shell" and not _is_false(kw.value):
          report(node, "shell= not False")
        if kw.arg is None:  # **kwargs could smuggle trust_remote_code=True into a loader
          if last == "from_pretrained" and ("Auto" in name or "transformers" in name):
            report(node, f"{name}(**...) (pass trust_remote_code=False explicitly)")
      if last == "from_pretrained" and ("Auto" in name or "transformers" in name):
        if not any(kw.arg == "trust_remote_code" and _is_false(kw.value) for kw in node.keywords):
          report(node, f"{name}() without trust_remote_code=False")
      self.generic_visit(node)

  Visitor().visit(tree)
  return found


def _package_files() -> list[pathlib.Path]:
  files = sorted(PACKAGE.rglob("*.py"))
  assert len(files) > 20 and PACKAGE / "runs" / "ppo.py" in files
  return files


def test_package_source_has_no_unsafe_loading_or_command_execution():
  found = []
  for path in _package_files():
    found += violations(path.read_text(encoding="utf-8"), path.relative_to(PACKAGE).as_posix())
  assert found == [], "\n".join(found)


def test_the_reward_loader_is_the_only_import_module_and_auto_loaders_refuse_remote_code():
  calls = {}
  for path in _package_files():
    rel = path.relative_to(PACKAGE).as_posix()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      if isinstance(node, ast.Call):
        name = _dotted(node.func)
        if name == "importlib.import_module" or name.endswith(".from_pretrained"):
          calls.setdefault(name, set()).add(rel)
  assert calls["importlib.import_module"] == {"rewards/specs.py"}
  # The scan above saw the Hugging Face loaders (and passed them: trust_remote_code=False).
  assert any(name.endswith("AutoTokenizer.from_pretrained") for name in calls)
  assert any(name.endswith("AutoConfig.from_pretrained") for name in calls)


@pytest.mark.parametrize(
    "snippet, what",
    [
        ("import pickle", "import pickle"),
        ("import cloudpickle as cp", "import cloudpickle"),
        ("from joblib import load", "from joblib import"),
        ("import subprocess", "import subprocess"),
        ("from subprocess import run", "from subprocess import"),
        ("import torch\nw = torch.load('x.pt')", "torch.load()"),
        ("from torch import load", "from torch import load"),
        ("import numpy as np\nnp.load('x.npy', allow_pickle=True)", "allow_pickle not False"),
        ("import numpy as np\nnp.load('x.npz', allow_pickle=flag)", "allow_pickle not False"),
        ("import yaml\nyaml.load(text, Loader=yaml.Loader)", "yaml.load()"),
        ("import yaml\nyaml.unsafe_load(text)", "yaml.unsafe_load()"),
        ("from yaml import load", "from yaml import load"),
        ("import transformers\ntransformers.AutoModel.from_pretrained(p, trust_remote_code=True)",
         "trust_remote_code not False"),
        ("import transformers\ntransformers.AutoTokenizer.from_pretrained(p)",
         "without trust_remote_code=False"),
        ("from transformers import AutoConfig\nAutoConfig.from_pretrained(p, **kw)",
         "AutoConfig.from_pretrained(**...)"),
        ("import os\nos.system(config.path)", "os.system()"),
        ("import os\nos.popen(cmd)", "os.popen()"),
        ("import os\nos.execvp(a, b)", "os.execvp()"),
        ("from os import system", "from os import system"),
        ("eval(config.reward_function)", "eval()"),
        ("exec(code)", "exec()"),
        ("f = compile(src, 'x', 'exec')", "compile()"),
        ("m = __import__(name)", "__import__()"),
        ("import builtins\nbuiltins.eval(s)", "builtins.eval()"),
        ("run(cmd, shell=True)", "shell= not False"),
        ("import pandas as pd\npd.read_pickle(p)", "pd.read_pickle()"),
        ("import importlib\ndef load(n):\n  return importlib.import_module(n)",
         "importlib.import_module() outside the reward-function loader"),
        ("from importlib import import_module", "from importlib import import_module"),
    ],
)
def test_the_scanner_finds_each_violation(snippet, what):
  found = violations(snippet)
  assert len(found) >= 1 and any(what in f for f in found), found


def test_the_scanner_passes_safe_code():
  safe = textwrap.dedent("""
      import importlib, json, yaml, numpy as np, transformers
      from safetensors import safe_open
      data = yaml.safe_load(text)
      arr = np.load("x.npy")
      arr2 = np.load("x.npy", allow_pickle=False)
      tok = transformers.AutoTokenizer.from_pretrained(p, trust_remote_code=False)
      model = from_pretrained(p)
      json.load(f)
      evaluate(x)
  """)
  assert violations(safe) == []
  launcher = "def run_processes():\n  import subprocess\n  return subprocess"
  assert violations(launcher, "diagnostics/scale_check.py") == []
  assert violations(launcher, "parallel/other.py") != []
  assert violations("import subprocess", "diagnostics/scale_check.py") != []
  allowed = "import importlib\ndef import_reward_function(s):\n  return importlib.import_module(s)"
  assert violations(allowed, "rewards/specs.py") == []
  assert violations(allowed, "trainer/other.py") != []


# ---- module:function rewards ---------------------------------------------------------------------


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
  """A fresh module on sys.path (unique name) with a reward function, plus a sibling module that
  leaves a marker file when imported; returns `(module name, marker path)`."""
  name = f"user_rewards_{uuid.uuid4().hex[:8]}"
  marker = tmp_path / "sibling_imported"
  (tmp_path / f"{name}.py").write_text(textwrap.dedent(f"""
      from os import system  # re-exported: must not be usable as {name}:system
      NOT_CALLABLE = 3

      def score(prompts, responses):
        return [float(len(r.split())) for r in responses]

      class Scorer:
        def __call__(self, prompts, responses):
          return [0.0] * len(responses)

      instance = Scorer()
  """))
  (tmp_path / f"{name}_sibling.py").write_text(
      f"open({str(marker)!r}, 'w').write('imported')\n")
  (tmp_path / f"{name}_broken.py").write_text("raise RuntimeError('cannot import me')\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  yield name, marker
  for mod in [m for m in sys.modules if m.startswith(name)]:
    del sys.modules[mod]


def test_a_module_function_reward_imports_only_the_named_module(reward_module):
  name, marker = reward_module
  before = set(sys.modules)
  fn = specs.import_reward_function(f"{name}:score")
  assert set(sys.modules) - before == {name}
  assert not marker.exists()  # the sibling module was not imported
  assert fn(["a"], ["good fun movie"]) == [3.0]
  assert callable(specs.import_reward_function(f"{name}:instance"))  # a callable object is fine

  class Tok:
    def decode(self, ids):
      return " ".join(f"w{i}" for i in ids)

  from types import SimpleNamespace
  rollout = SimpleNamespace(
      prompt_ids=np.array([[0, 3], [4, 5]]), prompt_mask=np.array([[0, 1], [1, 1]]),
      response_ids=np.array([[6, 7, 0], [8, 0, 0]]),
      response_mask=np.array([[1, 1, 0], [1, 0, 0]], bool))
  scorer = specs.reward_function(f"{name}:score", Tok())
  assert isinstance(scorer, FunctionScorer) and scorer.name == f"{name}:score"
  assert np.asarray(scorer(rollout)).tolist() == [2.0, 1.0]


def test_a_run_config_naming_a_module_does_not_import_it(reward_module, tmp_path):
  name, marker = reward_module
  config = run_config.RunConfig(policy_path="p", prompts_path="x.txt", run_dir=str(tmp_path / "r"),
                         reward_function=f"{name}_sibling:score")
  assert config.reward_function == f"{name}_sibling:score"
  assert not marker.exists() and f"{name}_sibling" not in sys.modules


@pytest.mark.parametrize(
    "spec, message",
    [
        ("{name}_missing:score", r"no module named '{name}_missing'; install the package, or put "
                                 r"its folder on PYTHONPATH"),
        ("{name}:scor", r"module '{name}' \(.*{name}.py\) has no attribute 'scor' \(did you "
                        r"mean 'score'\?\); its functions: \['instance', 'score'\]"),
        ("{name}:NOT_CALLABLE", r"{name}.NOT_CALLABLE is a int, not a function"),
        ("{name}:Scorer", r"{name}.Scorer is a type, not a function"),
        ("{name}:system", r"'system' is defined in '(posix|nt)', not in '{name}' \(it is imported "
                          r"there\)"),
        ("{name}_broken:score", r"importing '{name}_broken' failed with RuntimeError: cannot "
                                r"import me"),
    ],
)
def test_module_reward_errors(reward_module, spec, message):
  name, _ = reward_module
  with pytest.raises(ValueError, match=r"RunConfig.reward_function=.* is invalid: "
                                       + message.format(name=name)):
    specs.import_reward_function(spec.format(name=name))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("os:system", "'os' is a standard-library module"),
        ("os.path:join", "'os.path' is a standard-library module"),
        ("subprocess:run", "'subprocess' is a standard-library module"),
        ("builtins:eval", "'builtins' is a standard-library module"),
        ("posix:system", "'posix' is a standard-library module"),
        ("jax_ppo.cli:main", "'jax_ppo.cli' is a jax_ppo module"),
    ],
)
def test_standard_library_and_jax_ppo_functions_are_refused(monkeypatch, spec, message):
  calls = []
  monkeypatch.setattr(os, "system", lambda *a: calls.append(a))
  with pytest.raises(ValueError, match=message):
    specs.reward_function(spec)
  assert calls == []


@pytest.mark.parametrize(
    "spec",
    [
        "__import__('os').system('touch {marker}'):f",
        "os.system('touch {marker}')",
        "mod:score()",
        "mod:score; import os",
        "mod:os.system",
        "mod.:score",
        "mod:",
        ":score",
        "mod:score:extra",
        "import:score",  # a keyword is not a module name
        "mod:__class__",
    ],
)
def test_specs_are_never_evaluated(tmp_path, spec):
  marker = tmp_path / "pwned"
  spec = spec.format(marker=marker)
  before = set(sys.modules)
  with pytest.raises(ValueError, match=r"RunConfig.reward_function=.* is invalid"):
    run_config.RunConfig(policy_path="p", prompts_path="x.txt", run_dir="r", reward_function=spec)
  with pytest.raises(ValueError, match=r"RunConfig.reward_function=.* is invalid"):
    specs.reward_function(spec)
  assert not marker.exists()
  assert set(sys.modules) == before
