"""Data: tfds builder without TensorFlow, by-file split, tokenizers' exact round trip, packing, resume."""

import glob
import json
import logging
import os
import shutil
import sys

import numpy as np
import pytest

from composer_jax.data import corpus, tokenizer

_TF_PRELOADED = "tensorflow" in sys.modules  # another test may import it; the claim is about this module

ODD_TEXTS = (
  "",
  "\x00\x01\x7f",
  "a\r\nb\rc\n\n\t  \t",
  "  leading spaces and trailing   ",
  "🐍👩‍👩‍👧 e\u0301 \u200b\ufeff \U0010ffff",
  "日本語のテキスト، مرحبا בעולם Ωμέγα",
  "literal <|eos|> and <|tool_call|>{}<|/tool_call|> are text",
  "def f(x):\n    return x ** 2  # ünïcödé\n",
)


def _fake_source(root):
  """A small fake stdlib: kept modules in both splits, plus files the builder must skip."""
  texts, i = {}, 0
  while sum(corpus.split_of(p) == "validation" for p in texts) < 2 or len(texts) < 24:
    rel = os.path.join("pkg", f"mod_{i}.py")
    body = "".join(f"def f{j}(x):\n  return x + {j}  # é {i}\n" for j in range(1 + (i * 7) % 40))
    texts[rel] = f'"""Module {i}."""\n' + body
    i += 1
  skipped = {
    os.path.join("test", "test_x.py"): "x = 1\n",
    os.path.join("pkg", "tests", "t.py"): "y = 2\n",
    os.path.join("site-packages", "third", "z.py"): "z = 3\n",
    os.path.join("pkg", "notes.txt"): "not python\n",
  }
  for rel, text in {**texts, **skipped}.items():
    os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
    with open(os.path.join(root, rel), "w", encoding="utf-8", newline="") as f:
      f.write(text)
  with open(os.path.join(root, "pkg", "latin1.py"), "wb") as f:
    f.write(b"# -*- coding: latin-1 -*-\ns = '\xe9'\n")  # not UTF-8: skipped
  return texts


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  src = str(tmp_path_factory.mktemp("src"))
  texts = _fake_source(src)
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  return src, texts, data_dir, corpus.build_corpus(data_dir, src_dir=src)


def _records(source):
  return {source[i]["path"].decode(): source[i]["text"].decode() for i in range(len(source))}


def test_builder_writes_array_record_and_reads_without_tensorflow(built):
  _, texts, data_dir, sources = built
  assert _TF_PRELOADED or "tensorflow" not in sys.modules
  assert glob.glob(os.path.join(data_dir, "*", "stdlib_code", "1.0.0", "*.array_record-*"))
  got = {}
  for split in corpus.SPLITS:
    got.update(_records(sources[split]))
  assert got == texts  # tests/, site-packages/, non-.py and non-UTF-8 files skipped; text exact


def test_split_is_deterministic_and_by_file(built):
  _, texts, _, sources = built
  train, valid = (set(_records(sources[s])) for s in corpus.SPLITS)
  assert train and valid and not train & valid
  assert valid == {p for p in texts if corpus.split_of(p) == "validation"}
  real = corpus.list_sources(corpus.stdlib_root())
  assert len(real) > 500 and not any({"test", "tests", "site-packages"} & set(p.split(os.sep)) for p in real)


def test_second_build_reuses(built, monkeypatch, caplog):
  caplog.set_level(logging.INFO)
  src, _, data_dir, _ = built
  files = glob.glob(os.path.join(data_dir, "*", "stdlib_code", "1.0.0", "*"))
  mtimes = {f: os.path.getmtime(f) for f in files}

  def fail(*args, **kwargs):
    raise AssertionError("rebuilt")

  monkeypatch.setattr(corpus.StdlibCode, "_generate_examples", fail)
  sources = corpus.build_corpus(data_dir, src_dir=src)
  assert "reusing" in caplog.text
  assert files and {f: os.path.getmtime(f) for f in files} == mtimes
  assert len(sources["train"]) + len(sources["validation"]) > 0


def test_a_changed_source_builds_a_new_corpus(tmp_path):
  """The same workdir with another src_dir, or an edited file, must not reuse the old corpus."""
  a, b = tmp_path / "a", tmp_path / "b"
  texts = _fake_source(str(a))
  shutil.copytree(a, b)
  (b / "extra_module.py").write_text("x = 1\n")
  data_dir = str(tmp_path / "tfds")
  first = corpus.build_corpus(data_dir, src_dir=str(a))
  second = corpus.build_corpus(data_dir, src_dir=str(b))
  paths = lambda srcs: {srcs[s][i]["path"].decode() for s in corpus.SPLITS for i in range(len(srcs[s]))}  # noqa: E731
  assert paths(first) == set(texts) and paths(second) == set(texts) | {"extra_module.py"}
  assert len(os.listdir(data_dir)) == 2
  before = corpus.source_key(str(b), None)
  (b / "extra_module.py").write_text("x = 22\n")  # an edit (size changes) changes the key
  assert corpus.source_key(str(b), None) != before


