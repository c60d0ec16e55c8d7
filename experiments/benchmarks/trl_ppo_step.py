"""The TRL side of `ppo_step.py`: Hugging Face TRL's `PPOTrainer` on the same PPO workload.

Runs in a Python that has the `bench` extra (`pip install -e ".[bench]"`: trl 1.12.0, the last
release with `PPOTrainer`, there in `trl.experimental.ppo`; torch 2.13.0; transformers 5.24.0);
it imports neither jax nor jax_ppo, only the workload helpers of `ppo_step.py` (stdlib, numpy,
torch and transformers), so both sides train the same models on the same prompts:

- random GPT-2 policy (`GPT2LMHeadModel`), reference (a copy of it), reward and value models
  (`GPT2ForSequenceClassification`, one label) of `ppo_step.SHAPES[--shape]`, built with
  `torch.manual_seed(0)` (`ppo_step.build_models`);
- 256 random prompts of 28-32 token ids (`ppo_step.make_prompts`), padded on the left to the
  longest of each batch; a word-level tokenizer whose tokens are the ids (pad = vocab - 1,
  EOS = vocab - 2), built here, since TRL needs one for padding only;
- batch 8, 48 response tokens with no stop token (every response has 48 tokens), 4 PPO epochs,
  1 minibatch, fp32 on the CPU, AdamW at 3e-6, temperature 0.7, TRL's defaults otherwise
  (kl_coef 0.05, vf_coef 0.1, clip 0.2, GAE gamma 1, lambda 0.95).

Per update (a `TrainerCallback` marks where each ends) it reports the wall time and three
phases: `rollout_s`, the time inside TRL's `batch_generation` (sampling); `score_s`, from the end
of sampling to the first forward pass of the policy with gradients on (reference log-probs,
value and reward forwards, GAE; a forward pre-hook on the policy finds that point); and
`update_s`, from there to the end of the update (4 epochs of policy+value fwd+bwd and AdamW).
The first update is reported apart (`first_update_s`) and left out of the medians. Also: the
process's peak RSS (`rss.peak_rss_mib`), and a model-FLOPs estimate (2 N per forward token,
6 N per trained token, N = policy parameters) with the GFLOP/s it implies.

    python experiments/benchmarks/trl_ppo_step.py [--shape tiny|base] [--updates 8]
        [--threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

for _name, _value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                      ("HF_DATASETS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"),
                      ("TRL_EXPERIMENTAL_SILENCE", "1"), ("WANDB_MODE", "disabled")):
  os.environ.setdefault(_name, _value)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host import host_line, host_record  # noqa: E402
from ppo_step import SHAPES, build_models, make_prompts  # noqa: E402
from rss import peak_rss_mib  # noqa: E402


def id_tokenizer(vocab_size: int):
  """A fast tokenizer whose token `i` is the string `t{i}`, padding on the left with
  `vocab_size - 1` and ending with `vocab_size - 2` (the pad and EOS ids of the models)."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  vocab = {f"t{i}": i for i in range(vocab_size)}
  core = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
  core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok = PreTrainedTokenizerFast(
      tokenizer_object=core, pad_token=f"t{vocab_size - 1}", eos_token=f"t{vocab_size - 2}",
      bos_token=f"t{vocab_size - 2}", unk_token="t0", padding_side="left",
  )
  if tok.pad_token_id != vocab_size - 1 or tok.eos_token_id != vocab_size - 2:
    raise RuntimeError(f"id tokenizer: pad {tok.pad_token_id}, eos {tok.eos_token_id}")
  return tok


