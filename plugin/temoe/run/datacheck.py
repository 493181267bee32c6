"""Opens a run's training data before MaxText compiles: every file found, its first records read.

MaxText's Grain pipeline opens files only when the first batch is drawn, after the model is
built and compiled, and turns any read error into a "Training stopped" INFO line. Here the same
glob (`grain_train_files`, `;`-separated mixtures with `,weight`) is resolved, each Parquet file's
footer and first row read with PyArrow, and the train columns looked up. Remote paths (gs://,
hf://) are left to MaxText.
"""

from __future__ import annotations

import glob
import os
import pathlib

from temoe import recipes


class DataError(recipes.TemoeConfigError):
  """Training data MaxText could not read."""


def patterns(grain_train_files: str) -> list[str]:
  """The file patterns of `grain_train_files` (a mixture is `pattern,weight;pattern,weight`)."""
  if ";" in grain_train_files:
    return [part.rsplit(",", 1)[0] for part in grain_train_files.split(";") if part]
  return [grain_train_files]


def local_files(pattern: str) -> list[str]:
  """What MaxText's find_data_files matches for a local pattern (user-expanded, absolute)."""
  return sorted(glob.glob(str(pathlib.Path(pattern).expanduser().resolve())))


def check(config) -> int:
  """Checks the run's Grain training files; returns the rows found (0 when not counted)."""
  if config.dataset_type != "grain" or not config.grain_train_files:
    return 0
  rows = 0
  for pattern in patterns(config.grain_train_files):
    if "://" in pattern:
      continue
    files = local_files(pattern)
    if not files:
      raise DataError(f"grain_train_files={pattern} matches no file; pass a path or glob of the training data.")
    for path in files:
      rows += check_file(path, config.grain_file_type, list(config.train_data_columns or []))
  if rows == 0 and config.grain_file_type == "parquet":
    raise DataError(f"grain_train_files={config.grain_train_files} holds no rows.")
  return rows


def check_file(path: str, file_type: str, columns: list[str]) -> int:
  """One data file: readable as `file_type`, with its columns; returns its rows (Parquet)."""
  if os.path.isdir(path):
    raise DataError(f"grain_train_files: {path} is a directory; pass the files in it (e.g. {path}/*.{file_type}).")
  size = os.path.getsize(path)
  if size == 0:
    raise DataError(f"grain_train_files: {path} is empty (0 bytes).")
  if file_type != "parquet":
    with open(path, "rb") as f:
      f.read(1)
    return 0
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

  try:
    parquet = pq.ParquetFile(path)
    missing = [c for c in columns if c not in parquet.schema_arrow.names]
    if missing:
      raise DataError(
          f"grain_train_files: {path} has no column {', '.join(missing)} (train_data_columns); "
          f"its columns: {', '.join(parquet.schema_arrow.names)}."
      )
    if parquet.metadata.num_rows:
      next(parquet.iter_batches(batch_size=1, columns=columns or None))
  except DataError:
    raise
  except Exception as exc:  # pylint: disable=broad-exception-caught
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    raise DataError(
        f"grain_train_files: {path} is not a readable Parquet file ({type(exc).__name__}: {text}); "
        "rewrite it, or remove it from the pattern."
    ) from exc
  return parquet.metadata.num_rows
