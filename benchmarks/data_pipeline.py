"""Data per host, off the training thread (issue 31): host packing tokens/s, and the step time the
prefetching worker hides.

  python benchmarks/data_pipeline.py                          # both parts (~12 min on 2 shared cores)
  python benchmarks/data_pipeline.py --steps 0                # packing only
  python benchmarks/data_pipeline.py --out benchmarks/results/data_pipeline.json

Packing: the stdlib train split (read from the files, no tfds build) through `corpus.batches` with the
shipped BPE (composer_jax/data/bpe_4096.json), global batch B=64 × T=4096. One host packs all 64 rows;
one host of 4 packs its 16 rows, one of 16 its 4 rows (rows 0.. of each: per-row streams, so any host's
share costs the same per row). Per host: real (non-padding) tokens/s, and seconds per global batch (the
time a host needs for its share of one batch). Also the single-stream packer this replaced
(`--baseline_rev`, read from git) on the whole batch. Each side: one warm-up batch, then `--batches`
batches; `--rounds` rounds alternate the sides, the median round is reported.

Loop: the tiny pretraining stage (experiments/composer25.py: 8 × 128 tokens, 8 CPU devices), as shipped
(byte tokenizer) and with the shipped BPE (model.vocab_size=4096), each with data.prefetch=0 and 2, for
`--steps` steps, no evaluation or checkpoint inside the steps; `--loop_rounds` rounds alternate the four
sides, medians reported. Per side: the wall time per step after the compiling first step
(`seconds_per_step`), and the time the training thread spent in `next()` of the data iterator per step
(the packing the worker takes off it).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)  # the tiny variant's meshes; before any backend starts
jax.config.update("jax_compilation_cache_dir", str(ROOT / ".jax_cache"))

from benchmarks.machine import describe as machine  # noqa: E402
from composer_jax.data import corpus, tokenizer  # noqa: E402

B, T = 64, 4096


def _source() -> list[dict]:
  return [{"text": text.encode()} for _, text in corpus.iter_split(corpus.stdlib_root(), "train")]


def _baseline_batches(rev: str):
  """The single-stream `corpus.batches` of git revision `rev` (None when git cannot show it)."""
  try:
    text = subprocess.run(
      ["git", "show", f"{rev}:composer_jax/data/corpus.py"],
      cwd=ROOT,
      capture_output=True,
      text=True,
      check=True,
    ).stdout
  except (OSError, subprocess.CalledProcessError):
    return None
  # Its imports and its pipeline only: its tfds builder would register a second "stdlib_code".
  imports, pipeline = text[: text.index("EXCLUDED_DIRS")], text[text.index("def documents(") :]
  path = pathlib.Path(tempfile.mkdtemp()) / "corpus_baseline.py"
  path.write_text(imports + pipeline)
  spec = importlib.util.spec_from_file_location("corpus_baseline", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.batches


class _Counting:
  """A tokenizer that counts the tokens it produced (a row's document is tokenized whole when the row
  reaches it, so over a few batches more is tokenized than packed: the rest serves later batches)."""

  def __init__(self, tok):
    self._tok, self.eos_id, self.pad_id, self.count = tok, tok.eos_id, tok.pad_id, 0

  def encode(self, text: str) -> list[int]:
    ids = self._tok.encode(text)
    self.count += len(ids)
    return ids


def _time_packing(make, n: int) -> tuple[float, int, int]:
  """(seconds for `n` batches after one warm-up batch, real tokens packed, tokens tokenized in them)."""
  tok = _Counting(tokenizer.load("bpe"))
  it = make(tok)
  next(it)
  t0, tokens, before = time.perf_counter(), 0, tok.count
  for _ in range(n):
    tokens += int((next(it)["segment_ids"] > 0).sum())
  return time.perf_counter() - t0, tokens, tok.count - before


def packing(batches: int, rounds: int, baseline_rev: str | None) -> dict:
  source = _source()
  shape = dict(batch_size=B, seq_len=T, seed=0)
  sides = {
    f"{hosts} host{'s' if hosts > 1 else ''}": (
      hosts,
      lambda tok, rows=tuple(range(B // hosts)): corpus.batches(source, tok, **shape, rows=rows),
    )
    for hosts in (1, 4, 16)
  }
  old = _baseline_batches(baseline_rev) if baseline_rev else None
  if old is not None:
    sides[f"1 host, single stream ({baseline_rev})"] = (1, lambda tok: old(source, tok, **shape))
  runs = {name: [] for name in sides}
  for _ in range(rounds):
    for name, (_, make) in sides.items():
      runs[name].append(_time_packing(make, batches))
  out = {}
  for name, (hosts, _) in sides.items():
    seconds, tokens, tokenized = sorted(runs[name])[len(runs[name]) // 2]
    out[name] = dict(
      hosts=hosts,
      rows_per_host=B // hosts,
      tokens_per_s_per_host=tokens / seconds,
      seconds_per_global_batch_per_host=seconds / batches,
      tokenized_per_packed=tokenized / tokens,
      padding_fraction=1 - tokens / (batches * T * B // hosts),
      all_rounds_seconds=[r[0] for r in runs[name]],
    )
  return out


class _Timed:
  """A data iterator whose `next()` time (in the training thread) is summed."""

  def __init__(self, it, record: list):
    self._it, self._record = it, record

  def __next__(self):
    t0 = time.perf_counter()
    try:
      return next(self._it)
    finally:
      self._record.append(time.perf_counter() - t0)

  def __getattr__(self, name):
    return getattr(self._it, name)


# The loop's sides: the tiny variant as shipped (byte tokenizer), and with the shipped BPE (its 4,096 ids
# need a 4,096-row vocabulary): packing costs more per token there, so there is more to take off the step.
LOOP_DATA = {
  "byte": {},
  "bpe": dict(tokenizer="bpe", vocab_size=4096),
}


def _tiny_config(steps: int, prefetch: int, tokenizer: str = "byte", vocab_size: int | None = None):
  from composer_jax import configs

  path = ROOT / "experiments" / "composer25.py"
  spec = importlib.util.spec_from_file_location("composer25", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cd = module.get_config("tiny")
  cd.stages = "pretrain"
  cd.train.schedule.update(steps=steps, eval_every=0, checkpoint_every=0, log_every=steps)
  cd.data.update(prefetch=prefetch, tokenizer=tokenizer)
  if vocab_size:
    cd.model.vocab_size = vocab_size
  return configs.from_config(cd)


def loop(steps: int, rounds: int) -> dict:
  from composer_jax.stages import pretrain

  real_batches, waits = corpus.batches, []

  def timed_batches(*args, **kwargs):
    it = real_batches(*args, **kwargs)
    return it if kwargs.get("num_epochs") else _Timed(it, waits)

  corpus.batches = timed_batches
  shared = pathlib.Path(tempfile.mkdtemp(prefix="data_pipeline_"))
  (shared / "tfds").mkdir()  # one corpus build for every run
  sides = [(data, prefetch) for data in LOOP_DATA for prefetch in (0, 2)]
  runs = {side: [] for side in sides}
  try:
    for r in range(rounds):
      for data, prefetch in sides:
        workdir = shared / f"{data}_prefetch{prefetch}_round{r}"
        workdir.mkdir()
        (workdir / "tfds").symlink_to(shared / "tfds", target_is_directory=True)
        waits.clear()
        summary = pretrain.run(_tiny_config(steps, prefetch, **LOOP_DATA[data]), str(workdir))
        runs[(data, prefetch)].append((summary["seconds_per_step"], statistics.fmean(waits[1:])))
  finally:
    corpus.batches = real_batches
  out = {}
  for (data, prefetch), values in runs.items():
    out[f"{data}, prefetch {prefetch}"] = dict(
      seconds_per_step=statistics.median(v[0] for v in values),
      next_batch_seconds_per_step=statistics.median(v[1] for v in values),
      all_rounds_seconds_per_step=[v[0] for v in values],
      all_rounds_next_batch_seconds=[v[1] for v in values],
    )
  return out


def _relative(path: str) -> str:
  """`path` relative to the repository (no machine paths in the results)."""
  p = pathlib.Path(path).resolve()
  return p.relative_to(ROOT).as_posix() if p.is_relative_to(ROOT) else p.name


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--batches", type=int, default=12)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument(
    "--baseline_rev", default="c1deedc", help="git revision of the single-stream packer; '' skips"
  )
  p.add_argument("--steps", type=int, default=16, help="tiny pretraining steps per run; 0 skips the loop")
  p.add_argument("--loop_rounds", type=int, default=3)
  p.add_argument("--out", default="")
  a = p.parse_args()
  result = dict(
    date=datetime.date.today().isoformat(),
    machine=machine(),
    command="python " + " ".join([_relative(sys.argv[0]), *sys.argv[1:]]),
    shape=dict(batch_size=B, seq_len=T, tokenizer="bpe_4096"),
    packing=packing(a.batches, a.rounds, a.baseline_rev or None),
  )
  print(json.dumps(result["packing"], indent=1), flush=True)
  if a.steps:
    result["loop"] = dict(steps=a.steps, rounds=a.loop_rounds, **loop(a.steps, a.loop_rounds))
    print(json.dumps(result["loop"], indent=1), flush=True)
  if a.out:
    pathlib.Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
  main()
