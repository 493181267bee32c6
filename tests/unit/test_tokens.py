"""Token ids checked to the token (`temoe.run.tokens`): the batch check on host arrays and inside MaxText's
own data pipeline, and the preflight's scan past its budget (footer statistics). The preflight's line
for each kind of bad data is a row of test_cli_errors.py's table."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import maxtext_config
from temoe.run import data, tokens


class Config:  # what BatchCheck reads of a MaxText config
  vocab_size = 256
  dataset_type = "synthetic"


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint32])
def test_batch_check_passes_ids_in_range_and_stops_the_first_outside(dtype):
  check = tokens.BatchCheck(Config())
  ids = np.arange(2 * 64, dtype=dtype).reshape(2, 64) % 256
  check(ids)
  for bad in (256, 2**31 - 1, -1, -(2**31)):
    if np.dtype(dtype).kind == "u" and bad < 0:
      continue
    wrong = ids.copy()
    wrong[1, 17] = bad
    with pytest.raises(tokens.TokenError, match=rf"holds token id {bad} \(sequence 1, position 17 of this host's batch\), "
                                                r"outside \[0, vocab_size=256\)"):
      check(wrong, step=5)
  assert check.batches == 1 + (2 if np.dtype(dtype).kind == "u" else 4) and check.seconds > 0


def test_batch_check_refuses_float_ids():
  with pytest.raises(tokens.TokenError, match="holds token id 1.5"):
    tokens.BatchCheck(Config())(np.full((2, 4), 1.5))


def write(path, rows) -> str:
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

  pq.write_table(pa.table({"tokens": pa.array([list(map(int, r)) for r in rows], type=pa.list_(pa.int32()))}),
                 path, row_group_size=64)
  return str(path)


def test_a_bad_batch_stops_in_maxtexts_own_pipeline_naming_the_file_row(tmp_path):
  """The seam (multihost_dataloading._form_global_array) with MaxText's real Grain iterator: the first
  batch holds row 3's id 300; the line names the batch, then the file and row that hold it."""
  rows = data.markov_tokens(16, 65, 256)
  rows[3, 10] = 300
  path = write(tmp_path / "bad.parquet", rows)
  config = maxtext_config(f"grain_train_files={path}", "per_device_batch_size=8")
  from maxtext.input_pipeline import input_pipeline_interface  # pylint: disable=import-outside-toplevel

  from temoe.maxtext import batches, introspect  # pylint: disable=import-outside-toplevel

  def first_batch(config):
    import jax  # pylint: disable=import-outside-toplevel

    batches.install(config)
    mesh = jax.sharding.Mesh(introspect.device_mesh(config), config.mesh_axes)
    return next(input_pipeline_interface.create_data_iterator(config, mesh)[0])

  with pytest.raises(tokens.TokenError) as info:
    first_batch(config)
  assert str(info.value) == (
      f"a training batch holds token id 300 (sequence 3, position 10 of this host's batch), outside "
      f"[0, vocab_size=256); grain_train_files: {path} row 3 (0-based) holds token id 300 at position 10, outside "
      "[0, vocab_size=256) (data made for another vocabulary?)")
  good = write(tmp_path / "good.parquet", data.markov_tokens(16, 65, 256))
  batch = first_batch(maxtext_config(f"grain_train_files={good}", "per_device_batch_size=8"))
  assert batch["inputs"].shape == (8, 64) and batches.check().batches == 1


def test_past_its_budget_the_scan_reads_only_row_groups_whose_statistics_condemn_them(tmp_path):
  rows = [list(row) for row in data.markov_tokens(64 * 8, 65, 256)]
  rows[64 * 6 + 5][2] = 999  # row group 6 of 8
  rows[64 * 7 + 1] = rows[64 * 7 + 1][:3]  # a short row in row group 7
  path = write(tmp_path / "late.parquet", rows)
  config = maxtext_config(f"grain_train_files={path}")
  with pytest.raises(tokens.TokenError, match=rf"{path} row {64 * 6 + 5} \(0-based\) holds token id 999 at position 2"):
    tokens.check(config, budget=65 * 64)  # one row group read in full, the rest by statistics
  rows[64 * 6 + 5][2] = 7
  write(tmp_path / "late.parquet", rows)
  tokens.check(config, budget=65 * 64)  # statistics pass every later row group: not read
  with pytest.raises(tokens.TokenError, match=r"holds 3 token ids, fewer than max_target_length=64"):
    tokens.check(config)  # read in full: row 449's length is seen (no statistics hold it)


def test_short_rows_pass_when_packed_or_allowed(tmp_path):
  rows = [list(row) for row in data.markov_tokens(8, 65, 256)]
  rows[2] = rows[2][:5]
  path = write(tmp_path / "short.parquet", rows)
  with pytest.raises(tokens.TokenError, match=r"row 2 \(0-based\) holds 5 token ids, fewer than max_target_length=64"):
    tokens.check(maxtext_config(f"grain_train_files={path}"))
  tokens.check(maxtext_config(f"grain_train_files={path}", "te_allow_short_rows=true"))
  tokens.check(maxtext_config(f"grain_train_files={path}", "packing=true"))