class PhaseClock:
  """Timestamps of one TRL run: sampling intervals, the first grad-enabled policy forward after
  each sampling, and the end of each update (plus the start of training)."""

  def __init__(self):
    self.sampling: list[tuple[float, float]] = []
    self.train_start: list[float] = []
    self.update_end: list[float] = []
    self.tokens: list[int] = []

  def wrap_sampling(self, fn):
    def timed(model, queries, *args, **kwargs):
      t0 = time.perf_counter()
      out = fn(model, queries, *args, **kwargs)
      self.sampling.append((t0, time.perf_counter()))
      self.tokens.append(int(queries.shape[1]))
      return out

    return timed

  def policy_pre_hook(self, module, inputs):
    import torch

    if torch.is_grad_enabled() and len(self.train_start) < len(self.sampling):
      self.train_start.append(time.perf_counter())

  def updates(self) -> list[dict[str, float]]:
    """Per update: `wall_s`, `rollout_s`, `score_s`, `update_s`, `query_len`."""
    out = []
    for i in range(len(self.update_end) - 1):
      start, end = self.update_end[i], self.update_end[i + 1]
      (s0, s1), train = self.sampling[i], self.train_start[i]
      out.append({"wall_s": end - start, "rollout_s": s1 - s0, "score_s": train - s1,
                  "update_s": end - train, "query_len": self.tokens[i]})
    return out


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
  ap.add_argument("--updates", type=int, default=8, help="updates run (the first is not timed)")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--response-length", type=int, default=48)
  ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: default)")
  ap.add_argument("--json", default=None, help="write the results here")
  args = ap.parse_args(argv)
  if args.updates < 2:
    ap.error("--updates must be >= 2: the first update is reported apart from the median")

  t0 = time.perf_counter()
  import datasets
  import torch
  import transformers
  import trl
  from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel, TrainerCallback

  try:
    import trl.experimental.ppo.ppo_trainer as ppo_module
    from trl.experimental.ppo import PPOConfig, PPOTrainer
  except ImportError as e:
    raise SystemExit(f"trl {trl.__version__} has no trl.experimental.ppo.PPOTrainer; install "
                     "trl==1.12.0 (pip install -e '.[bench]').") from e
  import_s = time.perf_counter() - t0
  if args.threads:
    torch.set_num_threads(args.threads)

  shape = SHAPES[args.shape]
  vocab = shape["vocab_size"]
  tokenizer = id_tokenizer(vocab)
  with tempfile.TemporaryDirectory() as tmp:
    paths = build_models(shape, tmp)
    policy = GPT2LMHeadModel.from_pretrained(paths["policy"], dtype=torch.float32)
    ref = GPT2LMHeadModel.from_pretrained(paths["policy"], dtype=torch.float32)
    reward = GPT2ForSequenceClassification.from_pretrained(paths["reward"], dtype=torch.float32)
    value = GPT2ForSequenceClassification.from_pretrained(paths["value"], dtype=torch.float32)
    out_dir = os.path.join(tmp, "trl_out")
    n_params = sum(p.numel() for p in policy.parameters())
    train_data = datasets.Dataset.from_dict({"input_ids": make_prompts(vocab)})

    config = PPOConfig(
        output_dir=out_dir, report_to=[], use_cpu=True, bf16=False, fp16=False, seed=0,
        learning_rate=3e-6, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1, num_mini_batches=1, num_ppo_epochs=4,
        response_length=args.response_length, total_episodes=args.updates * args.batch,
        local_rollout_forward_batch_size=args.batch, num_sample_generations=0,
        save_strategy="no", eval_strategy="no", logging_steps=1, disable_tqdm=True,
        dataloader_num_workers=0, stop_token=None, temperature=0.7,
    )
    clock = PhaseClock()
    ppo_module.batch_generation = clock.wrap_sampling(ppo_module.batch_generation)
    policy.register_forward_pre_hook(clock.policy_pre_hook)

    class UpdateEnds(TrainerCallback):
      def on_train_begin(self, *a, **kw):
        clock.update_end.append(time.perf_counter())

      def on_step_end(self, *a, **kw):
        clock.update_end.append(time.perf_counter())

    trainer = PPOTrainer(
        args=config, processing_class=tokenizer, model=policy, ref_model=ref,
        reward_model=reward, value_model=value, train_dataset=train_data,
        callbacks=[UpdateEnds()],
    )
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0

  updates = clock.updates()
  if len(updates) != args.updates:
    raise RuntimeError(f"timed {len(updates)} updates, expected {args.updates}: TRL's loop "
                       "changed; check the sampling wrapper and the policy hook")
  for i, u in enumerate(updates):
    print(f"update {i + 1}: {u['wall_s']:.3f}s | rollout {u['rollout_s']:.3f}s | score "
          f"{u['score_s']:.3f}s | update {u['update_s']:.3f}s | query {u['query_len']}",
          flush=True)
  timed = updates[1:]
  med = lambda k: statistics.median(u[k] for u in timed)  # noqa: E731
  seq = args.batch * (statistics.mean(u["query_len"] for u in timed) + args.response_length)
  generated = args.batch * args.response_length
  gflop = {
      "rollout": 2 * n_params * seq / 1e9,  # prefill + generated tokens
      "score": 2 * n_params * 3 * seq / 1e9,  # ref, value and reward forwards
      "update": 6 * n_params * 2 * 4 * seq / 1e9,  # 4 epochs x (policy + value) fwd+bwd
  }
  gflop["total"] = sum(gflop.values())
  result = {
      "impl": "trl",
      "s_per_update": med("wall_s"),
      "rollout_s": med("rollout_s"),
      "score_s": med("score_s"),
      "update_s": med("update_s"),
      "first_update_s": updates[0]["wall_s"],
      "generated_tokens_per_s": generated / med("rollout_s"),
      "peak_rss_mib": peak_rss_mib(),
      "gflop_per_update": gflop,
      "gflops": {k: gflop[k] / med("wall_s" if k == "total" else f"{k}_s") for k in gflop},
      "policy_params": n_params,
      "import_s": import_s,
      "train_s": train_s,
      "torch_threads": torch.get_num_threads(),
      "host": host_record(),
      "versions": {"python": platform.python_version(), "torch": torch.__version__,
                   "transformers": transformers.__version__, "trl": trl.__version__,
                   "datasets": datasets.__version__},
      "config": dict(shape=args.shape, **shape, batch=args.batch, prompt_len="28-32",
                     response_length=args.response_length, ppo_epochs=4, num_minibatches=1,
                     dtype="float32", updates=args.updates),
      "updates": updates,
  }
  print(json.dumps({k: v for k, v in result.items() if k != "updates"}, indent=2))
  print(host_line(result["host"]))
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)
  return result


if __name__ == "__main__":
  main()
