"""A small learnable token stream for CPU runs and tests, written as pre-tokenized Parquet.

Tokens follow a fixed random Markov chain of low entropy, so a model that learns its bigrams
cuts the loss from ln(vocab) towards the chain's entropy within a few dozen steps (MaxText's
synthetic data is all zeros and teaches nothing). MaxText's Grain pipeline reads it with
`dataset_type=grain grain_file_type=parquet tokenize_train_data=false train_data_columns=[tokens]`.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from temoe import oneline


def markov_tokens(rows: int, length: int, vocab: int, successors: int = 3, seed: int = 0) -> np.ndarray:
  """(rows, length) int32 tokens; each token is followed by one of `successors` fixed others."""
  rng = np.random.default_rng(seed)
  table = rng.integers(1, vocab, size=(vocab, successors))  # token 0 stays free (MaxText's pad id)
  probs = rng.dirichlet(np.ones(successors) * 0.5, size=vocab)
  out = np.empty((rows, length), np.int32)
  out[:, 0] = rng.integers(1, vocab, size=rows)
  for t in range(1, length):
    prev = out[:, t - 1]
    pick = (rng.random(rows)[:, None] > np.cumsum(probs[prev], axis=1)).sum(axis=1)
    out[:, t] = table[prev, np.minimum(pick, successors - 1)]
  return out


def entropy_floor(vocab: int, successors: int = 3, seed: int = 0) -> float:
  """The chain's mean next-token entropy (nats): the loss a perfect bigram model reaches."""
  rng = np.random.default_rng(seed)
  rng.integers(1, vocab, size=(vocab, successors))
  probs = rng.dirichlet(np.ones(successors) * 0.5, size=vocab)
  return float(np.mean(-np.sum(probs * np.log(np.clip(probs, 1e-12, None)), axis=1)))


SETTINGS_KEY = b"temoe.data"
"""Parquet key-value metadata holding the settings a stream was written with (JSON)."""


def write_parquet(path: str, rows: int = 4096, length: int = 65, vocab: int = 256, seed: int = 0,
                  replace: bool = False) -> str:
  """Writes the stream to `path` (column `tokens`, its settings in the file's metadata) unless it is
  already there (`replace`: write it anyway); returns the path."""
  if os.path.exists(path) and not replace:
    return path
  import json  # pylint: disable=import-outside-toplevel

  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tokens = markov_tokens(rows, length, vocab, seed=seed)
  table = pa.table({"tokens": pa.array(list(tokens), type=pa.list_(pa.int32()))})
  settings = {"rows": rows, "length": length, "vocab": vocab, "seed": seed}
  table = table.replace_schema_metadata({SETTINGS_KEY: json.dumps(settings).encode()})
  tmp = f"{path}.tmp-{os.getpid()}"
  pq.write_table(table, tmp)
  os.replace(tmp, path)
  return path


def existing_problem(path: str, settings: dict) -> str | None:
  """Why an existing --out is not the stream these settings write, or None."""
  import json  # pylint: disable=import-outside-toplevel

  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

  try:
    parquet = pq.ParquetFile(path)
  except Exception as exc:  # noqa: BLE001  # pylint: disable=broad-exception-caught
    return f"is not a readable Parquet file ({type(exc).__name__})"
  recorded = (parquet.schema_arrow.metadata or {}).get(SETTINGS_KEY)
  if recorded is None:  # a stream from before the settings were recorded: its shape is all there is to compare
    have = {"rows": parquet.metadata.num_rows}
  else:
    try:
      have = json.loads(recorded)
    except ValueError:
      return "has unreadable temoe.data settings"
  differ = [f"--{key} {have[key]}, not {settings[key]}" for key in settings if key in have and have[key] != settings[key]]
  return f"was written with other settings ({'; '.join(differ)})" if differ else None


def main(argv: list[str]) -> int:
  """`temoe data [--out PATH] ...`: writes the stream (once) and prints its path."""
  parser = oneline.ArgumentParser(prog="temoe data", description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="runs/data/smoke-train.parquet")
  parser.add_argument("--rows", type=int, default=4096)
  parser.add_argument("--length", type=int, default=65)
  parser.add_argument("--vocab", type=int, default=256)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--overwrite", action="store_true", help="replace an --out written with other settings")
  args = parser.parse_args(argv)
  for flag in ("rows", "length", "vocab"):
    if getattr(args, flag) < (2 if flag != "rows" else 1):
      print(f"temoe data: --{flag}={getattr(args, flag)} must be at least {2 if flag != 'rows' else 1}", file=sys.stderr)
      return 2
  if os.path.isdir(args.out):
    print(f"temoe data: --out {args.out} is a directory; pass a file path (e.g. {args.out}/train.parquet)",
          file=sys.stderr)
    return 2
  settings = {"rows": args.rows, "length": args.length, "vocab": args.vocab, "seed": args.seed}
  problem = existing_problem(args.out, settings) if os.path.exists(args.out) else None
  if problem and not args.overwrite:
    print(f"temoe data: --out {args.out} exists and {problem}; pass --overwrite to replace it, or another path",
          file=sys.stderr)
    return 2
  try:
    write_parquet(args.out, replace=bool(problem), **settings)
  except OSError as exc:
    print(f"temoe data: --out {args.out} cannot be written ({exc.strerror or exc}); pass a path this user can write",
          file=sys.stderr)
    return 2
  if problem:
    print(f"temoe data: overwrote {args.out}, which {problem}", file=sys.stderr)
  print(args.out)
  return 0
