"""The Hugging Face tokenizer of a checkpoint folder, set up for RLHF.

`load_tokenizer` returns `transformers.AutoTokenizer.from_pretrained(path)` (local files only,
no remote code) with left padding and a pad token distinct from EOS (RLHF_DETAILS.md item 1: EOS
stays inside the loss mask so the policy learns to stop, hence pad must be another id).

Choosing the pad token, in order:
1. the tokenizer's own pad token, when it is not an EOS token;
2. an existing special token that is unused in practice (Llama 3.1's
   `<|finetune_right_pad_id|>`, `<pad>`, `<|pad|>`, `[PAD]`, Qwen's `<|fim_pad|>`, then Llama 3's
   `<|reserved_special_token_N|>`): its id is already inside the embedding table;
3. otherwise a new special token `<|pad|>` is added. Its id is `len(tokenizer) - 1`, which the
   model's embedding (`config.vocab_size` rows) must cover: most checkpoints pad their embedding
   beyond the tokenizer (Qwen2.5: 151936 rows for 151665 tokens) and then nothing changes; call
   `check_vocab_covers(tokenizer, config)` to verify. Pad slots are masked everywhere, so the pad
   row's values never reach an output.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_ppo.models.config import ModelConfig

#: Existing tokens reused as PAD, in order of preference.
PAD_CANDIDATES = ("<|finetune_right_pad_id|>", "<pad>", "<|pad|>", "[PAD]", "<|fim_pad|>")
NEW_PAD_TOKEN = "<|pad|>"
_RESERVED = re.compile(r"<\|reserved_special_token_(\d+)\|>")


def _eos_ids(tokenizer: Any) -> set[int]:
  ids = set()
  if tokenizer.eos_token_id is not None:
    ids.add(int(tokenizer.eos_token_id))
  return ids


def ensure_pad_token(tokenizer: Any, *, pad_token: str | None = None,
                     extra_eos_ids: Sequence[int] = ()) -> bool:
  """Gives `tokenizer` a pad token distinct from every EOS id (in place).

  Args:
    tokenizer: a transformers tokenizer.
    pad_token: force this token (added as a special token when not in the vocabulary).
    extra_eos_ids: further stop ids that must not serve as PAD (e.g. the model config's list).

  Returns:
    True when a new token was added to the vocabulary (check the embedding covers it).

  Raises:
    ValueError: when `pad_token` is an EOS token.
  """
  eos = _eos_ids(tokenizer) | {int(i) for i in extra_eos_ids}
  vocab = tokenizer.get_vocab()
  if pad_token is not None:
    if vocab.get(pad_token) in eos:
      raise ValueError(f"pad_token {pad_token!r} is an EOS token; PAD must differ from EOS.")
    added = pad_token not in vocab
    if added:
      tokenizer.add_special_tokens({"pad_token": pad_token})
    else:
      tokenizer.pad_token = pad_token
    return added
  if tokenizer.pad_token is not None and tokenizer.pad_token_id not in eos:
    return False
  reserved = sorted(
      (int(m.group(1)), tok) for tok in vocab if (m := _RESERVED.fullmatch(tok)) is not None
  )
  for candidate in (*PAD_CANDIDATES, *(tok for _, tok in reserved)):
    token_id = vocab.get(candidate)
    if token_id is not None and token_id not in eos and token_id != tokenizer.bos_token_id:
      tokenizer.pad_token = candidate
      return False
  tokenizer.add_special_tokens({"pad_token": NEW_PAD_TOKEN})
  return True


def load_tokenizer(
    path: str,
    *,
    padding_side: str = "left",
    pad_token: str | None = None,
    chat_template: str | None = None,
    extra_eos_ids: Sequence[int] = (),
) -> Any:
  """The folder's tokenizer, left-padding, with a pad token distinct from EOS.

  Args:
    path: local checkpoint folder (tokenizer.json / tokenizer_config.json ...).
    padding_side: "left" for prompts (the default), "right" for training targets.
    pad_token: force a pad token (see `ensure_pad_token`).
    chat_template: a Jinja chat template replacing the folder's one.
    extra_eos_ids: stop ids besides the tokenizer's EOS that must not become PAD.

  Returns:
    The tokenizer; `tokenizer.pad_token_id` is set and not an EOS id.
  """
  import transformers

  tokenizer = transformers.AutoTokenizer.from_pretrained(
      path, local_files_only=True, trust_remote_code=False
  )
  tokenizer.padding_side = padding_side
  if chat_template is not None:
    tokenizer.chat_template = chat_template
  ensure_pad_token(tokenizer, pad_token=pad_token, extra_eos_ids=extra_eos_ids)
  return tokenizer


def check_vocab_covers(tokenizer: Any, config: ModelConfig) -> None:
  """Raises ValueError when some token id (a newly added pad, say) has no embedding row."""
  if len(tokenizer) > config.vocab_size:
    raise ValueError(
        f"The tokenizer has {len(tokenizer)} tokens but the model's embedding only "
        f"{config.vocab_size} rows (pad id {tokenizer.pad_token_id}); resize the embedding."
    )


def encode_chat(
    tokenizer: Any,
    conversations: Sequence[Sequence[dict[str, str]]],
    *,
    add_generation_prompt: bool = True,
) -> list[list[int]]:
  """Token ids of each conversation rendered with the tokenizer's chat template.

  Args:
    conversations: one list of `{"role": ..., "content": ...}` messages per prompt.
    add_generation_prompt: end with the template's assistant header (for generation).
  """
  if not getattr(tokenizer, "chat_template", None):
    raise ValueError("The tokenizer has no chat template; pass chat_template= to load_tokenizer.")
  out = []
  for messages in conversations:
    encoded = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=add_generation_prompt, tokenize=True,
        return_dict=True,
    )
    out.append(list(encoded["input_ids"]))
  return out


def pad_batch(
    sequences: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    length: int | None = None,
    side: str = "left",
) -> tuple[np.ndarray, np.ndarray]:
  """Pads id lists into `(input_ids [B, S] int32, attention_mask [B, S] int32)`.

  Args:
    sequences: token-id lists.
    pad_token_id: id written into pad slots.
    length: `S` (a bucket size, to avoid recompilation); default the longest sequence. Longer
      sequences raise ValueError.
    side: "left" (prompts for generation) or "right".
  """
  if side not in ("left", "right"):
    raise ValueError(f"side must be 'left' or 'right', got {side!r}.")
  longest = max((len(s) for s in sequences), default=0)
  length = longest if length is None else length
  if longest > length:
    raise ValueError(f"A sequence has {longest} tokens, more than length={length}.")
  ids = np.full((len(sequences), length), pad_token_id, np.int32)
  mask = np.zeros((len(sequences), length), np.int32)
  for b, seq in enumerate(sequences):
    n = len(seq)
    sl = slice(length - n, length) if side == "left" else slice(0, n)
    ids[b, sl] = np.asarray(seq, np.int32)
    mask[b, sl] = 1
  return ids, mask
