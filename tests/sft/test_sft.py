"""SFT: the masked next-token loss against NumPy, its normalisation, packing, eval, training,
records and chat templates, config errors, run folders and export."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_ppo.data.sft import SFTExample, encode_record, example_from_ids, pad_examples
from jax_ppo.models import LoRAConfig, add_lora, from_pretrained
from jax_ppo.models.logprobs import head_logprobs
from jax_ppo.models.transformer import CausalLM
from jax_ppo.sft import SFTBatch, SFTConfig, SFTOptimizer, SFTTrainer, sft_loss
from jax_ppo.training import RunOptions
from jax_ppo.training.loop import NonFiniteUpdates
from jax_ppo.training.state import batch_rows
from tests.ppo.conftest import EOS, MODEL

pytestmark = pytest.mark.usefixtures("persistent_compilation_cache")

BASE = SFTConfig(max_length=12, batch_size=4, eos_token_id=EOS, total_steps=20,
                 optimizer=SFTOptimizer(learning_rate=1e-2, lr_schedule="constant"))


def _examples(n=6, seed=0):
  """Examples of varied prompt and response lengths (ids 3.. : never PAD or EOS)."""
  rng = np.random.default_rng(seed)
  return [example_from_ids(rng.integers(3, MODEL.vocab_size, size=int(rng.integers(1, 5))),
                           rng.integers(3, MODEL.vocab_size, size=int(rng.integers(1, 6))),
                           eos_token_id=EOS) for _ in range(n)]


def _trainer(config=BASE, examples=None, seed=0, **kwargs):
  model = CausalLM(MODEL, rngs=nnx.Rngs(seed))
  return SFTTrainer(config, model, train_data=examples or _examples(), **kwargs)


def _numpy_nll(trainer, examples):
  """Reference: every example run alone; -log softmax of each response token given its prefix,
  in float64 NumPy. Returns the summed NLL and the number of response tokens."""
  graphdef, state = nnx.split(trainer.model())
  forward = jax.jit(lambda s, ids: nnx.merge(graphdef, s)(ids))
  total, count = 0.0, 0
  for ex in examples:
    ids = np.asarray(ex.prompt_ids + ex.response_ids)
    padded = np.zeros(12, np.int32)  # one compiled shape; causal: the tail changes nothing
    padded[: len(ids)] = ids
    logits = np.asarray(forward(state, jnp.asarray(padded[None])), np.float64)[0, : len(ids)]
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    p = len(ex.prompt_ids)
    for j in range(max(p, 1), len(ids)):  # token j is predicted at slot j - 1
      if ex.response_mask is not None and not ex.response_mask[j - p]:
        continue  # context inside the response
      total -= logp[j - 1, ids[j]]
      count += 1
  return total, count


def test_loss_equals_numpy_reference_with_global_token_normalisation():
  """One step of 4 rows in 2 microbatches with different token counts reports the token mean
  over the whole batch (not the mean of the microbatch means)."""
  examples = _examples(4, seed=1)
  config = dataclasses.replace(BASE, gradient_accumulation_steps=2)
  trainer = _trainer(config, examples)
  want_sum, want_n = _numpy_nll(trainer, examples)
  c = trainer.config
  rows = trainer.train_rows.take(batch_rows(c.seed, 0, c.batch_size, trainer.train_rows.num_rows,
                                            epoch_end="pad"))
  counts = rows.loss_mask.reshape(2, 2, -1).sum(axis=(1, 2))
  assert counts[0] != counts[1] and counts.sum() == want_n
  batch = SFTBatch.from_rows(rows, packed=False)
  logprobs = jax.jit(trainer.steps.target_logprobs)(trainer.state.params, trainer.rest, batch)
  np.testing.assert_allclose(float(sft_loss(logprobs, batch.loss_mask)), want_sum / want_n,
                             rtol=1e-5)
  metrics = trainer.step()
  np.testing.assert_allclose(metrics["train/loss"], want_sum / want_n, rtol=1e-5)
  assert metrics["train/tokens"] == want_n
  # The same batch in one microbatch: same loss and the same (full-batch) gradient.
  single = _trainer(examples=examples).step()
  np.testing.assert_allclose(single["train/loss"], metrics["train/loss"], rtol=1e-6)
  np.testing.assert_allclose(single["train/grad_norm"], metrics["train/grad_norm"], rtol=1e-5)


def test_masked_response_tokens_are_input_but_never_targets():
  """Context inside a response (the user turns of a multi-turn chat: `response_mask` False) is
  attended to but carries no loss: the step's loss is the NumPy NLL of the trained tokens."""
  examples = [SFTExample((3, 4), (5, 6, 7, 8, EOS), (True, False, False, True, True)),
              *_examples(3, seed=3)]
  trainer = _trainer(examples=examples)
  want_sum, want_n = _numpy_nll(trainer, examples)
  assert want_n == 3 + sum(len(ex.response_ids) for ex in examples[1:])
  metrics = trainer.step()
  np.testing.assert_allclose(metrics["train/loss"], want_sum / want_n, rtol=1e-5)
  assert metrics["train/tokens"] == want_n