def test_a_directory_too_small_for_both_splits_is_one_clear_error(tmp_path):
  from composer_jax.configs import ConfigError

  (tmp_path / "only.py").write_text("x = 1\n")
  with pytest.raises(ConfigError, match="split got none") as e:
    corpus.build_corpus(str(tmp_path / "tfds"), src_dir=str(tmp_path))
  assert "\n" not in str(e.value) and not (tmp_path / "tfds").exists()
  with pytest.raises(ConfigError, match="is not a directory"):
    corpus.build_corpus(str(tmp_path / "tfds"), src_dir=str(tmp_path / "nope"))


@pytest.fixture(scope="module")
def stdlib_sample():
  root = corpus.stdlib_root()
  rels = corpus.list_sources(root)[::40]
  return [t for t in (corpus.read_source(root, r) for r in rels) if t is not None]


@pytest.fixture(scope="module", params=["byte", "bpe"])
def tok(request):
  return tokenizer.load(request.param)


def test_round_trip_exact(tok, stdlib_sample):
  assert isinstance(tok, tokenizer.Tokenizer)
  for text in (*ODD_TEXTS, *stdlib_sample):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_are_single_ids_never_from_text(tok, stdlib_sample):
  ids = {s: tok.special_id(s) for s in tokenizer.SPECIAL_TOKENS}
  assert len(set(ids.values())) == len(ids)
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (ids["<|pad|>"], ids["<|bos|>"], ids["<|eos|>"])
  special = set(ids.values())
  for s, i in ids.items():
    assert 0 <= i < tok.vocab_size and tok.decode([i]) == s
    assert len(tok.encode(s)) > 1 and not special & set(tok.encode(s))
  for text in (*ODD_TEXTS, *stdlib_sample):
    assert not special & set(tok.encode(text))
  turn = tok.encode("x = 1") + [ids["<|end_turn|>"]]
  assert tok.decode(turn) == "x = 1<|end_turn|>"


def test_bpe_shape():
  bpe = tokenizer.load("bpe")
  assert bpe.vocab_size == tokenizer.BPE_VOCAB_SIZE
  assert tokenizer.ByteTokenizer().vocab_size == 256 + len(tokenizer.SPECIAL_TOKENS)
  code = "import os\n\ndef main():\n  return os.path.join('a', 'b')\n"
  assert len(code.encode()) / len(bpe.encode(code)) > 2.5


def _check_rows(batch, seq_len):
  """Per-row invariants; returns the row pieces (token arrays) in order."""
  pieces = []
  for tokens_T, seg_T, pos_T in zip(batch["tokens"], batch["segment_ids"], batch["positions"], strict=True):
    assert tokens_T.shape == (seq_len,) and tokens_T.dtype == np.int32
    n = int((seg_T > 0).sum())
    assert (seg_T[:n] > 0).all() and (seg_T[n:] == 0).all()  # padding only at the end
    assert (pos_T[n:] == 0).all()
    for s in range(1, int(seg_T.max(initial=0)) + 1):
      (idx,) = np.nonzero(seg_T == s)
      assert idx.size and (np.diff(idx) == 1).all()  # segments are contiguous, numbered 1, 2, ...
      assert (pos_T[idx] == np.arange(idx.size)).all()  # positions restart per document piece
      pieces.append(tokens_T[idx])
  return pieces


@pytest.mark.parametrize("seq_len,min_fragment", [(64, None), (48, 1), (1000, None)])
def test_packing_loses_nothing(built, seq_len, min_fragment):
  """One epoch: row r's pieces, in order, are documents r, r + B, ... of the shuffled order, each with
  its EOS; every document lands in exactly one row."""
  byte, B = tokenizer.ByteTokenizer(), 3
  source = built[3]["train"]
  it = corpus.batches(
    source, byte, batch_size=B, seq_len=seq_len, seed=5, num_epochs=1, min_fragment=min_fragment
  )
  rows = [[] for _ in range(B)]
  for batch in it:
    for r in range(B):
      rows[r] += _check_rows({k: v[r : r + 1] for k, v in batch.items()}, seq_len)
  docs = corpus.documents(source, seed=5)
  for r in range(B):
    expected = [byte.encode(docs[i]) + [byte.eos_id] for i in range(r, len(source), B)]
    np.testing.assert_array_equal(np.concatenate(rows[r]), np.concatenate(expected))
  assert sum((np.concatenate(p) == byte.eos_id).sum() for p in rows) == len(source)


def test_padding_is_bounded_by_min_fragment(built):
  it = corpus.batches(built[3]["train"], tokenizer.ByteTokenizer(), batch_size=4, seq_len=64, seed=0)
  for _ in range(10):
    seg_BT = next(it)["segment_ids"]
    assert ((seg_BT == 0).sum(axis=1) < 64 // 8).all()


@pytest.mark.parametrize("name,prefetch", [("byte", 0), ("bpe", 0), ("bpe", 2)])
def test_resume_yields_identical_batches(built, name, prefetch):
  tok = tokenizer.load(name)
  source = built[3]["train"]

  def make():
    return corpus.batches(source, tok, batch_size=2, seq_len=96, seed=3, prefetch=prefetch)

  it = make()
  for _ in range(7):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  expected = []
  while min(it.get_state()["index"]) <= len(source) + 2:  # every row past an epoch boundary (a reshuffle)
    expected.append(next(it))
  resumed = make()
  resumed.set_state(state)
  for want, got in zip(expected, (next(resumed) for _ in expected), strict=True):
    for key in ("tokens", "segment_ids", "positions"):
      np.testing.assert_array_equal(got[key], want[key])
  it.close()
  resumed.close()
