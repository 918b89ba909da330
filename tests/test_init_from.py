"""Starting from a Hugging Face checkpoint directory (`--config.init_from`): a tiny DeepseekV3 checkpoint
written by `model.save_hf_checkpoint`, with its own `tokenizer.json`, runs through demo and pretrain; one
with a Kimi-style `tiktoken.model` (mergeable ranks) and `tokenizer_config.json` (special tokens) instead
pretrains and goes on to SFT, or stops there in one line when the turn format's tokens are not named."""

import base64
import dataclasses
import functools
import importlib.util
import json
import pathlib
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from tiny import TINY

from composer_jax import configs, model, pipeline, sharding
from composer_jax.data import tokenizer
from composer_jax.rl import chat
from composer_jax.train.losses import next_token_logp

_ROOT = pathlib.Path(__file__).resolve().parents[1]
CFG = dataclasses.replace(TINY, vocab_size=272)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> pathlib.Path:
  """config.json + model.safetensors (weights of seed 123) + a byte-level BPE (264 ids at most) with its
  own eos and pad."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  d = tmp_path_factory.mktemp("hf")
  params = model.init(CFG, jax.random.key(123))
  model.save_hf_checkpoint(params, CFG, str(d))
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  specials = ["</s>", "<pad>", *chat.CHAT_TOKENS]  # the turn format's tokens: sft and rl can run on it
  trainer = trainers.BpeTrainer(
    vocab_size=270, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  tok.train_from_iterator([f"def f{i}(x):\n  return x * {i}\n" for i in range(200)], trainer)
  tok.save(str(d / "tokenizer.json"))
  (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "<pad>"}))
  return d


@pytest.fixture(scope="module")
def plain_hf_dir(hf_dir, tmp_path_factory) -> pathlib.Path:
  """The same checkpoint with a tokenizer that lacks the chat tokens."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  d = tmp_path_factory.mktemp("hf_plain")
  for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
    (d / name).write_bytes((hf_dir / name).read_bytes())
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=264, special_tokens=["</s>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  tok.train_from_iterator(["def f(x):\n  return x\n"] * 20, trainer)
  tok.save(str(d / "tokenizer.json"))
  return d


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> str:
  from composer_jax.data import corpus

  root = tmp_path_factory.mktemp("src")
  want, i = {"train": 6, "validation": 2}, 0
  while any(want.values()):
    name, i = f"mod_{i}.py", i + 1
    if want[corpus.split_of(name)]:
      want[corpus.split_of(name)] -= 1
      (root / name).write_text("".join(f"def f{j}(x):\n  return x * {j % 7}\n\n" for j in range(30)))
  return str(root)


def _config(hf_dir, corpus_dir, stages: str, **train):
  spec = importlib.util.spec_from_file_location("small", _ROOT / "tests" / "small_experiment.py")
  exp = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(exp)
  c = exp.get_config()
  c.stages, c.init_from, c.data.src_dir = stages, str(hf_dir), corpus_dir
  c.model.vocab_size = 9999  # replaced by the checkpoint's config.json
  c.train.update(train)
  return c


def test_the_checkpoint_sets_model_and_tokenizer(hf_dir, corpus_dir):
  config = configs.resolve(configs.from_config(_config(hf_dir, corpus_dir, "demo")))
  assert config.model == dataclasses.replace(CFG, init_std=config.model.init_std)
  tok = tokenizer.load(config.data.tokenizer)
  vocab = json.loads((hf_dir / "tokenizer.json").read_text())["model"]["vocab"]
  assert isinstance(tok, tokenizer.HFTokenizer) and tok.vocab_size == len(vocab) <= 272
  assert (tok.eos_id, tok.pad_id) == (0, 1) and tok.decode(tok.encode("def f1(x):")) == "def f1(x):"
  assert (
    config.data.tokenizer == str(hf_dir) and chat.tokenizer(config.data.tokenizer).special_id("<|user|>") > 1
  )
  assert tok.encode("<|user|>") != [tok.special_id("<|user|>")]  # in text, a special's name is text
  with pytest.raises(KeyError, match="no <\\|nope\\|> token"):
    tok.special_id("<|nope|>")


def test_demo_runs_the_checkpoint_weights(hf_dir, corpus_dir, tmp_path, meshes):
  out = pipeline.run(_config(hf_dir, corpus_dir, "demo"), str(tmp_path))["demo"]
  config = configs.resolve(configs.from_config(_config(hf_dir, corpus_dir, "demo")))
  params = model.load_hf_checkpoint(str(hf_dir), config.model, meshes)
  rng = jax.random.fold_in(jax.random.key(config.seed), 1)
  tokens = jax.random.randint(rng, (config.demo.batch, config.demo.prompt_len), 0, config.model.vocab_size)
  tokens = jax.device_put(tokens, sharding.activation_sharding(("batch", "seq"), meshes))
  logits, _ = jax.jit(functools.partial(model.apply, cfg=config.model, meshes=meshes))(params, tokens=tokens)
  assert out["loss"] == pytest.approx(float(-next_token_logp(logits, tokens).mean()), rel=1e-6)


def test_pretrain_starts_from_the_checkpoint(hf_dir, corpus_dir, tmp_path):
  """lr 0 and no router-bias moves: two steps leave the weights exactly the checkpoint's."""
  c = _config(hf_dir, corpus_dir, "pretrain", router_bias_rate=0.0)
  c.train.schedule.update(steps=2, checkpoint_every=2)
  c.optim.update(learning_rate=0.0, weight_decay=0.0, qk_clip_tau=0.0)
  out = pipeline.run(c, str(tmp_path))["pretrain"]
  assert out["steps"] == 2 and np.isfinite(out["last_train_loss"])
  saved = ocp.StandardCheckpointer().restore(tmp_path / "checkpoints" / "2" / "state")["params"]
  want = jax.device_get(model.init(CFG, jax.random.key(123)))
  assert _by_path(saved).keys() == _by_path(want).keys()
  for path, leaf in _by_path(want).items():
    np.testing.assert_array_equal(_by_path(saved)[path], leaf, err_msg=path)
  assert 0 < out["first_validation_loss"] < np.log(272) + 2
  # Extended, the run resumes from its own checkpoint without reading the Hugging Face weights again.
  hidden = [(f, f.with_suffix(".hidden")) for f in hf_dir.glob("*.safetensors")]
  assert hidden
  try:
    for f, to in hidden:
      f.rename(to)
    c.train.schedule.update(steps=3)
    more = pipeline.run(c, str(tmp_path))["pretrain"]
  finally:
    for f, to in hidden:
      to.rename(f)
  assert (more["start_step"], more["steps"]) == (2, 3)


def _by_path(tree) -> dict:
  """{"layers/0/attn/q_a_proj": leaf}: orbax restores list indices as string keys."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  name = lambda k: str(getattr(k, "key", getattr(k, "idx", k)))  # noqa: E731
  return {"/".join(name(k) for k in path): np.asarray(leaf) for path, leaf in flat}


def _chat_config(hf_dir, corpus_dir, stages: str, mesh=((4, 1, 2), (8, 1))):
  """sft with lr 0 (the weights stay the checkpoint's), then RL: a step or two of each, tiny batches."""
  c = _config(hf_dir, corpus_dir, stages)
  c.mesh.dense, c.mesh.expert = mesh
  c.optim.update(weight_decay=0.0, qk_clip_tau=0.0)
  # Rows divide replica·fsdp on either mesh (4 on (4, 1, 2), 4 on (2, 2, 2)).
  c.sft.update(lr=0.0, batch_size=4, pack_len=0, demos=8, eval_problems=4, router_bias_rate=0.0)
  c.sft.schedule.steps = 2
  c.rl.update(problems_per_step=2, group_size=2, feedback_rows=4, cache_len=512)
  c.rl.schedule.update(steps=1, eval_every=0)
  c.gate.update(min_flagged=1, samples=2, rollouts_per_batch=4, max_batches=1, required=False)  # rl after it
  return c


@pytest.mark.parametrize("mesh", [((4, 1, 2), (8, 1)), ((2, 2, 2), (8, 1))], ids=["4x1x2", "2x2x2"])
def test_sft_gate_and_rl_start_from_the_checkpoint_with_its_tokenizer(hf_dir, corpus_dir, tmp_path, mesh):
  """The chat stages run on the checkpoint's model and tokenizer, on the meshes the config names (fsdp 2
  shards the weights): sft (lr 0) saves the checkpoint's own weights, its demos are made of the
  checkpoint's ids, and the gate and RL run on top, each saying where its weights came from."""
  from composer_jax.rl.envs import factories
  from composer_jax.stages import weights

  c = _chat_config(hf_dir, corpus_dir, "sft,gate,rl", mesh)
  out = pipeline.run(c, str(tmp_path))
  config = configs.resolve(configs.from_config(c))
  tok = chat.tokenizer(str(hf_dir))
  assert out["sft"]["steps"] == 2 and np.isfinite(out["sft"]["last_loss"])
  assert out["sft"]["init"] == f"init_from {hf_dir}"
  assert "gate" in out and out["rl"]["steps"] == 1 and np.isfinite(out["rl"]["history"][-1]["reward"])
  assert out["rl"]["init"].startswith("sft checkpoint") and out["gate"]["init"].startswith("sft checkpoint")
  saved, step = weights.checkpoint_params(tmp_path / "sft", config.model, None)
  assert step == 2
  want = jax.device_get(model.init(CFG, jax.random.key(123)))
  for path, leaf in _by_path(want).items():
    np.testing.assert_array_equal(_by_path(saved)[path], leaf, err_msg=path)
  demo = factories.demonstrations(config.rl, config.sft, 0, tok)[0]
  assert demo.tokens[0] == tok.special_id("<|user|>") and max(demo.tokens) < tok.vocab_size


def test_the_gate_oracle_reads_a_checkpoint_tokenizer(hf_dir):
  """`valid_next` over a BPE vocabulary: every id it allows keeps the call a valid prefix."""
  from composer_jax.rl import gate

  tok = chat.tokenizer(str(hf_dir))
  arity = {"add": 2}
  prefix = [tok.special_id("<|tool_call|>"), *tok.encode("add 1")]
  allowed = gate.valid_next(prefix, arity, tok)
  assert allowed and all(gate.call_prefix_ok(tok.decode(prefix[1:] + [i]), arity) for i in allowed)
  assert tok.encode("x")[0] not in allowed and tok.special_id("<|/tool_call|>") not in allowed
  done = [tok.special_id("<|tool_call|>"), *tok.encode("add 1 2")]
  assert tok.special_id("<|/tool_call|>") in gate.valid_next(done, arity, tok)


@pytest.mark.parametrize("stage", ["sft", "gate", "rl"])
def test_a_tokenizer_without_the_chat_tokens_is_refused_in_one_line(
  plain_hf_dir, corpus_dir, tmp_path, stage
):
  with pytest.raises(configs.ConfigError, match="data.tokenizer: .* has no <\\|system\\|>, <\\|user\\|>"):
    pipeline.run(_chat_config(plain_hf_dir, corpus_dir, stage), str(tmp_path))
  assert not any(tmp_path.iterdir())  # refused before any work


def test_a_checkpoint_whose_tokenizer_cannot_be_read_is_refused_in_one_line(hf_dir, tmp_path, monkeypatch):
  """A tokenizer only in some other tiktoken file, or a tiktoken.model without the tiktoken package: the run
  stops before any work instead of tokenizing with another vocabulary."""
  d = tmp_path / "ckpt"
  d.mkdir()
  (d / "config.json").write_text((hf_dir / "config.json").read_text())
  (d / "o200k.tiktoken").write_text("")
  with pytest.raises(
    configs.ConfigError, match="o200k.tiktoken, and neither tokenizer.json nor tiktoken.model"
  ):
    configs.resolve(dataclasses.replace(configs.Config(), init_from=str(d)))
  (d / "o200k.tiktoken").unlink()  # no tokenizer file at all: the config's own tokenizer stays
  assert configs.resolve(dataclasses.replace(configs.Config(), init_from=str(d))).data.tokenizer == "byte"
  (d / "tiktoken.model").write_text("")
  monkeypatch.setitem(sys.modules, "tiktoken", None)  # as if the extra were not installed
  with pytest.raises(
    configs.ConfigError, match=r"tiktoken.model, which needs the tiktoken package: .*\[tiktoken\]"
  ):
    configs.resolve(dataclasses.replace(configs.Config(), init_from=str(d)))


# --- a Kimi-style tiktoken checkpoint -----------------------------------------------------------------------

# Pieces of the test corpus and of the checks below; each becomes a chain of merges (its prefixes).
_PIECES = ["def", " f", "(x", "):", "\n", "  ", " return", " x", " *", "文", "English", "中文", "文E"]


def write_tiktoken(d: pathlib.Path, chat_tokens: bool) -> int:
  """`d/tiktoken.model` (the 256 bytes, then every prefix of `_PIECES`, and "x " first among the merges) and
  `d/tokenizer_config.json` ([BOS], [EOS] and [PAD] after the ranks, the turn format's tokens too when
  `chat_tokens`); returns the number of ranks."""
  ranks = {bytes([b]): b for b in range(256)}
  for piece in ["x ", *_PIECES]:
    raw = piece.encode()
    for k in range(2, len(raw) + 1):
      ranks.setdefault(raw[:k], len(ranks))
  lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in ranks.items()]
  (d / "tiktoken.model").write_text("\n".join(lines) + "\n")
  n = len(ranks)
  names = {n: "[BOS]", n + 1: "[EOS]", n + 255: "[PAD]"}
  names |= {n + 2 + i: t for i, t in enumerate(chat.CHAT_TOKENS)} if chat_tokens else {}
  conf = {
    "bos_token": "[BOS]",
    "eos_token": "[EOS]",
    "pad_token": "[PAD]",
    "added_tokens_decoder": {str(i): {"content": t, "special": True} for i, t in names.items()},
  }
  (d / "tokenizer_config.json").write_text(json.dumps(conf))
  return n


def _tiktoken_checkpoint(d: pathlib.Path, chat_tokens: bool) -> pathlib.Path:
  n = write_tiktoken(d, chat_tokens)
  cfg = dataclasses.replace(TINY, vocab_size=n + tokenizer.RESERVED_SPECIAL_IDS)
  model.save_hf_checkpoint(model.init(cfg, jax.random.key(7)), cfg, str(d))
  return d


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> pathlib.Path:
  """A tiny random checkpoint with a tiktoken tokenizer that names the turn format's tokens."""
  return _tiktoken_checkpoint(tmp_path_factory.mktemp("kimi"), chat_tokens=True)


def test_a_tiktoken_tokenizer_reads_ranks_pattern_and_special_tokens(tmp_path):
  n = write_tiktoken(tmp_path, chat_tokens=False)
  tok = tokenizer.load(str(tmp_path))
  ranks = tokenizer.read_ranks(tmp_path / "tiktoken.model")
  assert isinstance(tok, tokenizer.TiktokenTokenizer) and tok.vocab_size == n + 256 == len(ranks) + 256
  assert tok.encode("def f(x):") == [ranks[b"def"], ranks[b" f"], ranks[b"(x"], ranks[b"):"]]
  # The Kimi pattern splits before merging: a space starts the next piece ("x" | " y", never "x "), and a
  # Han run is a piece of its own ("文" | "English", never "文E").
  assert tok.encode("x y") == [ranks[b"x"], ranks[b" "], ranks[b"y"]]  # the merge "x " never applies
  assert tok.encode("文English") == [ranks["文".encode()], ranks[b"English"]]
  for text in ["def f(x):\n  return x * 3\n", "中文English混合 ünïcödé 🙂\t\r\n", ""]:
    assert tok.decode(tok.encode(text)) == text
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (n, n + 1, n + 255)
  assert tok.decode([tok.eos_id]) == "[EOS]" and tok.encode("[EOS]") != [tok.eos_id]  # in text: text
  assert tok.special_id(f"<|reserved_token_{n + 7}|>") == n + 7 and tok.is_special(n + 7)
  assert not tok.is_special(n - 1) and tok.missing(["[EOS]", "<|user|>"]) == ["<|user|>"]
  with pytest.raises(KeyError, match="no <\\|user\\|> token"):
    tok.special_id("<|user|>")
  (tmp_path / "tiktoken.model").write_text("ZGVm 0\nZGVm 2\n")
  with pytest.raises(ValueError, match="ranks of its 1 tokens are not 0..0"):
    tokenizer.load(str(tmp_path))


def test_a_tiktoken_checkpoint_pretrains_and_reaches_sft(kimi_dir, corpus_dir, tmp_path):
  """init_from a Kimi-style directory: its tokenizer becomes the run's, pretraining starts from its weights
  and SFT from pretraining's checkpoint, on demos made of its ids and its turn tokens."""
  from composer_jax.rl.envs import factories

  c = _chat_config(kimi_dir, corpus_dir, "pretrain,sft")
  c.train.update(eval_batches=0)  # one step of each, no evaluation: two compiles
  c.train.schedule.update(steps=1, checkpoint_every=1)
  c.sft.update(eval_problems=0)
  c.sft.schedule.steps = 1
  config = configs.resolve(configs.from_config(c))
  n = len(tokenizer.read_ranks(kimi_dir / "tiktoken.model"))
  assert config.data.tokenizer == str(kimi_dir) and config.model.vocab_size == n + 256
  out = pipeline.run(c, str(tmp_path))
  assert out["pretrain"]["steps"] == 1 and np.isfinite(out["pretrain"]["last_train_loss"])
  assert out["sft"]["steps"] == 1 and np.isfinite(out["sft"]["last_loss"])
  assert out["sft"]["init"].startswith("pretrain checkpoint")
  tok = chat.tokenizer(str(kimi_dir))
  demo = factories.demonstrations(config.rl, config.sft, 0, tok)[0]
  assert demo.tokens[0] == tok.special_id("<|user|>") > 256 and max(demo.tokens) < tok.vocab_size


@pytest.mark.parametrize("stage", ["sft", "rl"])
def test_a_tiktoken_tokenizer_without_the_chat_tokens_is_refused_in_one_line(
  kimi_dir, corpus_dir, tmp_path, stage
):
  d = tmp_path / "ckpt"  # kimi_dir's model; its tokenizer without the turn format's tokens
  d.mkdir()
  write_tiktoken(d, chat_tokens=False)
  (d / "config.json").write_text((kimi_dir / "config.json").read_text())
  named = "added_tokens_decoder, at unnamed <\\|reserved_token_N\\|> ids"
  with pytest.raises(
    configs.ConfigError, match=f"data.tokenizer: .* has no <\\|system\\|>, <\\|user\\|>.*{named}"
  ):
    pipeline.run(_chat_config(d, corpus_dir, stage), str(tmp_path / "run"))
  assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())  # refused before any work