def test_prompt_and_padding_tokens_carry_no_loss_or_gradient():
  examples = _examples(4, seed=2)
  trainer = _trainer(examples=examples)
  rows = pad_examples(examples, max_length=12, pad_token_id=0)
  batch = SFTBatch.from_rows(rows, packed=False)
  model = trainer.model()
  hidden = jax.jit(lambda b: model.hidden_states(b.input_ids, b.attention_mask,
                                                 positions=b.positions))(batch)
  # The loss's gradient reaches the final hidden state of exactly the slots that carry loss.
  d_hidden = jax.grad(lambda h: sft_loss(head_logprobs(model, h, batch.targets, 1.0)[0],
                                         batch.loss_mask))(hidden)
  per_slot = np.abs(np.asarray(d_hidden)).sum(-1)
  assert np.all(per_slot[~rows.loss_mask] == 0) and np.all(per_slot[rows.loss_mask] > 0)
  # Exactly the slots that predict response tokens carry loss.
  for r, ex in enumerate(examples):
    p, m = len(ex.prompt_ids), ex.num_tokens
    np.testing.assert_array_equal(np.flatnonzero(rows.loss_mask[r]), np.arange(p - 1, m - 1))

  @jax.jit
  def loss_and_grads(b):
    return jax.value_and_grad(lambda params: sft_loss(
        trainer.steps.target_logprobs(params, trainer.rest, b), b.loss_mask))(
        trainer.state.params)

  loss, grads = loss_and_grads(batch)
  # Other ids in the padding and other targets at the masked (prompt, padding) slots.
  rng = np.random.default_rng(0)
  noise = rng.integers(3, MODEL.vocab_size, size=rows.input_ids.shape).astype(np.int32)
  changed = batch.replace(
      input_ids=jnp.where(batch.attention_mask, batch.input_ids, noise),
      targets=jnp.where(batch.loss_mask, batch.targets, noise[:, ::-1]),
  )
  loss2, grads2 = loss_and_grads(changed)
  np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads, grads2)
  # ... whereas a changed response target does change the loss.
  flipped = batch.replace(targets=jnp.where(batch.loss_mask, (batch.targets + 1) % 20, 0))
  assert abs(float(loss_and_grads(flipped)[0]) - float(loss)) > 1e-3


def test_training_on_a_repetitive_corpus_drives_the_loss_down():
  rng = np.random.default_rng(0)
  corpus = [example_from_ids(rng.integers(3, 24, size=3), [5, 6, 7, 8, 9, 10], eos_token_id=EOS)
            for _ in range(40)]
  config = dataclasses.replace(BASE, batch_size=8, total_steps=30, eval_fraction=0.2,
                               eval_every=10, optimizer=SFTOptimizer(
                                   warmup_steps=3, lr_schedule="cosine", learning_rate=3e-2))
  trainer = _trainer(config, corpus)
  before = trainer.evaluate()
  history = trainer.train()
  assert len(history) == 30 and trainer.step_count == 30
  losses = [m["train/loss"] for m in history]
  assert np.mean(losses[-5:]) < 0.3 * losses[0], losses
  after = trainer.evaluate()
  assert after["eval/loss"] < 0.3 * before["eval/loss"]
  assert history[-1]["eval/loss"] == pytest.approx(after["eval/loss"])  # eval_every=10
  assert "eval/loss" not in history[-2]
  assert [m["lr"] for m in history[:2]] == pytest.approx([0.0, 1e-2])  # warm-up from 0
  assert all(m["skipped_updates"] == 0 for m in history)


