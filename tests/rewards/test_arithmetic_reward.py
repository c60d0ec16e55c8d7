"""The arithmetic task's exact-match reward (`jax_ppo.rewards.arithmetic`): which number of a
response is its answer, exact match against the problem its prompt states, and
`reward_function=arithmetic_exact_match` in a run config."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_ppo.data.arithmetic import OPERATIONS, Problem
from jax_ppo.rewards import specs
from jax_ppo.rewards.arithmetic import exact_match, final_answer
from jax_ppo.rewards.scorers import FunctionScorer, RewardFunctionError
from jax_ppo.runs import ppo_config
from tests.data.test_arithmetic import byte_tokenizer
from tests.rewards.test_reward_sources import _rollout

PROMPT = Problem(37, "+", 48).prompt  # 85
NEGATIVE = Problem(3, "-", 12).prompt  # -9
BIG = Problem(99, "*", 99).prompt  # 9801


@pytest.mark.parametrize("prompt, response, score", [
    (PROMPT, " 37 + 48 = 85. Answer: 85", 1.0),  # the worked answer
    (PROMPT, "85", 1.0),
    (PROMPT, "  \n 85 \n", 1.0),  # whitespace around
    (PROMPT, " The sum of 37 and 48 is 85.", 1.0),  # extra text: the last integer counts
    (PROMPT, " Answer: 85. I checked it twice, 2 times.", 1.0),  # after "Answer:", the first
    (PROMPT, " answer :+85", 1.0),
    (PROMPT, " 84", 0.0),  # wrong
    (PROMPT, " 85, no, 86", 0.0),  # the last integer is 86
    (PROMPT, " Answer: 86. (85?)", 0.0),  # the stated answer, not a later number
    (PROMPT, " I do not know.", 0.0),  # no number
    (PROMPT, "", 0.0),
    (PROMPT, " 85.0", 0.0),  # not an integer
    (PROMPT, " x85", 0.0),
    (NEGATIVE, " 3 - 12 = -9. Answer: -9", 1.0),
    (NEGATIVE, " \u22129", 1.0),  # the Unicode minus
    (NEGATIVE, " 9", 0.0),  # the sign matters
    (NEGATIVE, " 12-9", 0.0),  # a hyphen after a digit is no sign: the answer read is 9
    (BIG, " 9,801", 1.0),  # thousands grouped by commas
    (BIG, " Answer: 9801<|endoftext|>", 1.0),  # the EOS the decoded response keeps
    (BIG, " 98,01", 0.0),
])
def test_exact_match_on_hand_written_responses(prompt, response, score):
  assert exact_match([prompt], [response]) == [score]


@pytest.mark.parametrize("response, answer", [
    ("Answer: unsure, maybe 85", 85),  # the first integer after the marker, words between
    ("Answer: none", None),
    ("no idea", None),
    ("10-3", 3),
    ("x = -3", -3),
    ("It is -1,204.", -1204),
    ("2.5", None),
    ("3rd", None),
    ("Answer: 4\nAnswer: 5", 5),
])
def test_final_answer(response, answer):
  assert final_answer(response) == answer


@settings(max_examples=200, deadline=None)
@given(a=st.integers(0, 10**6), b=st.integers(0, 10**6), op=st.sampled_from(OPERATIONS),
       form=st.sampled_from([" {}", " The answer is {}.", " Answer: {}", "{} ", " = {:,}"]))
def test_the_true_answer_scores_one_and_the_answer_plus_one_scores_zero(a, b, op, form):
  problem = Problem(a, op, b)
  truth, wrong = problem.answer, problem.answer + 1
  worked = Problem(a, op, b).worked_answer
  assert exact_match([problem.prompt] * 2, [worked, form.format(truth)]) == [1.0, 1.0]
  assert exact_match([problem.prompt] * 2, [worked.replace(f"Answer: {truth}", f"Answer: {wrong}"),
                                            form.format(wrong)]) == [0.0, 0.0]


def test_a_prompt_without_a_problem_is_an_error():
  with pytest.raises(ValueError, match=r"row 1's prompt 'Tell me a story\.' states no "
                                       r"arithmetic problem.*python -m jax_ppo\.data\.arithmetic"):
    exact_match([PROMPT, "Tell me a story."], ["85", "85"])
  with pytest.raises(ValueError, match="got 2 prompts and 1 responses"):
    exact_match([PROMPT, PROMPT], ["85"])


def test_the_named_reward_scores_a_rollout_from_a_run_config():
  config = ppo_config.load_run_config(["policy_path=policy", "prompts_path=train.jsonl",
                                       "run_dir=run", "reward_function=arithmetic_exact_match"])
  assert config.reward_function == "arithmetic_exact_match"
  tok = byte_tokenizer()
  scorer = specs.reward_function(config.reward_function, tok)
  assert isinstance(scorer, FunctionScorer) and scorer.name == "arithmetic_exact_match"
  prompts = [PROMPT, NEGATIVE, BIG, PROMPT]
  responses = [" 37 + 48 = 85. Answer: 85", " -9", " 9800", " I think 86"]
  eos = tok.eos_token_id
  ids = lambda text: tok(text)["input_ids"]  # noqa: E731
  rollout = _rollout([ids(p) for p in prompts], [[*ids(r), eos] for r in responses])
  scores = scorer(rollout)
  assert scores.dtype == np.float32 and np.asarray(scores).tolist() == [1.0, 1.0, 0.0, 0.0]
  # A prompt that states no problem stops the run (it is no silent zero).
  with pytest.raises(RewardFunctionError, match="arithmetic_exact_match"):
    scorer(_rollout([ids("Tell me a story.")], [ids(" 85")]))


def test_the_named_reward_needs_the_tokenizer_and_takes_no_argument():
  with pytest.raises(ValueError, match="scores decoded texts: give the policy's tokenizer"):
    specs.reward_function("arithmetic_exact_match")
  with pytest.raises(ValueError, match="write it as 'arithmetic_exact_match'"):
    specs.parse_reward_function("arithmetic_exact_match:3")
  assert "arithmetic_exact_match" in specs.REWARD_FUNCTIONS
