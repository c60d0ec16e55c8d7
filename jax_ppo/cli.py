"""`jax-ppo`: the command line over `jax_ppo.runs.ppo`.

    jax-ppo train CONFIG [key=value ...]      # train, or resume the run in run_dir
    jax-ppo eval --run-dir DIR --prompts FILE [--greedy | --temperature T [--n N]] [--out FILE]
    jax-ppo export --run-dir DIR --out PATH [--adapter]
    jax-ppo plot RUN_DIR                      # PNG plots of metrics.jsonl into RUN_DIR/plots
    jax-ppo sft CONFIG [key=value ...]        # SFT stage (jax_ppo.runs.sft)
    jax-ppo reward CONFIG [key=value ...]     # reward-model stage (jax_ppo.runs.reward)
    jax-ppo dpo CONFIG [key=value ...]        # DPO on preference pairs (jax_ppo.runs.dpo)
    jax-ppo plan CONFIG [key=value ...] --topology v5e:2x4 [--stage STAGE] [--model NAME]
        [--json PATH]                         # compile the run for a TPU slice (or GPUs: h100:8)
    jax-ppo pipeline CONFIG [key=value ...]   # SFT -> reward model -> PPO (jax_ppo.runs.pipeline)
    jax-ppo config {train,sft,reward,dpo,pipeline} [key=value ...]  # a documented default config

`CONFIG` is a YAML/JSON `RunConfig` (`jax_ppo.runs.ppo`); `key=value` arguments override its
fields (`ppo.optimizer.learning_rate=1e-6`, `preset=dialogue`, `lora.rank=16`); `plan` reads the
config of `train` (`--stage ppo`, the default), `sft` or `reward` (`--stage sft|reward`). Running
the same `train` command again continues the run from its latest checkpoint; SIGTERM or SIGINT (a
preemption) saves a checkpoint and exits 0 with a message saying so. `train`, `sft`, `reward`, `dpo`
join a multi-host job first when the config's `distributed` fields or the environment describe
one, `eval` and `export` when the environment does (`jax_ppo.parallel.distributed`;
tpu/README.md). Errors in the inputs are reported in one line naming the field and the fix (exit
status 2).

The `jax-ppo` program (`run`) keeps torch out of the process when it is installed: jax_ppo never
uses it, but transformers and tensorboardX would import it (`hide_torch_from_libraries`). Set
JAX_PPO_TORCH=1 for code of your own that runs PyTorch models through transformers in the same
process (a reward function, say).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shlex
import sys
from collections.abc import Sequence

RUN_CONFIGS = {"sft": "SFTRunConfig", "reward": "RewardRunConfig", "dpo": "DPORunConfig"}
"""Offline stage verb -> the name of its run config (for the verbs' `--help`)."""

TORCH_ENV = "JAX_PPO_TORCH"
"""Environment variable: 1 (or true, yes, on) lets the `jax-ppo` program's libraries use torch."""

TORCH_FREE_COMMANDS = frozenset(
    {"train", "eval", "export", "sft", "reward", "dpo", "plan", "pipeline"})
"""The verbs that load transformers (configs, tokenizers) or tensorboardX, so hide torch first."""


def hide_torch_from_libraries() -> bool:
  """Makes transformers and tensorboardX take torch for absent in this process; True if it did.

  jax_ppo never uses torch, but where torch is installed transformers 5 imports it as soon as a
  config or tokenizer class loads (`configuration_utils` imports `modeling_rope_utils`, which
  imports torch), and tensorboardX's writer imports it too: about 200 MiB of RSS and a second of
  start-up in every process. Both libraries ask Python whether torch exists once. While
  `sys.modules["torch"]` is None, `importlib.util.find_spec("torch")` answers None and `import
  torch` raises ImportError; this imports transformers' availability check (whose answer,
  `is_torch_available()`, is cached for the process) and tensorboardX's writer (which catches
  the ImportError) under that entry, then removes it. Code of the user's can still `import torch`
  afterwards; only transformers keeps taking torch for absent (its PyTorch models refuse to load).

  Does nothing, and returns False, when torch is not installed or is imported already, or when
  the environment sets JAX_PPO_TORCH=1. For the `jax-ppo` program only (`run`): in a process of
  the user's (a notebook, a test session) it would take transformers' PyTorch models away.
  """
  if os.environ.get(TORCH_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
    return False
  if "torch" in sys.modules or importlib.util.find_spec("torch") is None:
    return False
  sys.modules["torch"] = None  # type: ignore[assignment]
  advice = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
  os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"  # not "PyTorch was not found": it is
  try:
    from transformers.utils import import_utils

    import_utils.is_torch_available()
    try:
      import tensorboardX.writer  # noqa: F401
    except ImportError:  # tensorboardX not installed: nothing of it to keep torch-free
      pass
  finally:
    del sys.modules["torch"]
    if advice is None:
      del os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"]
    else:
      os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = advice
  return True


def _parser() -> argparse.ArgumentParser:
  from jax_ppo.diagnostics.shapes import COMMON_SHAPES, SHAPE_PREFIX

  parser = argparse.ArgumentParser(
      prog="jax-ppo", description="PPO fine-tuning of language models (RLHF) in JAX."
  )
  commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

  train = commands.add_parser(
      "train", help="train a policy, or resume the run in run_dir",
      description="Train (or resume) a run. CONFIG is a YAML/JSON RunConfig; key=value "
                  "arguments override its fields, e.g. ppo.optimizer.learning_rate=1e-6 "
                  "preset=dialogue run.updates_per_run=100.",
  )
  train.add_argument("args", nargs="*", metavar="CONFIG | key=value")

  evaluate = commands.add_parser(
      "eval", help="sample and score held-out prompts with a run's checkpoint",
      description="Sample held-out prompts with the latest (or a given) checkpoint and score "
                  "them; writes JSON metrics and samples.",
  )
  evaluate.add_argument("--run-dir", required=True, help="run folder written by `train`")
  evaluate.add_argument("--prompts", required=True, help=".txt or .jsonl prompts file")
  how = evaluate.add_mutually_exclusive_group()
  how.add_argument("--greedy", action="store_true", help="greedy decoding (the default)")
  how.add_argument("--temperature", type=float, help="sample at this temperature instead")
  evaluate.add_argument("--n", type=int, default=1,
                        help="samples per prompt; reports best-of-n (needs --temperature)")
  evaluate.add_argument("--out", help="JSON output (default RUN_DIR/eval/step_<step>.json)")
  evaluate.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
  evaluate.add_argument("--seed", type=int, default=0, help="sampling seed")

  plot = commands.add_parser(
      "plot", help="write PNG plots of a run's metrics",
      description="Write PNG plots of RUN_DIR/metrics.jsonl into RUN_DIR/plots: one per panel of "
                  "the run's stage (PPO: reward, KL and entropy per response and per token, "
                  "response length, losses; SFT, reward model, DPO: loss, accuracy, ...) and "
                  "overview.png.",
  )
  plot.add_argument("run_dir", metavar="RUN_DIR", help="run folder holding metrics.jsonl")
  plot.add_argument("--out", help="output folder (default RUN_DIR/plots)")

  export = commands.add_parser(
      "export", help="write a checkpoint's policy as a Hugging Face folder",
      description="Write the policy of the latest (or a given) checkpoint, LoRA merged and value "
                  "head dropped, with its tokenizer, as a Hugging Face causal-LM folder.",
  )
  export.add_argument("--run-dir", required=True, help="run folder written by `train`")
  export.add_argument("--out", required=True,
                      help="output folder: new, empty, or an earlier export (replaced once the "
                           "new one is complete); never the run folder or a folder it reads")
  export.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
  export.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                      help="dtype of the written weights (default: as trained)")
  export.add_argument("--adapter", action="store_true",
                      help="write the policy's LoRA adapters as a PEFT adapter folder (loadable by "
                           "peft.PeftModel.from_pretrained on the starting policy) instead of the "
                           "merged model; the run must have trained LoRA")
  plan = commands.add_parser(
      "plan", help="compile a run's programs for a TPU slice or GPU nodes on this host: per-chip "
                   "HBM, fit, roofline time (TPUs)",
      description="Compile the programs of a run ahead of time for a TPU slice that need not be "
                  "present, with the run's mesh over its chips and abstract parameters (the "
                  "model's config.json only, no weights; or, with --model NAME, a common model's "
                  "architecture from a built-in table), and print per chip: peak HBM, argument "
                  "and temporary bytes, FLOPs and bytes accessed (every loop trip counted) and "
                  "the roofline time; `fits` says whether every program's peak fits the chip's "
                  "HBM. CONFIG is the config file of `jax-ppo train` (--stage ppo, the default: "
                  "the sampler, the experience and update programs), `jax-ppo sft` (--stage sft) "
                  "or `jax-ppo reward` (--stage reward: the train and eval steps); a config file "
                  "does not say which (an SFT and a reward config may hold the same keys), so "
                  "--stage does, and a config of another kind is refused naming its kind. A TPU "
                  "slice needs libtpu: pip install \"jax_ppo[tpu]\"; GPU nodes (h100:8, "
                  "h200:2x8, a100-80gb:8) need JAX's CUDA plugin, pip install "
                  "\"jax_ppo[plan-gpu]\", and get memory and fit only (XLA's GPU compiler has no "
                  "cost analysis without a GPU) (jax_ppo.diagnostics.ppo_plan, "
                  "jax_ppo.diagnostics.stage_plan).",
  )
  plan.add_argument("args", nargs="*", metavar="CONFIG | key=value")
  plan.add_argument("--topology", required=True,
                    help="TPU slice, e.g. v5e:2x2, v5e:2x4, v5p:2x2x4, v6e:2x2, or GPU "
                         "nodes, PART:GPUS or PART:NODESxGPUS with PART h100, h200 or a100-80gb, "
                         "e.g. h100:8, h200:2x8")
  plan.add_argument("--stage", choices=("ppo", "sft", "reward"), default="ppo",
                    help="which run CONFIG configures: ppo (`jax-ppo train`, the default), sft "
                         "(`jax-ppo sft`) or reward (`jax-ppo reward`)")
  plan.add_argument("--json", dest="json_path", metavar="PATH", help="also write the plan here")
  plan.add_argument("--model", choices=sorted(COMMON_SHAPES), metavar="NAME",
                    help="plan this common model instead of the config's policy_path (--stage "
                         "ppo) or model_path (sft, reward), from its architecture alone (nothing "
                         f"downloaded): one of {', '.join(COMMON_SHAPES)}; the same as "
                         f"policy_path={SHAPE_PREFIX}NAME or model_path={SHAPE_PREFIX}NAME "
                         "(jax_ppo.diagnostics.shapes)")
  plan.add_argument("--prompt-length", type=int,
                    help="PPO only: prompt tokens per row (rounded up to the sampler's bucket; "
                         "default 512)")
  for name, what, example in (
      ("sft", "supervised fine-tuning of a local Hugging Face causal LM (the SFT stage)",
       "model_path=models/qwen3 train_path=sft.jsonl sft.optimizer.learning_rate=1e-5"),
      ("reward", "train, normalise and export a pairwise reward model (the reward stage)",
       "model_path=runs/sft/hf_model train_path=prefs.jsonl reward.num_epochs=2"),
      ("dpo", "train a causal LM with DPO (IPO, hinge, cDPO) on preference pairs against a "
              "frozen reference (the DPO stage)",
       "model_path=runs/sft/hf_model train_path=prefs.jsonl dpo.beta=0.1"),
  ):
    stage = commands.add_parser(
        name, help=f"{what}; resumes the run in run_dir",
        description=f"{what[0].upper()}{what[1:]}. CONFIG is a YAML/JSON "
                    f"{RUN_CONFIGS[name]}; key=value "
                    f"arguments override its fields, e.g. {example}. When the run is complete "
                    "the model is exported to export_dir (default RUN_DIR/hf_model).",
    )
    stage.add_argument("args", nargs="*", metavar="CONFIG | key=value")
  _add_config_commands(commands)
  return parser


def _add_config_commands(commands) -> None:
  """Adds to `commands` (the subparsers) the `pipeline` and `config` verbs, and the config
  sections to the `--help` of the verbs that read a config file (`jax_ppo.runs.templates`)."""
  from jax_ppo.runs.templates import VERBS, sections_help

  pipeline = commands.add_parser(
      "pipeline", help="SFT, then the reward model, then PPO, from one config file",
      description="Run (or resume) SFT, the reward model and PPO in order from one pipeline "
                  "file (jax_ppo.runs.pipeline): each stage trains in out_dir/<stage> and the "
                  "next starts from its export; key=value overrides name the stage first "
                  "(sft.train_path=sft.jsonl, ppo.ppo.total_updates=50) or are top-level "
                  "(model_path=..., out_dir=...). Prints one JSON line per stage; run the same "
                  "command again to continue a stage that stopped early.",
  )
  pipeline.add_argument("args", nargs="*", metavar="CONFIG | key=value")
  config = commands.add_parser(
      "config", help="print a command's default config as YAML, each field documented",
      description="Print the config of `jax-ppo VERB` (train, sft, reward or pipeline) with "
                  "every field at its default and its documentation as a comment; fields "
                  "without a default are commented out and marked REQUIRED. Start a run with "
                  "`jax-ppo config train > run.yaml`, edit it, then `jax-ppo train run.yaml "
                  "run_dir=... policy_path=... prompts_path=... reward_model_path=...`. "
                  "key=value arguments are applied first (e.g. preset=dialogue prints the "
                  "preset's values).",
  )
  config.add_argument("verb", metavar="VERB", help=f"one of {', '.join(VERBS)}")
  config.add_argument("args", nargs="*", metavar="key=value")
  for verb in VERBS:
    commands.choices[verb].epilog = sections_help(verb)


def _config(args: argparse.Namespace) -> int:
  """`jax-ppo config VERB`: prints the verb's documented default config."""
  from jax_ppo.runs.templates import config_template

  sys.stdout.write(config_template(args.verb, args.args))
  return 0


def _pipeline(argv: Sequence[str]) -> int:
  """`jax-ppo pipeline`: runs (or resumes) the stages and prints one JSON summary per stage."""
  from jax_ppo.parallel.distributed import initialize
  from jax_ppo.runs.pipeline import load_pipeline, run_pipeline

  configs = load_pipeline(argv)
  first = next(configs[name] for name in ("sft", "reward", "ppo") if configs[name] is not None)
  initialize(first.distributed)  # before any JAX computation
  summaries = run_pipeline(configs, report=lambda s: print(json.dumps(s), flush=True))
  if summaries and not summaries[-1]["complete"]:
    again = " ".join(["jax-ppo", "pipeline", *map(shlex.quote, argv)])
    print(f"jax-ppo pipeline: stage {summaries[-1]['stage']} is not complete; run the same "
          f"command again to continue: {again}", file=sys.stderr)
  return 0


def _run_stage(command: str, argv: Sequence[str]) -> int:
  """`jax-ppo sft|reward|dpo`: trains (or resumes) the stage and prints its summary as JSON."""
  from jax_ppo.parallel.distributed import initialize

  if command == "sft":
    from jax_ppo.runs.sft import load_sft_config, run_sft

    config = load_sft_config(argv)
    initialize(config.distributed)  # before any JAX computation
    summary = run_sft(config)
  elif command == "dpo":
    from jax_ppo.runs.dpo import load_dpo_config, run_dpo

    config = load_dpo_config(argv)
    initialize(config.distributed)
    summary = run_dpo(config)
  else:
    from jax_ppo.runs.reward import load_reward_config, run_reward

    config = load_reward_config(argv)
    initialize(config.distributed)
    summary = run_reward(config)
  if summary.get("preempted"):
    again = " ".join(["jax-ppo", command, *map(shlex.quote, argv)])
    print(f"jax-ppo {command}: stopped by {summary['preempted']}; the latest state is "
          f"checkpointed in {config.run_dir!r}. To resume, run the same command again: {again}",
          file=sys.stderr)
  print(json.dumps(summary))
  return 0


def _plan(args: argparse.Namespace) -> int:
  """`jax-ppo plan`: prints the plan's table (and writes its JSON to `--json`)."""
  from jax_ppo.diagnostics.plan import require_compiler

  require_compiler(args.topology)  # before reading anything: one line naming the extra
  import jax

  # A plan compiles and never runs: no accelerator runtime is started (with libtpu or the CUDA
  # plugin installed, JAX would try, and log each failure on a host without one).
  jax.config.update("jax_platforms", "cpu")
  from jax_ppo.diagnostics.plan import format_plan
  from jax_ppo.diagnostics.shapes import SHAPE_PREFIX
  from jax_ppo.runs.stages import load_stage_run_config

  argv = list(args.args)
  if args.model:  # after the file and the overrides: it wins over both
    field = "policy_path" if args.stage == "ppo" else "model_path"
    argv.append(f"{field}={SHAPE_PREFIX}{args.model}")
  config = load_stage_run_config(args.stage, argv)  # a config of another kind: one line
  if args.stage == "ppo":
    from jax_ppo.diagnostics.ppo_plan import plan_run, run_shape

    length = 512 if args.prompt_length is None else args.prompt_length
    plan = plan_run(run_shape(config, prompt_length=length), args.topology)
  elif args.prompt_length is not None:
    raise ValueError(f"--prompt-length is for PPO plans; the rows of a --stage {args.stage} plan "
                     f"are {args.stage}.max_length tokens (set it in the config or as "
                     f"{args.stage}.max_length=N).")
  else:
    from jax_ppo.diagnostics.stage_plan import plan_stage, stage_shape

    plan = plan_stage(stage_shape(config), args.topology)
  print(format_plan(plan))
  if args.json_path:
    with open(args.json_path, "w", encoding="utf-8") as f:
      json.dump(plan.to_json(), f, indent=2)
      f.write("\n")
  return 0


def _one_line(error: BaseException) -> str:
  text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
  if not text:
    text = type(error).__name__
  elif type(error).__module__.startswith("safetensors"):
    text = f"unreadable safetensors file: {text}"
  return text


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command line; returns the exit status (0 success, 2 bad input, 1 failed run)."""
  args = _parser().parse_args(argv)
  if not logging.getLogger().handlers:  # Our progress at INFO; libraries (Orbax...) at WARNING.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    logging.getLogger("jax_ppo").setLevel(logging.INFO)
  from safetensors import SafetensorError

  from jax_ppo.checkpoint import CheckpointError
  from jax_ppo.runs import common
  from jax_ppo.runs import ppo as run
  from jax_ppo.runs import ppo_config as run_config
  from jax_ppo.training.loop import RunCollapsed

  try:
    if args.command in ("sft", "reward", "dpo"):
      return _run_stage(args.command, args.args)
    if args.command == "plan":
      return _plan(args)
    if args.command == "config":
      return _config(args)
    if args.command == "pipeline":
      return _pipeline(args.args)
    if args.command == "train":
      from jax_ppo.parallel.distributed import initialize

      config = run_config.load_run_config(args.args)
      initialize(config.distributed)  # joins a multi-host job before any JAX computation
      history = run.run_training(config)
      summary = {"run_dir": config.run_dir, "updates_run": len(history)}
      if history:
        last = history[-1]
        summary["step"] = int(last["step"])
        summary.update({k: last[k] for k in ("objective/scores", "objective/kl") if k in last})
      preempted = getattr(history, "preempted", None)
      if preempted:
        summary["preempted"] = preempted
        command = " ".join(["jax-ppo", "train", *map(shlex.quote, args.args)])
        print(f"jax-ppo train: stopped by {preempted}; the latest state is checkpointed in "
              f"{config.run_dir!r}. To resume, run the same command again: {command}",
              file=sys.stderr)
      print(json.dumps(summary))
    elif args.command == "eval":
      from jax_ppo.parallel.distributed import initialize

      initialize()  # joins the multi-host job the environment describes (JAX's variables, SLURM...)
      result = run.evaluate_run(args.run_dir, args.prompts, temperature=args.temperature,
                                n=args.n, step=args.step, seed=args.seed, out=args.out)
      print(json.dumps({"step": result["step"], "out": result["out"], **result["metrics"]}))
    elif args.command == "plot":
      from jax_ppo.logging.plots import write_plots

      try:
        paths = write_plots(args.run_dir, out_dir=args.out)
      except ImportError as e:  # matplotlib missing: a setup error, reported in one line
        raise ValueError(str(e)) from None
      if not paths:
        raise ValueError(f"{args.run_dir!r}: metrics.jsonl holds none of the plotted metrics "
                         "of a PPO, SFT, reward-model or DPO run yet.")
      print(json.dumps({"plots": [str(p) for p in paths]}))
    else:
      from jax_ppo.parallel.distributed import initialize

      initialize()  # as eval: every process of a multi-host job gathers, process 0 writes
      dtype = common.DTYPES[args.dtype] if args.dtype else None
      path, step = run.export_run(args.run_dir, args.out, step=args.step, dtype=dtype,
                                  adapter=args.adapter)
      print(json.dumps({"step": step, "out": str(path)}))
  except (ValueError, OSError, CheckpointError, SafetensorError) as e:
    # Errors in the inputs (config, prompts, folders, checkpoints): one line, no traceback. A
    # reward function that raises (RewardFunctionError) and any other exception keep theirs.
    print(f"jax-ppo {args.command}: error: {_one_line(e)}", file=sys.stderr)
    return 2
  except RunCollapsed as e:
    print(f"jax-ppo {args.command}: {e}", file=sys.stderr)
    return 1
  return 0


def run() -> None:
  """The `jax-ppo` program: `main` on the process's arguments, with torch kept out of the
  libraries (`hide_torch_from_libraries`) for the verbs that load models; exits with main's
  status."""
  argv = sys.argv[1:]
  hidden = bool(argv) and argv[0] in TORCH_FREE_COMMANDS and hide_torch_from_libraries()
  try:
    status = main(argv)
  except Exception as e:
    if hidden and ("torch" in str(e).lower()):
      print(f"jax-ppo: transformers was told torch is absent in this process (jax_ppo needs no "
            f"torch); if code of yours runs PyTorch models through transformers, run with "
            f"{TORCH_ENV}=1.", file=sys.stderr)
    raise
  sys.exit(status)


if __name__ == "__main__":
  run()
