"""Preparing a tfds builder without tfds's console output (the corpus and the synthetic tasks).

tfds talks for itself while it builds: `print`s to stdout ("Downloading and preparing dataset ...",
"... downloaded and prepared to ..."), tqdm bars to stderr, and a warning whenever `is_prepared` looks at a
folder that has no `dataset_info.json` yet, which is every first build. Our builds take seconds and the
caller logs its own line, so none of that reaches the console: bars are off, prints are swallowed, and
`prepared` answers for a missing folder itself instead of asking tfds.
"""

from __future__ import annotations

import contextlib
import io
import os

import tensorflow_datasets as tfds

INFO_FILE = "dataset_info.json"  # tfds writes it last, once a version folder is complete


def prepared(builder: tfds.core.DatasetBuilder) -> bool:
  """Whether the builder's version folder holds a finished build (tfds's check, asked only where
  `dataset_info.json` exists: for a folder without it tfds would warn before saying no)."""
  info = os.path.join(os.fspath(builder.data_dir), INFO_FILE)
  return os.path.isfile(info) and builder.is_prepared()


def prepare(builder: tfds.core.DatasetBuilder) -> None:
  """`download_and_prepare` with tfds's bars off and its stdout prints swallowed.

  The bars stay off afterwards: tfds offers no way to read the setting back, and nothing in this
  package wants them."""
  tfds.disable_progress_bar()
  with contextlib.redirect_stdout(io.StringIO()):
    builder.download_and_prepare()
