"""A small learnable token stream for CPU runs and tests, written as pre-tokenized Parquet.

Tokens follow a fixed random Markov chain of low entropy, so a model that learns its bigrams
cuts the loss from ln(vocab) towards the chain's entropy within a few dozen steps (MaxText's
synthetic data is all zeros and teaches nothing). MaxText's Grain pipeline reads it with
`dataset_type=grain grain_file_type=parquet tokenize_train_data=false train_data_columns=[tokens]`.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np


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


def write_parquet(path: str, rows: int = 4096, length: int = 65, vocab: int = 256, seed: int = 0) -> str:
  """Writes the stream to `path` (column `tokens`) unless it is already there; returns the path."""
  if os.path.exists(path):
    return path
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tokens = markov_tokens(rows, length, vocab, seed=seed)
  table = pa.table({"tokens": pa.array(list(tokens), type=pa.list_(pa.int32()))})
  tmp = f"{path}.tmp-{os.getpid()}"
  pq.write_table(table, tmp)
  os.replace(tmp, path)
  return path


def existing_problem(path: str, rows: int, length: int) -> str | None:
  """Why an existing --out is not the stream asked for (it is kept, never rewritten), or None."""
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

  try:
    meta = pq.ParquetFile(path).metadata
  except Exception as exc:  # noqa: BLE001  # pylint: disable=broad-exception-caught
    return f"is not a readable Parquet file ({type(exc).__name__})"
  return None if meta.num_rows == rows else f"holds {meta.num_rows} rows, not --rows {rows}"


def main(argv: list[str]) -> int:
  """`temoe data [--out PATH] ...`: writes the stream (once) and prints its path."""
  parser = argparse.ArgumentParser(prog="temoe data", description=__doc__.splitlines()[0])
  parser.add_argument("--out", default="runs/data/smoke-train.parquet")
  parser.add_argument("--rows", type=int, default=4096)
  parser.add_argument("--length", type=int, default=65)
  parser.add_argument("--vocab", type=int, default=256)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  for flag in ("rows", "length", "vocab"):
    if getattr(args, flag) < (2 if flag != "rows" else 1):
      print(f"temoe data: --{flag}={getattr(args, flag)} must be at least {2 if flag != 'rows' else 1}", file=sys.stderr)
      return 2
  if os.path.isdir(args.out):
    print(f"temoe data: --out {args.out} is a directory; pass a file path (e.g. {args.out}/train.parquet)",
          file=sys.stderr)
    return 2
  if os.path.exists(args.out):
    problem = existing_problem(args.out, args.rows, args.length)
    if problem:
      print(f"temoe data: --out {args.out} exists and {problem}; remove it or pass another path", file=sys.stderr)
      return 2
  print(write_parquet(args.out, rows=args.rows, length=args.length, vocab=args.vocab, seed=args.seed))
  return 0
