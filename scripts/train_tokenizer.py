"""Regenerate the shipped byte-level BPE (composer_jax/data/bpe_4096.json) from the stdlib corpus.

Command (from the repo root; ~5 s on 2 CPUs):

  .venv/bin/python scripts/train_tokenizer.py

Trains on the corpus' train split only (same file list and by-file split as `data.corpus`), so the
reported bytes/token on validation is held out. The vocabulary depends on the Python whose stdlib it
reads: the shipped file was trained on CPython 3.11.7. `--out` writes elsewhere.
"""

import argparse
import sys
import time

from composer_jax.data import corpus, tokenizer


def bytes_per_token(tok: tokenizer.BPETokenizer, texts: list[str]) -> float:
  n_bytes = sum(len(t.encode("utf-8")) for t in texts)
  n_tokens = sum(len(ids) for ids in tok.encode_batch(texts))
  return n_bytes / n_tokens


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default=tokenizer.shipped_bpe_path())
  parser.add_argument("--vocab_size", type=int, default=tokenizer.BPE_VOCAB_SIZE)
  args = parser.parse_args(argv)

  root = corpus.stdlib_root()
  train = [text for _, text in corpus.iter_split(root, "train")]
  valid = [text for _, text in corpus.iter_split(root, "validation")]
  print(
    f"training BPE {args.vocab_size} on {len(train)} files "
    f"({sum(map(len, train)) / 1e6:.1f} M chars) from {root}"
  )
  t0 = time.perf_counter()
  tok, trainer = tokenizer.new_bpe_trainer_tokenizer(args.vocab_size)
  tok.train_from_iterator(train, trainer, length=len(train))
  tok.save(args.out)
  print(f"trained in {time.perf_counter() - t0:.1f} s -> {args.out}")

  bpe = tokenizer.BPETokenizer.from_file(args.out)
  bad = [i for i, t in enumerate(valid) if bpe.decode(bpe.encode(t)) != t]
  print(
    f"vocab {bpe.vocab_size}; validation ({len(valid)} files): "
    f"{bytes_per_token(bpe, valid):.2f} bytes/token, "
    f"round-trip failures {len(bad)}"
  )


if __name__ == "__main__":
  main(sys.argv[1:])
