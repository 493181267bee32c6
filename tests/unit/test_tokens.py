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


def test_batch_check_skips_the_padding_maxtext_marks_and_sees_a_narrow_negative_id():
  """Segmentation 0 marks the pad id (-1) of a short row, -1 the padding rows of a partial last batch: no token
  id. An int8 -1 viewed unsigned is 255, inside a vocabulary of 256: it must still be refused."""
  check = tokens.BatchCheck(Config())
  ids = np.arange(2 * 8, dtype=np.int32).reshape(2, 8)
  segmentation = np.ones_like(ids)
  ids[1, :], segmentation[1, :] = -1, -1  # a padding row
  ids[0, 6:], segmentation[0, 6:] = -1, 0  # a short row's padding
  check(ids, step=3, segmentation=segmentation)
  segmentation[1, 2] = 1
  with pytest.raises(tokens.TokenError, match=r"holds token id -1 \(sequence 1, position 2 of this host's batch\)"):
    check(ids, step=3, segmentation=segmentation)
  narrow = np.zeros((2, 4), dtype=np.int8)
  narrow[0, 1] = -1
  with pytest.raises(tokens.TokenError, match=r"holds token id -1 \(sequence 0, position 1"):
    check(narrow)


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


def test_a_partial_last_batch_passes_the_check_and_then_the_data_runs_out(tmp_path):
  """12 rows in batches of 8: MaxText pads the second batch with 4 rows of its pad id (-1, segmentation -1),
  which is no token id; the next batch is the end of the data (the run's out-of-data line)."""
  path = write(tmp_path / "twelve.parquet", data.markov_tokens(12, 65, 256))
  config = maxtext_config(f"grain_train_files={path}", "per_device_batch_size=8")
  import jax  # pylint: disable=import-outside-toplevel
  from maxtext.input_pipeline import input_pipeline_interface  # pylint: disable=import-outside-toplevel

  from temoe.maxtext import batches, introspect  # pylint: disable=import-outside-toplevel

  batches.install(config)
  mesh = jax.sharding.Mesh(introspect.device_mesh(config), config.mesh_axes)
  iterator = input_pipeline_interface.create_data_iterator(config, mesh)[0]
  next(iterator)
  partial = next(iterator)
  assert (np.asarray(partial["inputs_segmentation"])[4:] <= 0).all()  # the padding rows (grain pads with -1)
  assert (np.asarray(partial["inputs"])[4:] == -1).all()
  with pytest.raises(StopIteration):
    next(iterator)
  assert batches.check().batches == 2


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
  with pytest.raises(tokens.TokenError, match=r"row 0 \(0-based\) holds 65 token ids, more than max_target_length=64: "
                                              "grain's first_fit packing"):
    tokens.check(maxtext_config(f"grain_train_files={path}", "packing=true"))  # rows of 65: fails in MaxText
  tokens.check(maxtext_config(f"grain_train_files={path}", "packing=true", "grain_packing_type=concat_then_split"))
  fitting = write(tmp_path / "fitting.parquet", [row[:64] for row in rows])
  tokens.check(maxtext_config(f"grain_train_files={fitting}", "packing=true"))


def test_rows_longer_than_a_sequence_are_reported_once_as_maxtext_cuts_them(tmp_path):
  rows = [list(row) for row in data.markov_tokens(8, 65, 256)]  # 65: the next-token layout, not reported
  rows[5] = rows[5] + rows[6][:29]
  path = write(tmp_path / "long.parquet", rows)
  config = maxtext_config(f"grain_train_files={path}")
  tokens.check(config)
  assert tokens.long_rows_note(config) == (
      f"temoe: note: 1 of the 8 rows read hold more than max_target_length + 1 = 65 token ids (the longest 94; the first: "
      f"{path} row 5); with packing=false MaxText cuts each to its first 64 ids and trains on none of the rest; pass "
      "packing=true grain_packing_type=concat_then_split to split them instead, or a larger max_target_length.")
  split = maxtext_config(f"grain_train_files={path}", "packing=true", "grain_packing_type=concat_then_split")
  tokens.check(split)
  assert tokens.long_rows_note(split) is None
