"""Tiny random Hugging Face checkpoints and data files for the stage and example-config tests.

`make_checkpoint(root, family)` writes a 1-layer causal LM of a supported family (Llama, Qwen3)
with a word-level tokenizer (pad distinct from EOS) to `root/family`; `make_reward_checkpoint`
a one-label reward model of the same family; `write_data(root)` writes the SFT pairs, preference
triples and prompts those tests train on; `tree_hashes(*folders)` hashes every file under them
(a refused run must leave them byte-identical); `cache_snapshot` writes a model's snapshot into
a Hugging Face Hub cache folder, as `hf download` lays it out. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

WORDS = ("the a movie film plot actor story was is very really not quite good great fun bad "
         "dull boring long short and but I liked hated it this review").split()
SPECIAL = ["<pad>", "<|endoftext|>", "<unk>"]

FAMILIES = {
    "llama": ("LlamaConfig", dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1,
                                  max_position_embeddings=64, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                  max_position_embeddings=64, tie_word_embeddings=True)),
}

PROMPTS = ["the movie was", "I liked the plot and", "the actor is", "it was really",
           "a story", "the film is not", "I hated it but", "this review"]
GOOD = ["good fun", "really great", "very good", "great and fun"]
BAD = ["bad", "dull and boring", "not good", "very bad"]


def tokenizer():
  """A word-level fast tokenizer over `WORDS` with PAD (0), EOS (1) and UNK (2)."""
  import tokenizers
  import transformers

  vocab = {w: i for i, w in enumerate([*SPECIAL, *WORDS])}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<pad>", unk_token="<unk>")


def make_checkpoint(root: pathlib.Path, family: str = "llama", *, seed: int = 0) -> str:
  """Writes a tiny random causal LM of `family` with the tokenizer; returns its folder."""
  import torch
  import transformers

  tok = tokenizer()
  cls_name, kwargs = FAMILIES[family]
  config = getattr(transformers, cls_name)(
      vocab_size=len(tok), bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
      pad_token_id=tok.pad_token_id, **kwargs)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config)
  path = pathlib.Path(root) / family
  model.save_pretrained(path)
  tok.save_pretrained(path)
  return str(path)


def make_reward_checkpoint(root: pathlib.Path, family: str = "llama", *, seed: int = 1) -> str:
  """Writes a tiny random one-label `*ForSequenceClassification` model with the tokenizer."""
  import torch
  import transformers

  tok = tokenizer()
  cls_name, kwargs = FAMILIES[family]
  config = getattr(transformers, cls_name)(
      vocab_size=len(tok), bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
      pad_token_id=tok.pad_token_id, num_labels=1, **kwargs)
  torch.manual_seed(seed)
  model = transformers.AutoModelForSequenceClassification.from_config(config)
  with torch.no_grad():
    model.score.weight.normal_(0.0, 1.0)
  path = pathlib.Path(root) / f"{family}_reward"
  model.save_pretrained(path)
  tok.save_pretrained(path)
  return str(path)


def _jsonl(path: pathlib.Path, records) -> str:
  path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
  return str(path)


def write_data(root: pathlib.Path) -> dict[str, str]:
  """SFT pairs, preference triples and prompts as JSONL files; returns `{name: path}`."""
  root = pathlib.Path(root)
  sft = [{"prompt": p, "response": GOOD[i % 4] if i % 2 else BAD[i % 4]}
         for i, p in enumerate(PROMPTS * 2)]
  prefs = [{"prompt": p, "chosen": GOOD[i % 4], "rejected": BAD[(i + 1) % 4]}
           for i, p in enumerate(PROMPTS * 2)]
  return {
      "sft": _jsonl(root / "sft.jsonl", sft),
      "prefs": _jsonl(root / "prefs.jsonl", prefs),
      "prompts": _jsonl(root / "prompts.jsonl", [{"prompt": p} for p in PROMPTS]),
  }


def score_good_words(prompts: list[str], responses: list[str]) -> list[float]:
  """A `module:function` reward for the tests: positive words minus negative words."""
  good, bad = {"good", "great", "fun", "liked"}, {"bad", "dull", "boring", "hated"}
  return [float(sum(w in good for w in r.split()) - sum(w in bad for w in r.split()))
          for r in responses]


def tree_hashes(*folders) -> dict[str, str]:
  """sha256 of every file under `folders`, by path."""
  return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
          for folder in folders for p in sorted(pathlib.Path(folder).rglob("*")) if p.is_file()}


COMMIT = "0123456789abcdef0123456789abcdef01234567"
"""The commit `cache_snapshot` names by default (a Hub commit id is 40 hex digits)."""


def cache_snapshot(cache: pathlib.Path, repo_id: str, *, commit: str = COMMIT,
                   branch: str | None = "main", files=("config.json",)) -> pathlib.Path:
  """Writes `repo_id`'s snapshot `commit` (with `files`, each holding `{}`) into the hub cache
  folder `cache`, `refs/<branch>` naming it; returns the snapshot folder."""
  repo = cache / f"models--{repo_id.replace('/', '--')}"
  snapshot = repo / "snapshots" / commit
  snapshot.mkdir(parents=True)
  for name in files:
    (snapshot / name).write_text("{}")
  if branch is not None:
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
  return snapshot
