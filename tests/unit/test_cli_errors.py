"""Every bad input gets one line and exit code 2, before anything compiles: a table of
input -> exit code -> the line, run through `temoe.cli.main` in this process (a subprocess for a
few rows, to see the whole output). docs/reference/bad-input.md's table is `render_table()` of `ROWS`.
"""

from __future__ import annotations

import json
import os
import pathlib
from types import SimpleNamespace

import pytest

from conftest import SMOKE, run_temoe
from temoe import cli
from temoe.run import data, lock

I671B = "configs/deepseek3-671b-h100x1024.yml"

# (command, arguments, exit code, text of the one line). For `train`, the arguments follow
# `temoe train configs/deepseek3-smoke.yml base_output_directory=<tmp>/out run_name=bad
# grain_train_files=<smoke data>` (an argument of the row replaces the default of its key);
# `{tmp}` is a folder of broken inputs (see `broken_inputs`); a `.yml` first argument replaces the config.
ROWS = [
    ("train", ["te_moe_blok=true"], 2, "unknown config key 'te_moe_blok'; did you mean te_moe_block"),
    ("train", ["foo"], 2, "'foo' is not a key=value setting; usage: temoe train <config.yml>"),
    ("train", ["--help"], 2, "'--help' is not a key=value setting"),
    ("train", ["te_moe_block=maybe"], 2, "te_moe_block=maybe is not a boolean; valid choices: true, false"),
    ("train", ["enable_checkpointing=sometimes"], 2, "enable_checkpointing=sometimes is not a boolean"),
    ("train", ["steps=0"], 2, "steps=0 must be greater than 0"),
    ("train", ["per_device_batch_size=0"], 2, "per_device_batch_size=0 must be greater than 0"),
    ("train", ["per_device_batch_size=-2"], 2, "per_device_batch_size=-2 must be greater than 0"),
    ("train", ["max_target_length=0"], 2, "max_target_length=0 must be greater than 0"),
    ("train", ["override_model_config=true", "num_experts_per_tok=17"], 2,
     "num_experts_per_tok=17 must be between 1 and num_experts=16"),
    ("train", ["override_model_config=true", "n_routing_groups=3"], 2,
     "num_experts=16 is not divisible by n_routing_groups=3"),
    ("train", ["override_model_config=true", "topk_routing_group=5"], 2,
     "topk_routing_group=5 must be between 1 and n_routing_groups=4"),
    ("train", ["ici_fsdp_parallelism=2"], 2, "the mesh (ici_fsdp_parallelism=2, dcn_data_parallelism=-1) does not fit the 1 device(s)"),
    ("train", ["num_slices=2"], 2, "num_slices=2 does not divide this job's 1 device(s)"),
    ("train", ["run_name=../escape"], 2, "run_name='../escape' must be one directory name"),
    ("train", ["metrics_file={tmp}/a-file/metrics.jsonl"], 2, "metrics_file={tmp}/a-file/metrics.jsonl cannot be written"),
    ("train", ["grain_train_files={tmp}/truncated.parquet"], 2, "truncated.parquet is not a readable Parquet file"),
    ("train", ["grain_train_files={tmp}/text.parquet"], 2, "text.parquet is not a readable Parquet file"),
    ("train", ["grain_train_files={tmp}"], 2, "is a directory; pass the files in it"),
    ("train", ["grain_train_files={tmp}/empty.parquet"], 2, "empty.parquet is empty (0 bytes)"),
    ("train", ["grain_train_files={tmp}/none-*.parquet"], 2, "none-*.parquet matches no file"),
    ("train", ["grain_train_files={tmp}/no-rows.parquet"], 2, "holds no rows"),
    ("train", ["train_data_columns=['text']"], 2, "has no column text (train_data_columns)"),
    ("train", ["grain_train_files={tmp}/vocab-300.parquet"], 2,
     "vocab-300.parquet row 17 (0-based) holds token id 300 at position 5, outside [0, vocab_size=256)"),
    ("train", ["grain_train_files={tmp}/negative-id.parquet"], 2,
     "negative-id.parquet row 3 (0-based) holds token id -1 at position 9, outside [0, vocab_size=256)"),
    ("train", ["grain_train_files={tmp}/int64-2^32.parquet"], 2,
     "row 20 (0-based) holds token id 4294967301 at position 2, which does not fit the int32 ids MaxText's batches hold"),
    ("train", ["grain_train_files={tmp}/float-ids.parquet"], 2,
     "column tokens is list<element: double>, not a list of integer token ids per row"),
    ("train", ["grain_train_files={tmp}/int-column.parquet"], 2, "column tokens is int32, not a list of integer token ids"),
    ("train", ["grain_train_files={tmp}/null-id.parquet"], 2, "row 7 (0-based) holds a null token id at position 3"),
    ("train", ["grain_train_files={tmp}/null-row.parquet"], 2, "row 4 (0-based) is null, not a list of token ids"),
    ("train", ["grain_train_files={tmp}/short-row.parquet"], 2,
     "row 9 (0-based) holds 12 token ids, fewer than max_target_length=64: with packing=false MaxText pads each row"),
    ("train", ["grain_train_files={tmp}/uint8-ids.parquet"], 2,
     "column tokens is list<element: uint8>: MaxText's input pipeline pads rows with the tokenizer's pad id (-1)"),
    ("train", ["log_period=0"], 2, "log_period=0 must be a whole number of at least 1"),
    ("train", ["enable_checkpointing=true", "checkpoint_period=-5"], 2,
     "checkpoint_period=-5 must be a whole number of at least 1"),
    ("train", ["num_epoch=0"], 2, "num_epoch=0 must be a whole number of at least 1"),
    ("train", ["learning_rate_schedule_steps=0"], 2, "learning_rate_schedule_steps=0 must be -1"),
    ("train", ["run_name=tensorboard-is-a-file"], 2,
     "tensorboard_dir {tmp}/out/tensorboard-is-a-file/tensorboard/ is not a writable directory (Not a directory)"),
    ("train", ["steps=inf"], 2, "steps=inf is not a finite number"),
    ("train", ["per_device_batch_size=nan"], 2, "per_device_batch_size=nan is not a finite number"),
    ("train", ["enable_checkpointing=true", "te_resume_step=3"], 2,
     "te_resume_step=3: {tmp}/out/bad/checkpoints/ has no committed step 3; its steps: none"),
    ("train", ["run_name=locked"], 2, "is in use by another temoe train (pid"),
    ("train", ["{tmp}/missing.yml"], 2, "config {tmp}/missing.yml does not exist"),
    ("plan", ["{tmp}/missing.yml"], 2, "{tmp}/missing.yml is not a config YAML file (no such file)"),
    ("train", ["{tmp}/invalid.yml"], 2, "config {tmp}/invalid.yml is not valid YAML at line 2, column 1"),
    ("train", ["{tmp}/empty.yml"], 2, "config {tmp}/empty.yml is empty"),
    ("train", ["{tmp}/no-base.yml"], 2, "has no base_config; add `base_config: base.yml`"),
    ("train", ["{tmp}/missing-base.yml"], 2, "base_config: nothere.yml of {tmp}/missing-base.yml is neither beside it"),
    ("train", ["{tmp}/list.yml"], 2, "holds a YAML list, not a mapping"),
    ("train", ["{tmp}/dir.yml"], 2, "config {tmp}/dir.yml is not a file"),
    ("train", ["{tmp}/typo.yml"], 2, "unknown config key 'te_moe_blok'; did you mean te_moe_block"),
    ("train", ["{tmp}/duplicate-key.yml"], 2, "duplicate-key.yml sets 'steps' twice (lines 2 and 3)"),
    ("plan", ["{tmp}/duplicate-key.yml"], 2, "sets 'steps' twice (lines 2 and 3); MaxText refuses a repeated key"),
    ("plan", ["{tmp}/empty.yml"], 2, "config {tmp}/empty.yml is empty"),
    ("plan", [SMOKE, "te_moe_blok=true"], 2, "unknown config key 'te_moe_blok'"),
    ("plan", [I671B], 2, "pass its --devices N and --slices N"),
    ("plan", [SMOKE, "--slices", "2"], 2, "num_slices=2 does not divide the 1 device(s) planned"),
    ("plan", [SMOKE, "--devices", "6", "--slices", "4"], 2, "num_slices=4 does not divide the 6 device(s) planned"),
    ("plan", [SMOKE, "--hbm-gib", "inf"], 2, "--hbm-gib=inf must be a positive number of GiB, finite and at most 1e+06"),
    ("plan", [SMOKE, "--devices", "1000000000000"], 2, "--devices=1000000000000 must be at least 1 and at most 1,048,576"),
    ("plan", [SMOKE, "per_device_batch_size=inf"], 2, "per_device_batch_size=inf is not a finite number"),
    ("plan", [SMOKE, "per_device_batch_size=-2"], 2, "per_device_batch_size=-2 must be greater than 0"),
    ("plan", [SMOKE, "--hbm-gib", "lots"], 2, "argument --hbm-gib: invalid float value: 'lots' (see `temoe plan --help`)"),
    ("flops", [SMOKE, "per_device_batch_size=-2"], 2, "per_device_batch_size=-2 must be greater than 0"),
    ("flops", ["{tmp}/negative-batch.yml"], 2, "per_device_batch_size=-2 must be greater than 0 (and finite)"),
    ("flops", [SMOKE, "--gpu", "nope"], 2, "argument --gpu: invalid choice: 'nope'; valid choices: b200, gb200, gb300"),
    ("profile", [SMOKE, "--steps", "0"], 2, "--steps=0 must be at least 1"),
    ("profile", ["{tmp}/invalid.yml"], 2, "is not valid YAML"),
    ("data", ["--rows", "0", "--out", "{tmp}/new.parquet"], 2, "--rows=0 must be at least 1"),
    ("data", ["--out", "{tmp}"], 2, "is a directory; pass a file path"),
    ("data", ["--out", "{tmp}/text.parquet"], 2, "exists and is not a readable Parquet file"),
    ("data", ["--out", "{tmp}/stream.parquet", "--rows", "8"], 2,
     "exists and was written with other settings (--rows 16, not 8); pass --overwrite to replace it, or another path"),
    ("data", ["--out", "/proc/no-such-dir/x.parquet"], 2, "cannot be written (No such file or directory)"),
    ("data", ["--rows", "many"], 2, "argument --rows: invalid int value: 'many' (see `temoe data --help`)"),
    ("env", ["--write-dockerfile", "{tmp}/nothere"], 2, "--write-dockerfile {tmp}/nothere: No such file or directory"),
    ("env", ["--write-dockerfile", "{tmp}/empty.yml"], 2, "has no block between"),
    ("env", ["--arch", "ampere"], 2, "argument --arch: invalid choice: 'ampere'"),
    ("doctor", ["--without-te"], 2, "--without-te goes with --image (see `temoe doctor --help`)"),
    ("profile", ["--trace", "{tmp}/bad-trace"], 2, "is not a profile JAX can read"),
    ("profile", ["--trace", "{tmp}/nothere"], 2, "--trace {tmp}/nothere does not exist"),
    ("report", ["{tmp}/nothere"], 2, "{tmp}/nothere is not a run directory"),
    ("report", ["{tmp}/empty.yml"], 2, "is not a run directory (it is a file"),
    ("report", ["{tmp}", "--config", "{tmp}/empty.yml"], 2, "--config: config {tmp}/empty.yml is empty"),
    ("report", ["{tmp}/bad-events"], 2, "events.out.tfevents.1 is not a readable TensorBoard event file"),
    ("report", ["{tmp}/bad-profile"], 2, "profile.json is not a profile.json of `temoe profile`"),
    ("report", [], 2, "the following arguments are required: run_dir (see `temoe report --help`)"),
    ("report", ["{tmp}/bad-profile", "--out", "{tmp}/a-file"], 2, "the output path {tmp}/a-file is a file, not a directory"),
    ("report", ["{tmp}/string-loss"], 2, "the row of step 1 holds learning/loss='5.2', not a number"),
    ("summary", ["{tmp}/nothere.jsonl"], 2, "is not a metrics file"),
    ("summary", ["{tmp}/string-loss/metrics.jsonl"], 2, "the row of step 1 holds learning/loss='5.2', not a number"),
    ("summary", ["{tmp}/garbage.jsonl"], 2, "garbage.jsonl is not a metrics file: no line is a JSON row with learning/loss"),
    ("summary", ["{tmp}/empty.jsonl"], 2, "empty.jsonl is empty: no step was logged"),
    ("summary", [], 2, "usage: python -m temoe.tools.summary <metrics.jsonl>"),
]