def test_eval_loss_is_the_token_mean_over_the_split_and_perplexity_its_exp():
  examples = _examples(7, seed=3)  # 7 rows in batches of 4: the last batch has an empty row
  trainer = _trainer(examples=_examples(4), eval_data=examples)
  want_sum, want_n = _numpy_nll(trainer, examples)
  got = trainer.evaluate()
  np.testing.assert_allclose(got["eval/loss"], want_sum / want_n, rtol=1e-5)
  assert got["eval/tokens"] == want_n
  assert got["eval/perplexity"] == pytest.approx(math.exp(got["eval/loss"]), rel=1e-12)
  assert trainer.evaluate(examples) == got


def test_held_out_split_is_disjoint_and_seeded():
  examples = _examples(10)
  config = dataclasses.replace(BASE, eval_fraction=0.3)
  a, b = _trainer(config, examples), _trainer(config, examples)
  assert a.eval_rows.num_rows == 3 and a.train_rows.num_rows == 7
  np.testing.assert_array_equal(a.eval_rows.input_ids, b.eval_rows.input_ids)
  train = {tuple(r) for r in a.train_rows.input_ids}
  assert not train & {tuple(r) for r in a.eval_rows.input_ids}
  with pytest.raises(ValueError, match="No held-out split"):
    _trainer().evaluate()


def test_packed_loss_and_gradient_equal_the_unpacked_ones():
  examples = _examples(8, seed=4)
  plain = _trainer(examples=examples[:2], eval_data=examples)
  packed = _trainer(dataclasses.replace(BASE, packing=True), examples[:2], eval_data=examples)
  assert packed.eval_rows.num_rows < plain.eval_rows.num_rows  # several examples per row
  assert packed.eval_rows.segment_ids.max() >= 2
  want, got = plain.evaluate(), packed.evaluate()
  assert got["eval/tokens"] == want["eval/tokens"]
  np.testing.assert_allclose(got["eval/loss"], want["eval/loss"], rtol=1e-5)

  def grads(trainer):
    batch = SFTBatch.from_rows(trainer.eval_rows, packed=trainer.config.packing)
    return jax.jit(jax.grad(lambda p: sft_loss(
        trainer.steps.target_logprobs(p, trainer.rest, batch), batch.loss_mask)))(
        trainer.state.params)

  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               grads(plain), grads(packed))
  # A packed training step runs and reports the same kind of metrics.
  assert np.isfinite(packed.step()["train/loss"])


def _tokenizer(tmp_path):
  pytest.importorskip("tokenizers")
  import transformers
  from tokenizers import Tokenizer, models, pre_tokenizers

  words = ["<pad>", "<s>", "</s>", "hello", "world", "user", "assistant", ":", "good"]
  backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
  backend.pre_tokenizer = pre_tokenizers.Whitespace()
  tok = transformers.PreTrainedTokenizerFast(
      tokenizer_object=backend, eos_token="</s>", bos_token="<s>", pad_token="<pad>")
  tok.chat_template = (
      "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
      "{% if add_generation_prompt %}assistant :{% endif %}")
  return tok


