"""`temoe` command line: `temoe train <config.yml> key=value ...` and `temoe data`.

`train` takes exactly MaxText's arguments and runs MaxText's own trainer after `register()`.
"""

from __future__ import annotations

import argparse
import sys


def config_error_message(exc: BaseException) -> str | None:
  """The one line a user needs from a config error (temoe's or MaxText's), or None if not one."""
  import pydantic  # pylint: disable=import-outside-toplevel

  if isinstance(exc, pydantic.ValidationError):
    return "; ".join(f"{'.'.join(map(str, e['loc'])) + ': ' if e['loc'] else ''}{e['msg']}" for e in exc.errors())
  from temoe import maxtext_seam, options  # pylint: disable=import-outside-toplevel

  if isinstance(exc, (options.TemoeConfigError, maxtext_seam.TemoeSeamError)):
    return str(exc)
  return None


def train(maxtext_args: list[str]) -> int:
  """Runs MaxText's pre-training loop with temoe registered."""
  if not maxtext_args or not maxtext_args[0].endswith((".yml", ".yaml")):
    print("usage: temoe train <config.yml> [key=value ...]  (MaxText's own arguments)", file=sys.stderr)
    return 2
  import temoe  # pylint: disable=import-outside-toplevel

  try:
    temoe.register()
  except Exception as exc:  # pylint: disable=broad-exception-caught
    message = config_error_message(exc)
    if message is None:
      raise
    print(f"temoe: {message}", file=sys.stderr)
    return 2
  from absl import app  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train as maxtext_train  # pylint: disable=import-outside-toplevel

  try:
    app.run(maxtext_train.main, argv=["temoe train", *maxtext_args])
  except SystemExit as exc:
    return int(exc.code or 0)
  except Exception as exc:  # pylint: disable=broad-exception-caught
    message = config_error_message(exc)
    if message is None:
      raise
    print(f"temoe: {message}", file=sys.stderr)
    return 2
  return 0


def data(args: argparse.Namespace) -> int:
  from temoe import data as token_data  # pylint: disable=import-outside-toplevel

  path = token_data.write_parquet(args.out, rows=args.rows, length=args.length, vocab=args.vocab, seed=args.seed)
  print(path)
  return 0


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if argv and argv[0] == "train":  # everything after `train` belongs to MaxText, untouched
    return train(argv[1:])
  parser = argparse.ArgumentParser(prog="temoe", description="Transformer Engine MoE for MaxText.")
  sub = parser.add_subparsers(dest="command", required=True)
  sub.add_parser("train", help="run MaxText's trainer with temoe: temoe train <config.yml> key=value ...")
  p_data = sub.add_parser("data", help="write the learnable token stream the CPU configs train on")
  p_data.add_argument("--out", default="runs/data/smoke-train.parquet")
  p_data.add_argument("--rows", type=int, default=4096)
  p_data.add_argument("--length", type=int, default=65)
  p_data.add_argument("--vocab", type=int, default=256)
  p_data.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  return data(args)


if __name__ == "__main__":
  sys.exit(main())