@pytest.fixture(scope="module")
def broken_inputs(tmp_path_factory, smoke_data) -> dict:
  """A folder of broken inputs (the `{tmp}` of ROWS) and the smoke data path."""
  tmp = tmp_path_factory.mktemp("broken")
  files = {
      "empty.yml": "", "invalid.yml": "steps: [1\n", "no-base.yml": "steps: 3\n",
      "missing-base.yml": "base_config: nothere.yml\n", "list.yml": "- 1\n- 2\n",
      "typo.yml": f"base_config: {SMOKE}\nte_moe_blok: true\n", "text.parquet": "tokens\n1,2,3\n",
      "empty.parquet": "", "duplicate-key.yml": f"base_config: {SMOKE}\nsteps: 3\nsteps: 5\n",
      "empty.jsonl": "", "garbage.jsonl": "\x00\x9f garbage {not json\n",
  }
  for name, text in files.items():
    (tmp / name).write_text(text)
  (tmp / "dir.yml").mkdir()
  (tmp / "a-file").write_text("")
  good = pathlib.Path(smoke_data).read_bytes()
  (tmp / "truncated.parquet").write_bytes(good[: len(good) // 2])
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

  pq.write_table(pa.table({"tokens": pa.array([], type=pa.list_(pa.int32()))}), tmp / "no-rows.parquet")
  write_bad_token_files(tmp)
  (tmp / "out" / "tensorboard-is-a-file").mkdir(parents=True)
  (tmp / "out" / "tensorboard-is-a-file" / "tensorboard").write_text("")
  (tmp / "negative-batch.yml").write_text("base_config: base.yml\nper_device_batch_size: -2\n")
  data.write_parquet(str(tmp / "stream.parquet"), rows=16)
  (tmp / "bad-events").mkdir()
  (tmp / "bad-events" / "events.out.tfevents.1").write_bytes(b"not an event file at all")
  (tmp / "bad-profile").mkdir()
  (tmp / "bad-profile" / "metrics.jsonl").write_text('{"step": 0.0, "learning/loss": 5.0}\n')
  (tmp / "bad-profile" / "profile.json").write_text('{"steps": 3}')
  (tmp / "string-loss").mkdir()
  perf = '"perf/per_device_tokens_per_sec": 1.0, "perf/step_time_seconds": 0.1, "perf/per_device_tflops_per_sec": 0.1'
  (tmp / "string-loss" / "metrics.jsonl").write_text(f'{{"step": 0.0, "learning/loss": 5.4, {perf}}}\n'
                                                      f'{{"step": 1.0, "learning/loss": "5.2", {perf}}}\n')
  (tmp / "bad-trace").mkdir()
  (tmp / "bad-trace" / "host.xplane.pb").write_bytes(b"garbage")
  held = tmp / "out" / "locked"
  held.mkdir(parents=True)
  (held / lock.LOCK_NAME).write_text(json.dumps(lock.holder_info()))  # this live process holds it
  return {"tmp": str(tmp), "data": smoke_data}


def write_bad_token_files(tmp: pathlib.Path) -> None:
  """Token data MaxText would train on without a word (`temoe.run.tokens` refuses each)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

  good = data.markov_tokens(64, 65, 256)

  def write(name, column):
    pq.write_table(pa.table({"tokens": column}), tmp / name)

  def with_value(dtype, row, position, value):
    ids = good.astype(dtype)
    ids[row, position] = value
    return pa.array(list(ids), type=pa.list_(pa.from_numpy_dtype(dtype)))

  def with_rows(change):
    rows = [list(map(int, r)) for r in good]
    change(rows)
    return pa.array(rows, type=pa.list_(pa.int32()))

  write("vocab-300.parquet", with_value(np.int32, 17, 5, 300))  # data made for a larger vocabulary
  write("negative-id.parquet", with_value(np.int32, 3, 9, -1))
  write("int64-2^32.parquet", with_value(np.int64, 20, 2, 2**32 + 5))  # int32 would keep its low bits: 5
  write("float-ids.parquet", pa.array(list(good + 0.5), type=pa.list_(pa.float64())))
  write("int-column.parquet", pa.array(good[:, 0].astype(np.int32)))
  write("null-id.parquet", with_rows(lambda rows: rows[7].__setitem__(3, None)))
  write("null-row.parquet", with_rows(lambda rows: rows.__setitem__(4, None)))
  write("short-row.parquet", with_rows(lambda rows: rows.__setitem__(9, rows[9][:12])))
  write("uint8-ids.parquet", pa.array(list(good.astype(np.uint8)), type=pa.list_(pa.uint8())))


def argv(command: str, args: list[str], where: dict) -> list[str]:
  """The full command line of a row."""
  args = [a.format(**where) for a in args]
  if command != "train":
    return [command, *args]
  config = args.pop(0) if args and args[0].endswith(".yml") else SMOKE
  settings = {"base_output_directory": f"{where['tmp']}/out", "run_name": "bad", "grain_train_files": where["data"]}
  rest = []
  for arg in args:
    key = arg.split("=", 1)[0]
    if "=" in arg and key in settings:
      settings[key] = arg.split("=", 1)[1]
    else:
      rest.append(arg)
  return ["train", config, *(f"{k}={v}" for k, v in settings.items()), *rest]


def run_row(command: str, args: list[str], where: dict, capsys) -> tuple[int, list[str], str]:
  """(exit code, temoe's lines on stderr, all of stderr) of one row, in this process."""
  full = argv(command, args, where)
  if command == "summary":
    from temoe.tools import summary  # pylint: disable=import-outside-toplevel

    code = summary.main(full[1:])
  elif command == "flops":
    from temoe.tools import flops  # pylint: disable=import-outside-toplevel

    code = flops.main(full[1:])
  else:
    code = cli.main(full)
  err = capsys.readouterr().err
  return code, [line for line in err.splitlines() if line.startswith("temoe")], err


@pytest.mark.parametrize("row", ROWS, ids=[f"{c} {' '.join(a)}" for c, a, _, _ in ROWS])
def test_bad_input_gets_one_line(row, broken_inputs, capsys):
  command, args, code, text = row
  got, lines, err = run_row(command, args, broken_inputs, capsys)
  expected = text.format(**broken_inputs)
  assert got == code, err[-3000:]
  assert len(lines) == 1 and expected in lines[0], err[-3000:]
  assert "Traceback" not in err and "MAXTEXT CONFIG ERROR" not in err
  assert not (pathlib.Path(broken_inputs["tmp"]) / "out" / "bad" / "checkpoints").exists()
  assert not (pathlib.Path(broken_inputs["tmp"]) / "escape").exists()


SUBPROCESS_ROWS = [r for r in ROWS if r[0] == "train" and r[1][0] in ("te_moe_blok=true", "steps=0", "{tmp}/missing.yml")]


@pytest.mark.parametrize("row", SUBPROCESS_ROWS, ids=[r[1][0] for r in SUBPROCESS_ROWS])
def test_a_subprocess_prints_only_the_line(row, broken_inputs):
  """The whole output: no MaxText error block, no field list, no traceback; the line is the last."""
  command, args, code, text = row
  result = run_temoe(*argv(command, args, broken_inputs))
  assert result.returncode == code, result.stderr[-3000:]
  assert result.stderr.strip().splitlines()[-1] == [l for l in result.stderr.splitlines() if l.startswith("temoe")][0]
  assert text.format(**broken_inputs) in result.stderr.strip().splitlines()[-1]
  assert "MAXTEXT CONFIG ERROR" not in result.stderr and "Traceback" not in result.stderr
  assert "'emb_dim'" not in result.stderr  # MaxText's list of every field


def test_slices_over_devices_that_report_none_are_named():
  """MaxText's hybrid mesh reads each device's slice_index: host devices have none, so num_slices > 1 fails there
  with a message about slices, not the parallelisms' product."""
  from temoe.run import preflight  # pylint: disable=import-outside-toplevel

  host = [SimpleNamespace(platform="cpu") for _ in range(4)]
  nodes = [SimpleNamespace(platform="gpu", slice_index=i // 2) for i in range(4)]
  assert "4 cpu device(s) report no slice (slice_index)" in preflight.slices_unfit(SimpleNamespace(num_slices=2), host)
  assert preflight.slices_unfit(SimpleNamespace(num_slices=2), nodes) is None
  assert "num_slices=3 does not divide this job's 4 device(s)" in preflight.slices_unfit(SimpleNamespace(num_slices=3), nodes)
  assert preflight.slices_unfit(SimpleNamespace(num_slices=-1), host) is None
  assert preflight.slices_unfit(SimpleNamespace(num_slices=1), host) is None


def test_lock_holder_info_names_who_and_where(tmp_path):
  held = lock.acquire(str(tmp_path / "run"))
  try:
    with pytest.raises(lock.RunLocked, match=r"in use by another temoe train \(pid \d+ on .*, started 20"):
      lock.acquire(str(tmp_path / "run"))
  finally:
    held.release()
  assert not (tmp_path / "run" / lock.LOCK_NAME).exists()
  dead = {**lock.holder_info(), "pid": 2**22 + 17}  # no such process
  (tmp_path / "run" / lock.LOCK_NAME).write_text(json.dumps(dead))
  taken = lock.acquire(str(tmp_path / "run"))  # a stale lock is taken over
  assert json.loads((tmp_path / "run" / lock.LOCK_NAME).read_text())["pid"] == os.getpid()
  taken.release()


def test_other_host_lock_is_stale_only_without_heartbeat(tmp_path):
  me = lock.holder_info()
  other = {**me, "host": "elsewhere", "slurm_job": None}
  assert lock.stale_reason(other, lock.STALE_S - 1, me) is None
  assert "not refreshed" in lock.stale_reason(other, lock.STALE_S + 1, {**me, "slurm_job": None})
  assert "earlier attempt" in lock.stale_reason({**other, "slurm_job": "7"}, 0, {**me, "slurm_job": "7"})


def test_metrics_with_a_cut_line_and_a_resume_count_each_step_once(tmp_path):
  from temoe.tools import report, summary  # pylint: disable=import-outside-toplevel

  def row(step, loss):
    return json.dumps({"step": float(step), "learning/loss": loss, "perf/per_device_tokens_per_sec": 100.0,
                       "perf/step_time_seconds": 0.1, "perf/per_device_tflops_per_sec": 0.01})

  first = "\n".join(row(s, 6.0 - s * 0.1) for s in range(6)) + "\n" + row(6, 5.4)[:25]  # SIGKILL mid-line
  resumed = "\n".join(row(s, 5.0 - s * 0.1) for s in range(4, 9)) + "\n"  # resumed from checkpoint 3
  path = tmp_path / "metrics.jsonl"
  path.write_text(first + resumed)
  rows = report.read_metrics(str(path))
  assert [int(r["step"]) for r in rows] == list(range(9))
  assert rows[4]["learning/loss"] == 5.0 - 0.4  # the resumed run's value
  assert summary.summarize(str(path)).startswith("temoe run: 9 steps, loss 6.000 -> 4.200")
  assert report.main([str(tmp_path), "--out", str(tmp_path / "report")]) == 0


def render_table(rows=ROWS) -> str:
  """The bad-input reference page's table: one row per ROWS entry (placeholders as <tmp>/..., the smoke config as smoke.yml)."""
  def shown(command, args):
    text = " ".join(a.replace("{tmp}/", "").replace("{tmp}", "<dir>").replace(SMOKE, "smoke.yml") for a in args)
    if command == "train" and not (args and args[0].endswith(".yml")):
      text = f"smoke.yml {text}"
    if command in ("summary", "flops"):
      return f"python -m temoe.tools.{command} {text}".rstrip()
    return f"temoe {command} {text}".rstrip()

  lines = ["| input | exit | the one line (excerpt) |", "|---|---|---|"]
  for command, args, code, text in rows:
    cell = text.replace("{tmp}/", "").replace("{tmp}", "<dir>").replace("|", "\\|")
    cell = cell.replace("<", "&lt;").replace(">", "&gt;")
    lines.append(f"| `{shown(command, args)}` | {code} | {cell} |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  print(render_table(), end="")


def test_the_bad_input_page_is_this_tables_rendering():
  page = (pathlib.Path(__file__).resolve().parents[2] / "docs/reference/bad-input.md").read_text(encoding="utf-8")
  assert render_table() in page, "docs/reference/bad-input.md drifted from ROWS: paste render_table()'s output"