def test_chat_and_plain_records_through_the_tokenizer(tmp_path):
  tok = _tokenizer(tmp_path)
  chat = {"messages": [{"role": "user", "content": "hello"},
                       {"role": "assistant", "content": "good world"}]}
  ex = encode_record(chat, tok)
  assert ex.prompt_ids == (5, 7, 3, 6, 7)  # "user : hello assistant :"
  assert ex.response_ids == (8, 4, 2)  # "good world" + EOS
  plain = encode_record({"q": "hello world", "a": "good"}, tok, prompt_field="q",
                        response_field="a")
  assert plain == SFTExample((3, 4), (8, 2))
  assert encode_record({"prompt": "hello", "response": "good </s>"}, tok).response_ids == (8, 2)
  assert encode_record({"prompt": "hello", "response": "good"}, tok,
                       add_eos=False).response_ids == (8,)
  with pytest.raises(ValueError, match=r"train_data\[1\]: expected an object with \"prompt\" and "
                                       r"\"response\" or \"completion\" .* got keys \['prompt'\]"):
    SFTTrainer(BASE, CausalLM(MODEL, rngs=nnx.Rngs(0)), tokenizer=tok,
               train_data=[chat, {"prompt": "hello"}])
  # TRL's prompt-completion records: "completion" is the response; both is one error.
  assert encode_record({"prompt": "hello world", "completion": "good"}, tok) == encode_record(
      {"prompt": "hello world", "response": "good"}, tok)
  assert encode_record({"prompt": chat["messages"][:1], "completion": chat["messages"][1:]},
                       tok) == ex
  with pytest.raises(ValueError, match=r"^train_data\[1\]: the record has both 'response' and "
                                       "'completion'"):
    SFTTrainer(BASE, CausalLM(MODEL, rngs=nnx.Rngs(0)), tokenizer=tok,
               train_data=[chat, {"prompt": "a", "response": "b", "completion": "c"}])
  with pytest.raises(ValueError, match=r"\"response\" or \"completion\" strings .* got "
                                       r"keys \['prompt'\]; name the record's field with "
                                       r"response_field"):
    encode_record({"prompt": "hello"}, tok)
  with pytest.raises(ValueError, match="must be the assistant's"):
    encode_record({"messages": chat["messages"][:1]}, tok)
  with pytest.raises(ValueError, match='"prompt" must be a string, got 3 \\(int\\)'):
    encode_record({"prompt": 3, "response": "good"}, tok)
  with pytest.raises(ValueError, match="pass the tokenizer"):
    _trainer(examples=[chat])
  trainer = SFTTrainer(dataclasses.replace(BASE, eos_token_id=None), CausalLM(
      MODEL, rngs=nnx.Rngs(0)), train_data=[chat, {"prompt": "hello world", "response": "good"}],
      tokenizer=tok)
  assert trainer.train_rows.input_ids[0, :8].tolist() == [5, 7, 3, 6, 7, 8, 4, 2]
  assert trainer.pad_token_id == 0
  path = trainer.export(tmp_path / "hf")  # the model and its tokenizer, one HF folder
  assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()


def test_long_examples_keep_the_prompt_and_cut_the_response():
  rows = pad_examples([SFTExample((3, 4, 5), (6, 7, 8, 9, 2))], max_length=5)
  assert rows.input_ids.tolist() == [[3, 4, 5, 6, 7]]
  assert rows.loss_mask.tolist() == [[False, False, True, True, False]]
  with pytest.raises(ValueError, match="Example 0 has a prompt of 5 tokens"):
    pad_examples([SFTExample((3, 4, 5, 6, 7), (2,))], max_length=5)


@pytest.mark.parametrize("field,value,match", [
    ("batch_size", 0, "use an int >= 1"),
    ("gradient_accumulation_steps", 3, "batch_size=4 is invalid: it must be divisible"),
    ("max_length", 1, "use an int >= 2"),
    ("eval_fraction", 1.0, r"\[0, 1\)"),
    ("optimizer", SFTOptimizer(warmup_steps=30),
     r"its warmup_steps \(30\) exceeds the run's total_steps \(20\)"),
    ("optimizer", {"learning_rate": 1e-5}, "pass an OptimizerConfig"),
    ("total_steps", 0, "use an int >= 1, or None"),
    ("packing", 1, "use True or False"),
    ("eos_token_id", -1, "use a token id >= 0"),
    ("prompt_field", "", "non-empty string"),
    ("max_consecutive_skips", 0, "use an int >= 1, or None"),
])
def test_config_errors_name_the_field_and_the_fix(field, value, match):
  with pytest.raises(ValueError, match=rf"SFTConfig\.\w+=.* is invalid: .*{match}"
                     if field != "gradient_accumulation_steps" else match) as err:
    dataclasses.replace(BASE, **{field: value})
  assert "SFTConfig." in str(err.value)


