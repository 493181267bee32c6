"""Content checksums of committed checkpoint steps, recorded at save and verified before a restore.

Orbax records no checksum of what it writes, so a chunk with flipped bytes (size unchanged)
restores silently. After a step is committed, each process records the CRC-32 and size of the
files it wrote (paths naming `process_<its index>`; the first process also the shared ones) in
`<run dir>/temoe-checksums/<step>.process_<i>.json`, outside Orbax's step directory. A restore
is checked against every process's record: a changed, missing or truncated file names the step.
"""

from __future__ import annotations

import json
import os
import re
import zlib

RECORDS = "temoe-checksums"
PROCESS = re.compile(r"process_(\d+)")
BLOCK = 8 << 20


def records_dir(checkpoint_dir: str) -> str:
  return os.path.join(os.path.dirname(os.path.normpath(checkpoint_dir)), RECORDS)


def crc32(path: str) -> int:
  value = 0
  with open(path, "rb") as f:
    while block := f.read(BLOCK):
      value = zlib.crc32(block, value)
  return value


def owned_files(step_dir: str, rank: int) -> list[str]:
  """The files of `step_dir` (relative paths) that process `rank` wrote."""
  out = []
  for root, _, files in os.walk(step_dir):
    for name in files:
      rel = os.path.relpath(os.path.join(root, name), step_dir)
      owners = {int(i) for i in PROCESS.findall(rel)}
      if (owners and rank in owners) or (not owners and rank == 0):
        out.append(rel)
  return sorted(out)


def record(checkpoint_dir: str, step: int, rank: int) -> str:
  """Writes this process's record for a committed step; returns its path."""
  step_dir = os.path.join(checkpoint_dir, str(step))
  files = {rel: [os.path.getsize(os.path.join(step_dir, rel)), crc32(os.path.join(step_dir, rel))]
           for rel in owned_files(step_dir, rank)}
  out = records_dir(checkpoint_dir)
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, f"{step}.process_{rank}.json")
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump({"step": step, "files": files}, f)
  os.replace(tmp, path)
  return path


def mismatch(checkpoint_dir: str, step: int) -> str | None:
  """What in the committed step differs from its records, or None (also when none were recorded)."""
  step_dir = os.path.join(checkpoint_dir, str(step))
  out = records_dir(checkpoint_dir)
  names = sorted(n for n in os.listdir(out) if n.startswith(f"{step}.process_") and n.endswith(".json")) \
      if os.path.isdir(out) else []
  for name in names:
    try:
      with open(os.path.join(out, name), encoding="utf-8") as f:
        files = json.load(f)["files"]
    except (OSError, ValueError, KeyError):
      continue  # a record cut short by a kill: nothing to compare against
    for rel, (size, value) in sorted(files.items()):
      path = os.path.join(step_dir, rel)
      if not os.path.isfile(path):
        return f"{rel} is missing (it was saved)"
      if os.path.getsize(path) != size:
        return f"{rel} is {os.path.getsize(path)} bytes, {size} when saved"
      if crc32(path) != value:
        return f"{rel} differs from what was saved (CRC-32 mismatch)"
  return None
