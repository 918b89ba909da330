"""A first build of the synthetic-task dataset and of the corpus says nothing on the console but our own
lines: no tfds warning, print or progress bar (the first run shows whatever these builds emit)."""

import logging

import pytest
import tensorflow_datasets as tfds
from test_synth_dataset import RECORDS

from composer_jax.data import corpus
from composer_jax.synth import dataset

_TFDS_NOISE = (
  "dataset_info.json",
  "Using custom data configuration",
  "Downloading and preparing dataset",
  "downloaded and prepared",
  "Generating splits",
  "examples/s",
)


def _noise(text: str) -> list[str]:
  return [line for line in text.splitlines() if any(n in line for n in _TFDS_NOISE)]


@pytest.fixture
def console(capfd, caplog):
  """Everything a build writes: stdout and stderr at the file-descriptor level, and every log record."""
  tfds.enable_progress_bar()  # as in a fresh process: another test may have turned the bars off
  caplog.set_level(logging.DEBUG)

  def read() -> tuple[str, list[logging.LogRecord]]:
    out, err = capfd.readouterr()
    return out + err, list(caplog.records)

  return read


def _check(text: str, records: list[logging.LogRecord]) -> None:
  assert not _noise(text), _noise(text)
  loud = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
  assert not loud, loud
  assert not _noise("\n".join(r.getMessage() for r in records))


def test_synth_tasks_build_and_read_quietly(tmp_path, console):
  dataset.write_tasks(RECORDS, tmp_path)
  assert dataset.read_tasks(tmp_path) == RECORDS
  dataset.write_tasks(RECORDS, tmp_path)  # the reuse path too
  _check(*console())


def test_corpus_builds_and_reopens_quietly(tmp_path, console):
  src = tmp_path / "src"
  src.mkdir()
  for i in range(200):  # enough files that both splits get some
    (src / f"m{i}.py").write_text(f"x = {i}\n")
  built = corpus.build_corpus(str(tmp_path / "tfds"), src_dir=str(src))
  again = corpus.build_corpus(str(tmp_path / "tfds"), src_dir=str(src))
  assert len(built["train"]) == len(again["train"]) > 0
  _check(*console())


def test_the_check_sees_tfds_noise(tmp_path, console):
  """The check can fail: tfds's own `is_prepared` on a fresh folder warns, and its build prints."""
  builder = corpus.StdlibCode(
    src_dir=str(tmp_path), data_dir=str(tmp_path / "tfds"), file_format="array_record"
  )
  assert not builder.is_prepared()
  print("Downloading and preparing dataset Unknown size ...")
  text, records = console()
  with pytest.raises(AssertionError):
    _check(text, records)
  assert any("dataset_info.json" in r.getMessage() for r in records)
