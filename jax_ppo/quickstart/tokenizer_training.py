"""Training a small byte-level BPE tokenizer on in-memory texts (no download).

`train_bpe_tokenizer(texts, vocab_size=...)` trains a `tokenizers` BPE model with byte-level
pre-tokenisation (every string is encodable, decoding is exact) and wraps it as a transformers
`PreTrainedTokenizerFast` with distinct special tokens `<pad>` (id 0), `<bos>` (1) and `<eos>`
(2), left padding (what `jax_ppo.rollout` expects) and no chat template: the plain format is
`<bos> text`, BOS added by `add_special_tokens=True`, EOS appended by the SFT data pipeline.
`save_pretrained(path)` writes a folder that `jax_ppo.models.load_tokenizer` and
`transformers.AutoTokenizer` read.
"""

from __future__ import annotations

from collections.abc import Iterable

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)


def train_bpe_tokenizer(texts: Iterable[str], *, vocab_size: int = 512, min_frequency: int = 2,
                        split_digits: bool = False):
  """A byte-level BPE `PreTrainedTokenizerFast` trained on `texts`.

  Args:
    texts: training texts.
    vocab_size: target vocabulary size, special tokens and the 256 byte symbols included (the
      trainer stops early when no pair is frequent enough).
    min_frequency: least count of a pair to be merged.
    split_digits: every digit its own token (no merge joins digits), as arithmetic wants: "1234"
      is four tokens, and a number's tokens do not depend on its neighbours.

  Returns:
    The tokenizer: pad/bos/eos ids 0/1/2, left padding, BOS prepended when
    `add_special_tokens=True`.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  from transformers import PreTrainedTokenizerFast

  alphabet = pre_tokenizers.ByteLevel.alphabet()
  if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
    raise ValueError(
        f"train_bpe_tokenizer: vocab_size={vocab_size} is below the {len(alphabet)} byte symbols "
        f"plus {len(SPECIAL_TOKENS)} special tokens; use at least "
        f"{len(alphabet) + len(SPECIAL_TOKENS)}."
    )
  tok = Tokenizer(models.BPE())
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                byte_level])
                       if split_digits else byte_level)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS),
      initial_alphabet=alphabet, show_progress=False,
  )
  tok.train_from_iterator(texts, trainer=trainer)
  bos_id = tok.token_to_id(BOS)
  tok.post_processor = processors.TemplateProcessing(
      single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
  )
  return PreTrainedTokenizerFast(
      tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, padding_side="left",
      clean_up_tokenization_spaces=False,
  )
