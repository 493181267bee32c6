"""Token ids checked to the token: before compiling, over the data files, and on every batch.

JAX's gather clamps an out-of-range index, so MaxText trains without a word on ids >= vocab_size
(data made for a larger vocabulary), negative ids, int64 ids its int32 batches cut to their low
bits, float tokens, nulls and rows far shorter than the sequence it pads them to. Here:

- `check(config)`, in preflight: every local Parquet file of a pre-tokenized Grain run
  (tokenize_train_data=false), its column's type from the schema, then, by Arrow compute over
  each record batch (no Python loop over tokens), its nulls, min/max against [0, vocab_size),
  int64 values that do not fit int32, unsigned ids (MaxText pads with -1), and row lengths against
  max_target_length (with packing=false MaxText pads short rows, `te_allow_short_rows=true` accepts that,
  and cuts long ones, which `long_rows_note` reports once; grain's first_fit and best_fit packing fail on a
  long row, which is refused). Up to
  `SCAN_TOKENS` tokens are read; beyond that the row groups' footer statistics are checked and
  the rest is left to the batch check. The error names the file, the row and the value.
- `BatchCheck`: every host batch's `inputs` on their way to the devices, by one reduction
  (the ids viewed as unsigned, so a negative one is a huge one) over the positions that hold data
  (MaxText's segmentation > 0: its pad id in short rows and a partial last batch is no id); on a bad batch the files are
  scanned for the row that holds it and the same line is printed.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from temoe import recipes
from temoe.run import datacheck

SCAN_TOKENS = 1 << 28
"""Tokens preflight reads in full (1 GiB of int32 ids, a few seconds); later row groups are checked by
their footer statistics and, batch by batch, by `BatchCheck`."""

INT32 = (-(1 << 31), (1 << 31) - 1)

PACKERS_REFUSING_LONG = ("first_fit", "best_fit")
"""MaxText 0.2.5's grain packings that raise on a row longer than max_target_length (concat_then_split splits it)."""


class TokenError(recipes.TemoeConfigError):
  """Token data MaxText would train on without a word, and learn nothing from."""


@dataclasses.dataclass(frozen=True)
class Rules:
  """What a row of token ids must satisfy."""

  vocab_size: int
  min_length: int  # 0: any length (packing, or te_allow_short_rows)
  max_length: int = 0  # rows longer than this are counted (`LONG`); 0: not counted
  packer: str = ""  # grain's first_fit / best_fit packing: a row longer than max_length fails MaxText at step 0

  @classmethod
  def of(cls, config) -> Rules:
    short_ok = config.packing or getattr(config, "te_allow_short_rows", False)
    packer = config.grain_packing_type if config.packing and config.grain_packing_type in PACKERS_REFUSING_LONG else ""
    return cls(int(config.vocab_size), 0 if short_ok else int(config.max_target_length), int(config.max_target_length),
               packer)

  def too_long(self, length: int) -> str:
    return (f"holds {length} token ids, more than max_target_length={self.max_length}: grain's {self.packer} packing, "
            "which packing=true uses here, refuses a row longer than a sequence (MaxText would fail at step 0); pass "
            "grain_packing_type=concat_then_split to split long rows, or a larger max_target_length")

  def too_short(self, length: int) -> str:
    return (f"holds {length} token ids, fewer than max_target_length={self.min_length}: with packing=false MaxText "
            f"pads each row to that length with the pad id (masked from the loss), {1 - length / self.min_length:.0%} "
            "of this one; pass packing=true to pack short rows, or te_allow_short_rows=true to train on them padded")


def applies(config) -> bool:
  return (config.dataset_type == "grain" and config.grain_file_type == "parquet" and bool(config.grain_train_files)
          and not config.tokenize_train_data and len(config.train_data_columns or []) == 1)


LONG: dict = {}
"""Rows longer than max_target_length the last `check` read: rows, scanned (rows read), longest, first (path, row)."""


def check(config, budget: int = SCAN_TOKENS, rules: Rules | None = None) -> None:
  """Preflight: the token column of every local training file; raises TokenError naming file, row, value.
  Counts the rows longer than max_target_length in `LONG` (`long_rows_note` says what MaxText does with them)."""
  LONG.clear()
  LONG.update(rows=0, scanned=0, longest=0, first=None)
  if not applies(config):
    return
  rules, column = rules or Rules.of(config), config.train_data_columns[0]
  for path in training_files(config):
    budget -= scan_file(path, column, rules, budget)