@pytest.mark.parametrize("field,value,match", [
    ("lr_schedule", "step", "choose one of"),
    ("learning_rate", 0.0, r"use a value > 0 \(1e-5 to 1e-4 for full SFT fine-tuning\)"),
    ("max_grad_norm", 0.0, "use a value > 0 or None"),
    ("warmup_steps", -1, "use an int >= 0"),
])
def test_optimizer_errors_name_the_field_and_sft_learning_rates(field, value, match):
  with pytest.raises(ValueError, match=rf"SFTOptimizer\.{field}=.* is invalid: {match}"):
    SFTOptimizer(**{field: value})


def test_trainer_errors():
  with pytest.raises(ValueError, match=r"SFTConfig\.optimizer\.warmup_steps=9 is invalid: it "
                                       "exceeds the run's 2 optimizer steps"):
    _trainer(dataclasses.replace(BASE, total_steps=None, optimizer=SFTOptimizer(warmup_steps=9)),
             _examples(8))
  with pytest.raises(ValueError, match="add_eos is True but there is no EOS id"):
    _trainer(dataclasses.replace(BASE, eos_token_id=None))
  with pytest.raises(ValueError, match=r"train_data\[1\] is a str"):
    _trainer(examples=[([3], [4]), "text"])
  assert _trainer(dataclasses.replace(BASE, total_steps=None, num_epochs=3),
                  _examples(9)).total_steps == 9  # 3 batches per epoch


def test_non_finite_steps_are_skipped_and_stop_the_run():
  trainer = _trainer(dataclasses.replace(BASE, max_consecutive_skips=2))
  poisoned = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan), trainer.state.params)
  trainer.state = trainer.state.replace(params=poisoned)
  params_before = jax.tree.map(np.asarray, poisoned)  # host copies: the step donates the state
  opt_before = jax.tree.map(np.asarray, trainer.state.opt_state)
  with pytest.raises(NonFiniteUpdates, match="2 consecutive steps"):
    trainer.train(5)
  assert trainer.step_count == 2
  jax.tree.map(np.testing.assert_array_equal, params_before,
               jax.tree.map(np.asarray, trainer.state.params))
  jax.tree.map(np.testing.assert_array_equal, opt_before,
               jax.tree.map(np.asarray, trainer.state.opt_state))


def test_lora_sft_trains_only_the_adapters():
  model = add_lora(CausalLM(MODEL, rngs=nnx.Rngs(0)), LoRAConfig(rank=2, alpha=4),
                   rngs=nnx.Rngs(1))
  trainer = SFTTrainer(BASE, model, train_data=_examples())
  assert trainer.lora
  leaves = jax.tree_util.tree_leaves_with_path(trainer.state.params)
  assert leaves and all("lora" in jax.tree_util.keystr(p) for p, _ in leaves)
  before = jax.tree.map(np.asarray, trainer.state.params)
  rest = jax.tree.map(np.asarray, trainer.rest)
  trainer.step()
  assert any(not np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(before), jax.tree.leaves(trainer.state.params), strict=True))
  jax.tree.map(np.testing.assert_array_equal, rest, jax.tree.map(np.asarray, trainer.rest))


