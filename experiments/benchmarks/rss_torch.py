"""Peak RSS of a tiny `jax-ppo train` in an environment without torch and in one with torch.

transformers 5 imports torch whenever torch is installed (as soon as `AutoConfig` or
`AutoTokenizer` load: `transformers.configuration_utils` imports `modeling_rope_utils`), and
tensorboardX's writer imports it too; jax_ppo itself never does, and the `jax-ppo` program hides
torch from both (`jax_ppo.cli.hide_torch_from_libraries`) unless JAX_PPO_TORCH=1. This script
measures what a run holds: it writes a tiny random Llama checkpoint (1 layer, hidden size 16, a
32-word word-level tokenizer) and a prompts file with numpy, safetensors and tokenizers (no
torch), then runs the same `jax-ppo train` (`jax_ppo.cli.run`, the program's entry point;
reward `length`, batch 4, 4 new tokens, 2 updates) in a fresh subprocess of each given Python,
and once more in the environment with torch with JAX_PPO_TORCH=1 (transformers and tensorboardX
then import torch, as they do in a Python process of the user's), `--repeats` times,
alternating the three. Each run reports its peak RSS (`VmHWM`, `rss.peak_rss_mib`), whether
torch is installed and whether it ended up in `sys.modules`; the record adds what `import
torch` alone holds in the environment with torch (its peak over a bare interpreter's). Each run
gets its own run folder and an empty JAX compilation cache, so every run compiles; all run the
jax_ppo of this checkout (`PYTHONPATH`).

    python experiments/benchmarks/rss_torch.py /tmp/notorch/bin/python .venv/bin/python \
        --json experiments/benchmarks/results/rss_torch_DATE.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import textwrap

BENCH = pathlib.Path(__file__).resolve().parent
ROOT = BENCH.parents[1]
sys.path.insert(0, str(BENCH))
from host import host_line, host_record  # noqa: E402

from jax_ppo.cli import TORCH_ENV  # noqa: E402  (the command line's module: no jax at import)

WORDS = ("the a movie film plot actor story was is very really not quite good great fun bad "
         "dull boring long short and but I liked hated it this review").split()
SPECIAL = ["<pad>", "<|endoftext|>", "<unk>"]  # PAD 0, EOS 1, UNK 2
PROMPTS = ["the movie was", "I liked the plot and", "the actor is", "it was really",
           "a story", "the film is not", "I hated it but", "this review"]
TRAIN_ARGS = ("reward_function=length", "ppo.batch_size=4", "ppo.num_minibatches=1",
              "ppo.sampling.max_new_tokens=4", "ppo.total_updates=2", "run.progress=false")
"""The `jax-ppo train` overrides besides the paths (the checkpoint, the prompts, the run folder)."""

PACKAGES = ("jax", "flax", "transformers", "tensorboardX", "torch")
"""The installed versions each run records (torch's without importing it)."""

CHILD = textwrap.dedent("""
    import importlib.metadata, importlib.util, json, sys
    sys.path.insert(0, {bench!r})
    from rss import peak_rss_mib
    from jax_ppo import cli
    try:
      cli.run()  # the `jax-ppo` program: main on sys.argv[1:], torch kept out of its libraries
    except SystemExit as e:
      status = e.code
    def version(name):
      try:
        return importlib.metadata.version(name)
      except importlib.metadata.PackageNotFoundError:
        return None
    print("RSS_TORCH " + json.dumps(dict(
        status=status, peak_mib=peak_rss_mib(), torch_imported="torch" in sys.modules,
        torch_installed=importlib.util.find_spec("torch") is not None,
        versions={{n: version(n) for n in {packages!r}}},
        python=sys.version.split()[0])))
""")


def write_inputs(root: pathlib.Path) -> tuple[str, str]:
  """Writes the tiny Llama checkpoint and the prompts file under `root`; returns their paths."""
  import numpy as np
  import tokenizers
  import transformers
  from safetensors.numpy import save_file

  vocab = {w: i for i, w in enumerate([*SPECIAL, *WORDS])}
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  backend.decoder = tokenizers.decoders.WordPiece(prefix="##")
  policy = root / "policy"
  transformers.PreTrainedTokenizerFast(
      tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<pad>",
      unk_token="<unk>").save_pretrained(policy)
  v, d, f, heads, kv, head_dim = len(vocab), 16, 32, 2, 1, 8
  transformers.LlamaConfig(
      vocab_size=v, hidden_size=d, intermediate_size=f, num_hidden_layers=1,
      num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
      max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1, eos_token_id=1,
      pad_token_id=0).save_pretrained(policy)
  layer = "model.layers.0."
  shapes = {"model.embed_tokens.weight": (v, d), "lm_head.weight": (v, d),
            "model.norm.weight": (d,), layer + "input_layernorm.weight": (d,),
            layer + "post_attention_layernorm.weight": (d,),
            layer + "self_attn.q_proj.weight": (heads * head_dim, d),
            layer + "self_attn.k_proj.weight": (kv * head_dim, d),
            layer + "self_attn.v_proj.weight": (kv * head_dim, d),
            layer + "self_attn.o_proj.weight": (d, heads * head_dim),
            layer + "mlp.gate_proj.weight": (f, d), layer + "mlp.up_proj.weight": (f, d),
            layer + "mlp.down_proj.weight": (d, f)}
  rng = np.random.default_rng(0)
  tensors = {name: (np.ones(shape, np.float32) if name.endswith("norm.weight")
                    else rng.standard_normal(shape).astype(np.float32) * 0.1)
             for name, shape in shapes.items()}
  save_file(tensors, str(policy / "model.safetensors"), metadata={"format": "pt"})
  prompts = root / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
  return str(policy), str(prompts)


def run_once(python: str, policy: str, prompts: str, root: pathlib.Path,
             extra_env: dict[str, str]) -> dict:
  """One `jax-ppo train` in a fresh `python` subprocess with `extra_env` set; returns its
  record (CHILD above)."""
  run_dir = tempfile.mkdtemp(prefix="run_", dir=root)
  env = {k: v for k, v in os.environ.items() if k != TORCH_ENV}
  env.update(PYTHONPATH=str(ROOT), JAX_PPO_CACHE_DIR=tempfile.mkdtemp(prefix="xla_", dir=root),
             **extra_env)
  args = [f"policy_path={policy}", f"prompts_path={prompts}", f"run_dir={run_dir}", *TRAIN_ARGS]
  code = CHILD.format(bench=str(BENCH), packages=PACKAGES)
  out = subprocess.run([python, "-c", code, "train", *args], capture_output=True, text=True,
                       env=env)
  lines = [line for line in out.stdout.splitlines() if line.startswith("RSS_TORCH ")]
  if out.returncode != 0 or not lines:
    raise RuntimeError(f"{python}: jax-ppo train failed (exit {out.returncode}):\n"
                       f"{out.stderr[-4000:]}")
  record = json.loads(lines[-1].removeprefix("RSS_TORCH "))
  if record["status"] != 0:
    raise RuntimeError(f"{python}: jax-ppo train returned {record['status']}:\n"
                       f"{out.stderr[-4000:]}")
  return record


def import_peak_mib(python: str, code: str) -> float:
  """Peak RSS, in MiB, of a fresh `python` that runs only `code` (e.g. `import torch`)."""
  child = (f"{code}\nimport sys\nsys.path.insert(0, {str(BENCH)!r})\n"
           "from rss import peak_rss_mib\nprint(peak_rss_mib())")
  out = subprocess.run([python, "-c", child], capture_output=True, text=True, check=True)
  return float(out.stdout.split()[-1])


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("python_without", help="a Python whose environment has no torch")
  p.add_argument("python_with", help="a Python whose environment has torch installed")
  p.add_argument("--repeats", type=int, default=3, help="runs per Python (the median is reported)")
  p.add_argument("--json", default=None, help="write the record here")
  args = p.parse_args(argv)
  if args.repeats < 1:
    p.error(f"--repeats must be at least 1, got {args.repeats}")
  pythons = {"without_torch": (args.python_without, {}),
             "with_torch": (args.python_with, {}),
             "with_torch_JAX_PPO_TORCH=1": (args.python_with, {TORCH_ENV: "1"})}
  results = dict(date=datetime.date.today().isoformat(), host=host_record(),
                 train_args=list(TRAIN_ARGS), repeats=args.repeats, runs={})
  with tempfile.TemporaryDirectory(prefix="rss_torch_") as tmp:
    root = pathlib.Path(tmp)
    policy, prompts = write_inputs(root)
    records = {label: [] for label in pythons}
    for _ in range(args.repeats):
      for label, (python, extra_env) in pythons.items():  # Alternated: host drift hits all alike.
        records[label].append(run_once(python, policy, prompts, root, extra_env))
  for label, (python, extra_env) in pythons.items():
    first = records[label][0]
    peaks = [r["peak_mib"] for r in records[label]]
    results["runs"][label] = dict(
        python=python, env=extra_env, versions=first["versions"], python_version=first["python"],
        torch_installed=first["torch_installed"],
        torch_imported=[r["torch_imported"] for r in records[label]],
        peak_mib=peaks, median_peak_mib=statistics.median(peaks))
  without, with_, opted_in = (results["runs"][k]["median_peak_mib"] for k in pythons)
  results["with_over_without"] = with_ / without
  results["opted_in_over_without"] = opted_in / without
  if results["runs"]["with_torch"]["torch_installed"]:  # What torch's import alone holds.
    bare = import_peak_mib(args.python_with, "pass")
    results["torch_import_alone_mib"] = import_peak_mib(args.python_with, "import torch") - bare
  print(host_line(results["host"]))
  print(f"{'environment':<27} {'torch installed':>15} {'torch imported':>15} "
        f"{'median peak RSS':>16}  runs (MiB)")
  for label, run in results["runs"].items():
    imported = "yes" if all(run["torch_imported"]) else (
        "no" if not any(run["torch_imported"]) else "mixed")
    print(f"{label:<27} {'yes' if run['torch_installed'] else 'no':>15} {imported:>15} "
          f"{run['median_peak_mib']:>12.0f} MiB  "
          + ", ".join(f"{m:.0f}" for m in run["peak_mib"]))
  print(f"with torch / without torch: {results['with_over_without']:.2f}; with torch and "
        f"{TORCH_ENV}=1 / without torch: {results['opted_in_over_without']:.2f}")
  if "torch_import_alone_mib" in results:
    print(f"`import torch` alone: +{results['torch_import_alone_mib']:.0f} MiB over a bare "
          "interpreter")
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(results, fh, indent=2)
  return results


if __name__ == "__main__":
  main()
