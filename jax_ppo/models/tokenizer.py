"""The Hugging Face tokenizer of a checkpoint folder, set up for RLHF.

`load_tokenizer` returns `transformers.AutoTokenizer.from_pretrained(path)` (local files only,
no remote code) with left padding and a pad token distinct from every stop id
(docs/rlhf_details.md item 1: EOS stays inside the loss mask so the policy learns to stop, hence
PAD must be another id).

Choosing the pad token (`ensure_pad_token`), in order:
1. a configured `pad_token` (must exist in the vocabulary unless `add_pad_token=True`);
2. the tokenizer's own pad token, when it is not a stop id (Gemma's `<pad>`, Qwen instruct's
   `<|endoftext|>`);
3. an existing special token that is unused in practice: Llama 3.1's
   `<|finetune_right_pad_id|>`, `<pad>`, `<|pad|>`, `[PAD]`, Qwen's `<|fim_pad|>`, Llama 3's
   `<|reserved_special_token_N|>`, then the unknown token (Llama 2's and Mistral's `<unk>`, id 0),
   never BOS, EOS or a configured stop id. Its id is already inside the embedding table;
4. otherwise (GPT-2: `<|endoftext|>` is BOS, EOS and UNK at once) a `PadTokenError` naming the
   two fixes: configure an existing non-stop token as `pad_token`, or allow a new `<|pad|>`
   token (`add_pad_token=True`) and grow the model with
   `jax_ppo.models.resize_token_embeddings(model, len(tokenizer))` (the CLI's
   `RunConfig.resize_embeddings=True` does both).

Whatever the choice, padding is never recognised by its id: every batch carries an explicit
attention mask (`pad_batch`, the sampler's `Rollout` masks), so a pad id that also occurs in the
text (an `<unk>` inside a prompt) stays a real token.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from jax_ppo.models.config import ModelConfig
from jax_ppo.models.errors import PadTokenError, VocabularyError

#: Existing tokens reused as PAD, in order of preference (the unknown token comes after them).
PAD_CANDIDATES = ("<|finetune_right_pad_id|>", "<pad>", "<|pad|>", "[PAD]", "<|fim_pad|>")
NEW_PAD_TOKEN = "<|pad|>"
_RESERVED = re.compile(r"<\|reserved_special_token_(\d+)\|>")


def _stop_ids(tokenizer: Any, extra_eos_ids: Sequence[int]) -> set[int]:
  ids = {int(i) for i in extra_eos_ids}
  if tokenizer.eos_token_id is not None:
    ids.add(int(tokenizer.eos_token_id))
  return ids


def _name(tokenizer: Any) -> str:
  path = getattr(tokenizer, "name_or_path", "") or ""
  return f"The tokenizer at {path!r}" if path else "The tokenizer"


def _fixes(configured_field: str) -> str:
  return (
      f"either configure an existing token that is not a stop token as the pad token "
      f"({configured_field}), or add a new {NEW_PAD_TOKEN!r} token and grow the model's "
      "embedding: load_tokenizer(..., add_pad_token=True) then "
      "jax_ppo.models.resize_token_embeddings(model, len(tokenizer)) (on the command line: "
      "resize_embeddings=true)"
  )


def ensure_pad_token(
    tokenizer: Any,
    *,
    pad_token: str | None = None,
    extra_eos_ids: Sequence[int] = (),
    add_pad_token: bool = False,
    require_pad: bool = True,
) -> bool:
  """Gives `tokenizer` a pad token distinct from every stop id (in place).

  Args:
    tokenizer: a transformers tokenizer.
    pad_token: use this token; it must be in the vocabulary unless `add_pad_token`.
    extra_eos_ids: further stop ids that must not serve as PAD (the model config's EOS ids,
      configured stop ids).
    add_pad_token: when no existing token fits (or `pad_token` is new), add it (default
      `<|pad|>`) as a special token; the model then needs `resize_token_embeddings`.
    require_pad: False leaves the tokenizer's pad as it was (None, or even EOS) when no token
      fits and `add_pad_token` is False, instead of raising: for a tokenizer whose padding only
      ever sits in masked slots, e.g. a reward model's that re-tokenizes responses.

  Returns:
    True when a new token was added to the vocabulary (grow the embedding to `len(tokenizer)`).

  Raises:
    PadTokenError: `pad_token` is a stop token, or is not in the vocabulary and
      `add_pad_token` is False, or no existing token can serve as PAD and `add_pad_token` is
      False (the message names both fixes).
  """
  stops = _stop_ids(tokenizer, extra_eos_ids)
  vocab = tokenizer.get_vocab()
  if pad_token is not None:
    if vocab.get(pad_token) in stops:
      raise PadTokenError(
          f"pad_token {pad_token!r} (id {vocab[pad_token]}) is a stop/EOS token; PAD must differ "
          "from every stop id, or the policy never learns to stop. Choose another token."
      )
    if pad_token in vocab:
      tokenizer.pad_token = pad_token
      return False
    if not add_pad_token:
      raise PadTokenError(
          f"pad_token {pad_token!r} is not in the vocabulary ({_name(tokenizer)}); "
          f"{_fixes('an existing token as pad_token')}."
      )
    tokenizer.add_special_tokens({"pad_token": pad_token})
    return True
  if tokenizer.pad_token is not None and tokenizer.pad_token_id not in stops:
    return False
  reserved = sorted(
      (int(m.group(1)), tok) for tok in vocab if (m := _RESERVED.fullmatch(tok)) is not None
  )
  unk = getattr(tokenizer, "unk_token", None)
  candidates = (*PAD_CANDIDATES, *(tok for _, tok in reserved), *((unk,) if unk else ()))
  for candidate in candidates:
    token_id = vocab.get(candidate)
    if token_id is not None and token_id not in stops and token_id != tokenizer.bos_token_id:
      tokenizer.pad_token = candidate
      return False
  if add_pad_token:
    tokenizer.add_special_tokens({"pad_token": NEW_PAD_TOKEN})
    return True
  if not require_pad:
    return False
  special = sorted(set(getattr(tokenizer, "all_special_tokens", []) or []))
  raise PadTokenError(
      f"{_name(tokenizer)} has no pad token, and none of its special tokens {special} can serve "
      f"as one (each is BOS or a stop/EOS id {sorted(stops)}); {_fixes('pad_token=...')}."
  )


def load_tokenizer(
    path: str,
    *,
    padding_side: str = "left",
    pad_token: str | None = None,
    chat_template: str | None = None,
    extra_eos_ids: Sequence[int] = (),
    add_pad_token: bool = False,
    require_pad: bool = True,
) -> Any:
  """The folder's tokenizer, left-padding, with a pad token distinct from every stop id.

  Args:
    path: local checkpoint folder (tokenizer.json / tokenizer_config.json ...).
    padding_side: "left" for prompts (the default), "right" for training targets.
    pad_token: use this pad token (see `ensure_pad_token`).
    chat_template: a Jinja chat template replacing the folder's one.
    extra_eos_ids: stop ids besides the tokenizer's EOS that must not become PAD.
    add_pad_token: allow adding a new pad token when no existing one fits; then
      `len(tokenizer)` grows by one and the model needs
      `resize_token_embeddings(model, len(tokenizer))`.
    require_pad: see `ensure_pad_token`.

  Returns:
    The tokenizer; `tokenizer.pad_token_id` is set and not a stop id (unless `require_pad` is
    False and none fits).

  Raises:
    PadTokenError: no usable pad token without adding one (see `ensure_pad_token`).
  """
  import transformers

  tokenizer = transformers.AutoTokenizer.from_pretrained(
      path, local_files_only=True, trust_remote_code=False
  )
  tokenizer.padding_side = padding_side
  if chat_template is not None:
    tokenizer.chat_template = chat_template
  ensure_pad_token(tokenizer, pad_token=pad_token, extra_eos_ids=extra_eos_ids,
                   add_pad_token=add_pad_token, require_pad=require_pad)
  return tokenizer


def check_vocab_covers(tokenizer: Any, config: ModelConfig) -> None:
  """Raises `VocabularyError` when some token id (a newly added pad, say) has no embedding row."""
  if len(tokenizer) > config.vocab_size:
    raise VocabularyError(
        f"The tokenizer has {len(tokenizer)} tokens (pad id {tokenizer.pad_token_id}) but the "
        f"model's embedding only {config.vocab_size} rows; grow it with "
        "jax_ppo.models.resize_token_embeddings(model, len(tokenizer)) (on the command line: "
        "resize_embeddings=true), or use a tokenizer without added tokens."
    )


def check_token_ids(ids: Any, vocab_size: int, *, what: str) -> None:
  """Raises `VocabularyError` when some id of `ids` is negative or not below `vocab_size`.

  A host-side check (NumPy, outside jit) for ids about to reach a model: `jnp.take` fills an
  out-of-range embedding row with NaN, which silently turns the forward pass (and, after one
  update, every parameter) into NaN.

  Args:
    ids: an int sequence or array of any shape.
    vocab_size: the model's `config.vocab_size`.
    what: how the message names `ids` (e.g. "prompt 3").
  """
  arr = np.asarray(ids)
  if arr.size == 0:
    return
  if not np.issubdtype(arr.dtype, np.integer):
    raise VocabularyError(f"{what} holds {arr.dtype} values; token ids must be integers.")
  bad = (arr < 0) | (arr >= vocab_size)
  if bad.any():
    flat = int(np.flatnonzero(bad.reshape(-1))[0])
    position = np.unravel_index(flat, arr.shape)
    where = f" at position {position[0] if arr.ndim == 1 else tuple(map(int, position))}"
    raise VocabularyError(
        f"{what} has token id {int(arr.reshape(-1)[flat])}{where}, outside the model's "
        f"vocabulary of {vocab_size} ids [0, {vocab_size}); it comes from another tokenizer "
        "or a tokenizer with added tokens (see resize_token_embeddings)."
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
