"""The README's commands and example are real.

The first two shell blocks are the two set-up-to-result commands, unchanged (`.ci/run` runs the
second one's pytest). Every later `jax-ppo` command line is checked without training anything:
`jax-ppo config` runs (its output is the `run.yaml` the next commands read), the config of
`train`, `sft`, `reward` and `plan` loads through the verb's own loader with the line's
`key=value` overrides, and the options of `eval` and `export` are ones the verb's `--help`
lists. The Python example's imports, module attributes, keyword arguments and methods exist.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import io
import pathlib
import re
import shlex

from jax_ppo.cli import main
from jax_ppo.runs.stages import load_stage_run_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
BASH = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)
PYTHON = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
QUICKSTART = ('python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[experiments]" '
              "&& python experiments/quickstart.py")
TESTS = ('python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 -e '
         '".[test]" && python -m pytest -q')
STAGE_OF = {"train": "ppo", "sft": "sft", "reward": "reward"}


def _command_lines() -> list[list[str]]:
  """The `jax-ppo` commands of the shell blocks after the first two, as argument lists (comments
  dropped, continuation lines joined, `VAR=value` prefixes removed; a `> FILE` redirection kept
  as its last two items)."""
  commands = []
  for block in BASH.findall(README)[2:]:
    for line in block.replace("\\\n", " ").splitlines():
      words = shlex.split(line, comments=True)
      while words and re.match(r"^[A-Z_]+=", words[0]):
        words = words[1:]
      if words and words[0] == "jax-ppo":
        commands.append(words[1:])
  return commands


def test_the_two_commands_come_first_and_unchanged():
  blocks = [block.strip() for block in BASH.findall(README)]
  assert blocks[:2] == [QUICKSTART, TESTS]
  assert "\npython -m pytest -q\n" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_every_verb_is_in_the_command_table():
  help_text = _output(["--help"])
  verbs = re.findall(r"^    (\w+) ", help_text, re.M)
  assert len(verbs) >= 9, help_text
  missing = [verb for verb in verbs if f"| `jax-ppo {verb}" not in README]
  assert not missing, f"the README's command table lacks {missing}"


def test_command_lines_are_real(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  commands = _command_lines()
  verbs = [argv[0] for argv in commands]
  assert {"config", "train", "plan", "sft", "reward", "eval", "export"} <= set(verbs), verbs
  for argv in commands:
    verb, rest = argv[0], argv[1:]
    out = None
    if ">" in rest:
      out, rest = rest[rest.index(">") + 1], rest[: rest.index(">")]
    rest = [str(ROOT / word) if (ROOT / word).is_file() else word for word in rest]
    if verb == "config":
      (tmp_path / out).write_text(_output(["config", *rest]), encoding="utf-8")
    elif verb in STAGE_OF:
      load_stage_run_config(STAGE_OF[verb], rest)
    elif verb == "plan":
      assert "--topology" in rest, argv
      values = _drop_options(rest, ("--topology", "--stage", "--json", "--model"))
      load_stage_run_config("ppo", values)
    else:
      options = [word.split("=")[0] for word in rest if word.startswith("--")]
      help_text = _output([verb, "--help"])
      unknown = [option for option in options if option not in help_text]
      assert not unknown, f"jax-ppo {verb} has no options {unknown}"


def test_the_recipe_config_is_the_one_described(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  config_line = next(argv for argv in _command_lines() if argv[0] == "config")
  (tmp_path / "run.yaml").write_text(_output(config_line[: config_line.index(">")]),
                                     encoding="utf-8")
  gpu = load_stage_run_config("ppo", ["run.yaml"])
  tpu = load_stage_run_config("ppo", ["run.yaml", "mesh.fsdp=8"])
  assert gpu.policy_path == "models/Qwen3-0.6B" and gpu.dtype == "bfloat16"
  assert gpu.ppo.advantage_mode == "grpo" and gpu.mesh is None
  assert tpu.mesh is not None and tpu.mesh.fsdp == 8


def test_python_example_names_exist():
  code = PYTHON.findall(README)[0]
  tree = ast.parse(code)
  namespace: dict = {}
  for node in tree.body:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      exec(compile(ast.Module(body=[node], type_ignores=[]), "README", "exec"), namespace)
  assert namespace, "the README's Python example imports nothing"
  types: dict[str, type] = {}  # variable -> the class a call built it from
  problems = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
      owner = namespace.get(node.value.id, types.get(node.value.id))
      if owner is not None and not hasattr(owner, node.attr):
        problems.append(f"{node.value.id}.{node.attr}")
    if isinstance(node, ast.Call):
      target = _resolve(node.func, namespace)
      if target is not None:
        params = inspect.signature(target).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        problems += [f"{ast.unparse(node.func)}({kw.arg}=)" for kw in node.keywords
                     if kw.arg is not None and kw.arg not in params and not takes_any]
    if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
        and isinstance(target := _resolve(node.value.func, namespace), type)):
      types.update({t.id: target for t in node.targets if isinstance(t, ast.Name)})
  assert not problems, f"the README's Python example names what does not exist: {problems}"


def _resolve(func: ast.expr, namespace: dict):
  if isinstance(func, ast.Name):
    return namespace.get(func.id)
  if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
    owner = namespace.get(func.value.id)
    if inspect.ismodule(owner):
      return getattr(owner, func.attr, None)
  return None


def _drop_options(words: list[str], options: tuple[str, ...]) -> list[str]:
  out, skip = [], False
  for word in words:
    if skip:
      skip = False
    elif word in options:
      skip = True
    else:
      out.append(word)
  return out


def _output(argv: list[str]) -> str:
  """What `jax-ppo ARGV` prints (a `--help` exits 0)."""
  buffer = io.StringIO()
  with contextlib.redirect_stdout(buffer):
    try:
      assert main(argv) in (0, None)
    except SystemExit as exit_:
      assert exit_.code == 0, argv
  return buffer.getvalue()


def test_resolve_sees_through_modules():
  """`_resolve` finds a module attribute (so the example check above cannot pass vacuously)."""
  namespace = {"m": importlib.import_module("jax_ppo.models")}
  assert _resolve(ast.parse("m.from_pretrained").body[0].value, namespace) is not None