def long_rows_note(config) -> str | None:
  """One line saying how MaxText 0.2.5 treats the rows longer than max_target_length the preflight found, or
  None: with packing=false it keeps each row's first max_target_length ids (`PadOrTrimToMaxLength`) and the
  rest is lost; packing=true with concat_then_split splits them (nothing lost), and with first_fit or
  best_fit grain raises on them at step 0, so the preflight refuses them (`Rules.too_long`). A row of
  max_target_length + 1 ids, the layout that holds the last position's next-token target (`temoe data`
  writes it), is not counted here, though MaxText's shift leaves its last id unused."""
  if not LONG.get("rows") or config.packing:
    return None
  path, row = LONG["first"]
  length = int(config.max_target_length)
  return (f"temoe: note: {LONG['rows']:,} of the {LONG['scanned']:,} rows read hold more than max_target_length + 1 = "
          f"{length + 1} token ids (the longest {LONG['longest']:,}; the first: {path} row {row}); with packing=false "
          f"MaxText cuts each to its first {length} ids and trains on none of the rest; pass packing=true "
          "grain_packing_type=concat_then_split to split them instead, or a larger max_target_length.")


def training_files(config) -> list[str]:
  return [p for pattern in datacheck.patterns(config.grain_train_files) if "://" not in pattern
          for p in datacheck.local_files(pattern)]


def scan_file(path: str, column: str, rules: Rules, budget: int) -> int:
  """Checks one file's column; returns the tokens read (row groups past `budget` by statistics only)."""
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

  parquet = pq.ParquetFile(path)
  check_type(path, column, parquet.schema_arrow.field(column).type)
  read, first_row = 0, 0
  meta = parquet.metadata
  leaf = next((i for i in range(meta.num_columns) if meta.schema.column(i).path.split(".")[0] == column), None)
  for group in range(meta.num_row_groups):
    rows = meta.row_group(group).num_rows
    if read >= budget and statistics_say_bad(meta.row_group(group), leaf, rules) is not True:
      first_row += rows  # past the budget: only a row group its statistics condemn is read
      continue
    for batch in parquet.iter_batches(batch_size=65536, row_groups=[group], columns=[column]):
      read += check_rows(path, batch.column(0), rules, first_row)
      first_row += len(batch)
  return read


def check_type(path: str, column: str, kind) -> None:
  """A list of signed integers per row. Unsigned ids of any width fail in MaxText's pipeline at step 0: it pads
  rows and batches with the tokenizer's pad id, -1 for MaxText's default tokenizer (an OverflowError)."""
  import pyarrow as pa  # pylint: disable=import-outside-toplevel

  if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)) \
      or not pa.types.is_integer(kind.value_type):
    raise TokenError(
        f"grain_train_files: {path} column {column} is {kind}, not a list of integer token ids per row "
        "(tokenize_train_data=false reads pre-tokenized ids); write it as list<int32>, or pass "
        "tokenize_train_data=true for a text column."
    )
  if pa.types.is_unsigned_integer(kind.value_type):
    raise TokenError(
        f"grain_train_files: {path} column {column} is {kind}: MaxText's input pipeline pads rows with the "
        "tokenizer's pad id (-1), which an unsigned integer cannot hold (it fails at step 0); write the ids as "
        "list<int32> (signed), e.g. pyarrow's table.cast."
    )


def statistics_say_bad(row_group, leaf: int | None, rules: Rules) -> bool | None:
  """Whether a row group's footer statistics show an id out of range or a null (None: no statistics)."""
  stats = row_group.column(leaf).statistics if leaf is not None else None
  if stats is None or not stats.has_min_max:
    return None
  return bool(stats.null_count) or stats.min < 0 or stats.max >= rules.vocab_size


