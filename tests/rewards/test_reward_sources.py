"""Reward sources fail loudly (issue 13 item 5): a reward function that raises, returns NaN/inf,
the wrong number of scores or something that is not a number is one clear error naming the batch
row (its prompt) and the value, never a silent zero; reward-model and `TokenScorer` scores are
checked the same way."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo.models import ScalarModel
from jax_ppo.rewards.scorers import (
  FunctionScorer,
  RewardFunctionError,
  RewardModelScorer,
  TokenScorer,
  check_scores,
)
from jax_ppo.rollout.sampler import Rollout
from tests.ppo.conftest import MODEL

PROMPTS = [[5, 6], [7, 8, 9], [10], [11, 12]]
RESPONSES = [[13, 2], [14, 15], [16, 17, 2], [18]]


def _rollout(prompts=PROMPTS, responses=RESPONSES) -> Rollout:
  """A hand-made rollout: prompts left-padded, responses right-padded (PAD = 0)."""
  b, s, t = len(prompts), max(map(len, prompts)), max(map(len, responses))
  prompt_ids, prompt_mask = np.zeros((b, s), np.int32), np.zeros((b, s), np.int32)
  response_ids, response_mask = np.zeros((b, t), np.int32), np.zeros((b, t), bool)
  for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
    prompt_ids[i, s - len(p):], prompt_mask[i, s - len(p):] = p, 1
    response_ids[i, :len(r)], response_mask[i, :len(r)] = r, True
  positions = np.maximum(np.cumsum(np.concatenate([prompt_mask, response_mask], 1), 1) - 1, 0)
  return Rollout(
      prompt_ids=jnp.asarray(prompt_ids), prompt_mask=jnp.asarray(prompt_mask),
      response_ids=jnp.asarray(response_ids), response_mask=jnp.asarray(response_mask),
      logprobs=jnp.zeros((b, t), jnp.float32), positions=jnp.asarray(positions, jnp.int32),
      has_stop=jnp.asarray([2 in r for r in responses]),
  )


@pytest.mark.parametrize(
    "scores, message",
    [
        ([1.0, 2.0, 3.0], r"returned scores of shape \(3,\) for 4 responses"),
        ([1.0, "good", 2.0, 0.0], r"'good' \(str\) at row 1 \(prompt 'p1'\); every score must"),
        ([1.0, 2.0, None, 0.0], r"None \(NoneType\) at row 2 \(prompt 'p2'\)"),
        ([1.0, 2.0, 3.0, [4.0]], r"\[4.0\] \(list\) at row 3"),
        ([1.0, 2.0, 3.0, 1j], r"1j \(complex\) at row 3"),
        ({1.0, 2.0, 3.0, 4.0}, r"\(set\); return a list"),
        (np.float32(0.5), r"returned np.float32\(0.5\) \(float32\)|shape \(\) for 4"),
        (0.5, r"returned 0.5 \(float\); return a list or array of 4 floats"),
        ("1 2 3 4", r"returned '1 2 3 4' \(str\)"),
        ({"a": 1.0}, r"\(dict\); return a list"),
        (None, r"returned None \(NoneType\)"),
        ((x for x in range(4)), r"\(generator\); return a list"),
        (np.ones((4, 1)), r"shape \(4, 1\) for 4 responses"),
        (np.array(["a", "b", "c", "d"]), r"array of dtype <U1; return real numbers"),
        ([0.0, float("nan"), 1.0, float("-inf")],
         r"non-finite scores at rows \[1, 3\] \(values nan, -inf; 2 of 4 rows\); the first is "
         r"row 1 \(prompt 'p1'\)"),
        (np.array([np.inf, 0, 0, 0]),
         r"non-finite scores at rows \[0\] \(values inf; 1 of 4 rows\)"),
    ],
)
def test_check_scores_names_the_row_and_the_value(scores, message):
  with pytest.raises(ValueError, match=message):
    check_scores(scores, 4, source="The reward function 'f'", prompts=["p0", "p1", "p2", "p3"])


@pytest.mark.parametrize(
    "scores",
    [[1, 2, 3, 4], (1.0, 2.0, 3.0, 4.0), [True, False, True, True], np.arange(4),
     jnp.arange(4.0), [np.float32(1), np.int64(2), jnp.float32(3), np.array(4.0)]],
)
def test_check_scores_accepts_numbers(scores):
  out = check_scores(scores, 4, source="f")
  assert out.dtype == np.float32 and out.shape == (4,)
  np.testing.assert_array_equal(out, np.asarray([float(s) for s in scores], np.float32))


def test_an_exception_in_the_reward_function_names_the_row_and_keeps_the_cause():
  def score(prompts, responses):
    return [1 // (r[0] - 14) for r in responses]  # row 1 starts with 14: ZeroDivisionError

  with pytest.raises(RewardFunctionError) as info:
    FunctionScorer(score)(_rollout())
  message = str(info.value)
  assert "raised ZeroDivisionError: integer division or modulo by zero" in message
  assert "at row 1 (prompt [7, 8, 9]), response [14, 15]" in message
  assert "test_reward_sources:" in message  # names the function (module:qualname)
  assert isinstance(info.value.__cause__, ZeroDivisionError)
  assert not isinstance(info.value, ValueError)  # the CLI shows the user's traceback


def test_an_exception_only_on_the_whole_batch_says_so():
  def score(prompts, responses):
    if len(prompts) > 1:
      raise RuntimeError("batch too large")
    return [0.0]

  with pytest.raises(RewardFunctionError, match="on the batch of 4 responses") as info:
    FunctionScorer(score, name="mod:score")(_rollout())
  assert "'mod:score' raised RuntimeError: batch too large" in str(info.value)
  assert isinstance(info.value.__cause__, RuntimeError)


def test_function_nan_wrong_length_and_wrong_type_are_errors_not_zeros():
  rollout = _rollout()
  nan_at_2 = FunctionScorer(lambda p, r: [0.0, 1.0, float("nan"), 2.0], name="f")
  with pytest.raises(ValueError, match=r"'f' returned non-finite scores at rows \[2\] "
                                       r"\(values nan; 1 of 4 rows\); the first is row 2 "
                                       r"\(prompt \[10\]\)"):
    nan_at_2(rollout)
  with pytest.raises(ValueError, match=r"returned scores of shape \(3,\) for 4 responses"):
    FunctionScorer(lambda p, r: [0.0] * 3)(rollout)
  with pytest.raises(ValueError, match=r"returned 'x' \(str\) at row 0"):
    FunctionScorer(lambda p, r: ["x", 1, 2, 3])(rollout)
  ok = FunctionScorer(lambda p, r: [len(x) for x in r])(rollout)
  np.testing.assert_array_equal(np.asarray(ok), [2.0, 2.0, 3.0, 1.0])


def test_function_scorer_names_the_prompt_text_with_a_tokenizer():
  class Tok:
    def decode(self, ids):
      return " ".join(f"w{i}" for i in ids)

  with pytest.raises(ValueError, match=r"row 3 \(prompt 'w11 w12'\)"):
    FunctionScorer(lambda p, r: [0, 0, 0, float("inf")], tokenizer=Tok())(_rollout())


def test_function_scorer_refuses_a_non_callable():
  with pytest.raises(ValueError, match="must be callable, got 3"):
    FunctionScorer(3)


def test_token_scorer_checks_finiteness():
  def half_nan(prompt_ids, prompt_mask, response_ids, response_mask):
    n = jnp.sum(response_mask, axis=1).astype(jnp.float32)
    return jnp.where(n > 2, jnp.nan, n)  # row 2 has 3 response tokens

  with pytest.raises(ValueError, match=r"token reward function .*half_nan.* non-finite scores "
                                       r"at rows \[2\] \(values nan; 1 of 4 rows\)"):
    TokenScorer(half_nan)(_rollout())
  ok = TokenScorer(lambda pi, pm, ri, rm: jnp.sum(rm, axis=1))(_rollout())
  assert ok.dtype == jnp.float32 and ok.tolist() == [2.0, 2.0, 3.0, 1.0]


def test_reward_model_scores_are_checked():
  model = ScalarModel(MODEL, head_init="reward", rngs=nnx.Rngs(0))
  scorer = RewardModelScorer(model)
  rollout = _rollout()
  good = scorer(rollout)
  assert good.shape == (4,) and np.all(np.isfinite(np.asarray(good)))
  # Broken weights (NaN in the head) would give NaN scores to every row.
  broken = jax.tree.map(lambda x: x * jnp.nan if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        scorer.state)
  with pytest.raises(ValueError, match=r"The reward model \(check its weights.*\) returned "
                                       r"non-finite scores at rows \[0, 1, 2, 3\] \(values "
                                       r"nan, nan, nan, nan; 4 of 4 rows\)"):
    scorer(rollout, broken)


def _word_tokenizer(words, specials, *, bos=None):
  """A word-level tokenizer over `specials` + `words` (`specials`: pad, eos, unk, bos); with
  `bos` it adds that token in front of every text, as a Llama tokenizer does."""
  tokenizers = pytest.importorskip("tokenizers")
  transformers = pytest.importorskip("transformers")
  vocab = {w: i for i, w in enumerate([*specials, *words])}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=specials[2]))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
  if bos is not None:
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, pad_token=specials[0], eos_token=specials[1], unk_token=specials[2],
      bos_token=specials[3])


def test_a_reward_model_with_its_own_tokenizer_scores_the_clean_text():
  """Issue 24 item 5: the policy's special tokens (its BOS, EOS and padding) never reach a reward
  model with another tokenizer; that tokenizer adds its own (here a BOS), so each score is the
  reward model's score of the clean prompt + response text, tokenized as the reward model
  tokenizes any text."""
  words = "the movie was good fun bad dull and it".split()
  policy_tok = _word_tokenizer(words, ["<pad>", "<|endoftext|>", "<unk>", "<|bos|>"])
  reward_tok = _word_tokenizer(words[::-1], ["[PAD]", "</s>", "[UNK]", "<s>"], bos="<s>")
  pad, eos, bos = (policy_tok.pad_token_id, policy_tok.eos_token_id, policy_tok.bos_token_id)
  prompts = [[bos, *policy_tok("the movie was")["input_ids"]], policy_tok("it was")["input_ids"]]
  responses = [[*policy_tok("good fun")["input_ids"], eos], policy_tok("dull and bad")["input_ids"]]
  rollout = _rollout(prompts, responses)
  assert pad == 0 and int(np.asarray(rollout.response_ids)[0, -1]) == eos  # EOS, then PAD
  model = ScalarModel(MODEL, head_init="reward", rngs=nnx.Rngs(0))
  scorer = RewardModelScorer(model, policy_tokenizer=policy_tok, reward_tokenizer=reward_tok,
                             max_length=MODEL.max_position_embeddings)
  assert scorer.retokenize
  scores = np.asarray(scorer(rollout))
  expected = []
  for text in ("the movie was good fun", "it was dull and bad"):
    ids = reward_tok(text)["input_ids"]
    assert ids[0] == reward_tok.bos_token_id and reward_tok.unk_token_id not in ids
    expected.append(float(model.score(jnp.asarray([ids]), jnp.ones((1, len(ids)), jnp.int32))[0]))
  np.testing.assert_allclose(scores, expected, atol=1e-5)
  # Before the fix the policy's "<|endoftext|>" reached the reward model as text: unknown tokens.
  literal = reward_tok("the movie was good fun<|endoftext|>", add_special_tokens=False)
  assert reward_tok.unk_token_id in literal["input_ids"]