@pytest.mark.slow
def test_run_folder_resumes_like_the_uninterrupted_run_and_exports(tmp_path):
  opts = RunOptions(save_every=2, progress=False, tensorboard=False, async_checkpointing=False)
  config = dataclasses.replace(BASE, total_steps=5, eval_fraction=0.3, eval_every=2)
  examples = _examples(12)
  with _trainer(config, examples, run_dir=tmp_path / "ref", run_options=opts) as ref:
    ref.train()
    want = jax.tree.map(np.asarray, ref.state)
  with _trainer(config, examples, run_dir=tmp_path / "run", run_options=opts) as first:
    first.train(3)
  second = _trainer(config, examples, run_dir=tmp_path / "run", run_options=opts)
  assert second.step_count == 3
  second.train()
  second.close()
  assert second.steps.train_step._cache_size() == 1  # a restored state compiles nothing new
  jax.tree.map(np.testing.assert_array_equal, want, jax.tree.map(np.asarray, second.state))
  logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
  assert [r["step"] for r in logged] == [1, 2, 3, 4, 5]
  assert "eval/perplexity" in logged[3] and "train/loss" in logged[0]
  assert (tmp_path / "run" / "config.yaml").is_file()

  path = second.export(tmp_path / "hf")
  reloaded = from_pretrained(str(path))
  ids = jnp.asarray([[3, 5, 9, 2, 0]])
  mask = ids != 0
  np.testing.assert_allclose(np.asarray(reloaded(ids, mask)),
                             np.asarray(second.model()(ids, mask)), atol=1e-6)


def test_train_never_runs_past_total_steps():
  trainer = _trainer(dataclasses.replace(BASE, total_steps=3))
  assert len(trainer.train(2)) == 2 and trainer.step_count == 2
  assert len(trainer.train(5)) == 1 and trainer.step_count == 3  # capped at total_steps
  assert len(trainer.train()) == 0 and trainer.step_count == 3
  with trainer as same:  # a context manager that closes the (absent) run folder
    assert same is trainer and same.run_dir is None


def test_sigterm_during_sft_checkpoints_and_the_rerun_ends_like_the_uninterrupted_run(tmp_path):
  """Preemption of the SFT stage: SIGTERM during `train()` finishes the step in flight, writes a
  checkpoint and returns (`preempted`); a new trainer on the run folder continues and ends
  bit-equal to an uninterrupted run."""
  import os
  import signal

  opts = RunOptions(save_every=10, progress=False, tensorboard=False, async_checkpointing=False)
  config = dataclasses.replace(BASE, total_steps=5)
  examples = _examples(12)
  with _trainer(config, examples, run_dir=tmp_path / "ref", run_options=opts) as ref:
    ref.train()
    want = jax.tree.map(np.asarray, ref.state)

  calls = []

  def preempt(metrics):
    calls.append(metrics)
    if len(calls) == 2:  # after the second step's bookkeeping
      os.kill(os.getpid(), signal.SIGTERM)

  with _trainer(config, examples, run_dir=tmp_path / "run", run_options=opts) as first:
    history = first.train(callback=preempt)
  assert history.preempted == "SIGTERM" and first.preempted == "SIGTERM"
  assert first.step_count == 2 and len(history) == 2
  with _trainer(config, examples, run_dir=tmp_path / "run", run_options=opts) as second:
    assert second.step_count == 2  # the checkpoint written on the signal (save_every=10)
    second.train()
  jax.tree.map(np.testing.assert_array_equal, want, jax.tree.map(np.asarray, second.state))


def test_a_multi_process_job_without_a_mesh_is_one_clear_error(tmp_path, monkeypatch):
  """Several processes each training the whole model on their own devices would silently
  diverge: without a mesh both the trainer and `jax-ppo sft` refuse, naming the fix."""
  from jax_ppo.parallel import distributed
  from jax_ppo.runs import sft as sft_run

  monkeypatch.setattr(distributed, "multi_process", lambda: True)
  with pytest.raises(ValueError, match=r"a multi-process run trains on one device mesh .*"
                                       r"SFTRunConfig\.mesh"):
    _trainer()
  (tmp_path / "model").mkdir()  # (apart from the run folder: jax_ppo.runs.paths)
  (tmp_path / "model" / "config.json").write_text("{}")
  config = sft_run.SFTRunConfig(model_path=str(tmp_path / "model"), train_path="t.jsonl",
                                run_dir=str(tmp_path / "run"))
  with pytest.raises(ValueError, match=r"SFTRunConfig\.mesh=None, but this is one of several "
                                       r"processes.*mesh\.data=-1"):
    sft_run.build_sft_trainer(config)