def check_rows(path: str, rows, rules: Rules, first_row: int) -> int:
  """One record batch of the column (a list array); raises TokenError for its first bad row. Returns its ids."""
  import pyarrow.compute as pc  # pylint: disable=import-outside-toplevel

  def where(mask) -> int:
    return int(pc.index(mask, True).as_py())

  def fail(row: int, what: str) -> None:
    raise TokenError(f"grain_train_files: {path} row {first_row + row} (0-based) {what}.")

  if rows.null_count:
    fail(where(pc.is_null(rows)), "is null, not a list of token ids")
  lengths = pc.list_value_length(rows)
  if rules.max_length and LONG:
    longer = pc.greater(lengths, rules.max_length + (0 if rules.packer else 1))  # see long_rows_note
    count = int(pc.sum(longer).as_py() or 0)
    if count and rules.packer:
      row = where(longer)
      fail(row, rules.too_long(lengths[row].as_py()))
    if count and LONG["first"] is None:
      LONG["first"] = (path, first_row + where(longer))
    LONG.update(rows=LONG["rows"] + count, scanned=LONG["scanned"] + len(rows),
                longest=max(LONG["longest"], int(pc.max(lengths).as_py() or 0)))
  if rules.min_length and pc.min(lengths).as_py() < rules.min_length:
    row = where(pc.less(lengths, rules.min_length))
    fail(row, rules.too_short(lengths[row].as_py()))
  values, parents = pc.list_flatten(rows), pc.list_parent_indices(rows)
  if values.null_count:
    index = where(pc.is_null(values))
    fail(parents[index].as_py(), f"holds a null token id at position {position(parents, index)}")
  if not len(values):
    return 0
  low, high = (x.as_py() for x in pc.min_max(values).values())
  if low < INT32[0] or high > INT32[1]:
    index = where(pc.or_(pc.less(values, INT32[0]), pc.greater(values, INT32[1])))
    fail(parents[index].as_py(), f"holds token id {values[index].as_py()} at position {position(parents, index)}, "
         f"which does not fit the int32 ids MaxText's batches hold (it would be cut to its low 32 bits)")
  if low < 0 or high >= rules.vocab_size:
    index = where(pc.or_(pc.less(values, 0), pc.greater_equal(values, rules.vocab_size)))
    fail(parents[index].as_py(), f"holds token id {values[index].as_py()} at position {position(parents, index)}, "
         f"outside [0, vocab_size={rules.vocab_size}) (data made for another vocabulary?)")
  return len(values)


def position(parents, index: int) -> int:
  """The position of flattened value `index` within its row."""
  import pyarrow.compute as pc  # pylint: disable=import-outside-toplevel

  row = parents[index]
  return index - int(pc.index(parents, row).as_py())


class BatchCheck:
  """Every host batch's token ids in [0, vocab_size), checked on the host before they go to the devices.

  One reduction per batch: the ids viewed as unsigned integers of their width, so a negative id
  reads as one above any vocabulary. `seconds` and `batches` say what it cost.
  """

  def __init__(self, config):
    self.vocab_size = int(config.vocab_size)
    self.config = config
    self.seconds, self.batches = 0.0, 0

  def __call__(self, ids, step: int | None = None, segmentation=None) -> None:
    """Checks `ids`; with `segmentation` (MaxText's inputs_segmentation: 0 where a short row was padded with the
    tokenizer's pad id, and the pad id itself, -1 by default, in the rows grain's batch_and_pad adds to a partial
    last batch) only the positions that hold data (segmentation > 0)."""
    ids = np.asarray(ids)
    start = time.perf_counter()
    real = None if segmentation is None else np.asarray(segmentation) > 0
    ok = not ids.size or self.in_range(ids if real is None else ids[real])
    self.seconds += time.perf_counter() - start
    self.batches += 1
    if not ok:
      raise TokenError(self.describe(ids, step, real))

  def in_range(self, ids: np.ndarray) -> bool:
    if not ids.size:
      return True
    if ids.dtype.kind == "i":
      if ids.dtype.itemsize < 4:  # viewed unsigned, int8's -1 (255) would pass a vocabulary of 256
        ids = ids.astype(np.int32)
      return int(ids.view(ids.dtype.str.replace("i", "u")).max()) < self.vocab_size
    if ids.dtype.kind == "u":
      return int(ids.max()) < self.vocab_size
    return False  # float ids: never token ids

  def describe(self, ids: np.ndarray, step: int | None, real=None) -> str:
    """The bad batch's first bad id, then the file row that holds such an id (the preflight's line)."""
    wrong = (ids < 0) | (ids >= self.vocab_size) | (ids != np.floor(ids))
    bad = np.argwhere(wrong if real is None else wrong & real)
    seq, pos = (int(i) for i in bad[0][:2]) if len(bad) else (0, 0)
    value = ids[seq, pos].item() if ids.ndim > 1 else ids[seq].item()
    where = f"the batch of step {step}" if step is not None else "a training batch"
    line = (f"{where} holds token id {value} (sequence {seq}, position {pos} of this host's batch), outside "
            f"[0, vocab_size={self.vocab_size})")
    try:
      check(self.config, budget=1 << 62, rules=Rules(self.vocab_size, 0))
    except TokenError as exc:
      return f"{line}; {exc}".rstrip(".")
    return line
