"""SIGTERM and SIGINT stop a `temoe train` without losing work: the step in flight finishes, its state
is checkpointed synchronously, the run lock is released, one line is printed, and the exit code is
`temoe.exits.REQUEUE`, which the launchers requeue.

Slurm and Kubernetes send SIGTERM some time before they kill a job (preemption, a time limit, a
drained node), and a Python process dies of it at once by default. Here:

- Before the first step (config, preflight, model set-up, restore, compile) there is nothing new to
  save: a background thread, woken by the signal itself (`signal.set_wakeup_fd`, so even while the
  main thread is inside a compile), releases the lock and exits at once.
- From the first step on, the signal only sets a flag; `temoe.maxtext.failures` looks at it after
  each step, saves that step and stops (`due`).
- Several processes (jax.distributed) must save the same step together. JAX's preemption sync
  service does the agreeing: it installs its own SIGTERM handler when jax.distributed starts,
  tells every process, and picks the next step none has passed; `due(step)` asks it
  (`reached_preemption_sync_point`, with MaxText's absolute step numbers, as Orbax asks it too).
  SIGINT is turned into a SIGTERM to this process, so it takes the same path.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from temoe import exits

SIGNALS = (signal.SIGTERM, signal.SIGINT)

_lock = threading.Lock()  # held while the watcher decides to exit, and while training starts
_state: dict = {"received": None, "training": False, "installed": None}  # installed: what uninstall() restores
_on_exit: list = []  # callables run before an exit before the first step (the run lock's release)


def install() -> None:
  """Takes over SIGTERM and SIGINT for this process (from the main thread) until `uninstall()`."""
  if _state["installed"]:
    return
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)
  previous = {signum: signal.signal(signum, _handler) for signum in SIGNALS}
  wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
  threading.Thread(target=_watch, args=(read_fd,), name="temoe-preemption", daemon=True).start()
  _state.update(installed=(previous, wakeup, write_fd), received=None, training=False)


def uninstall() -> None:
  """Gives the signals back as they were (a command that trained in-process, `temoe profile`, goes on)."""
  if not _state["installed"]:
    return
  previous, wakeup, write_fd = _state["installed"]
  for signum, handler in previous.items():
    signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
  signal.set_wakeup_fd(wakeup)
  os.close(write_fd)  # the watcher reads EOF and ends
  _on_exit.clear()
  _state.update(installed=None, received=None, training=False)


def on_exit(callback) -> None:
  """Runs `callback` before an exit that happens before the first step (the run lock's release)."""
  _on_exit.append(callback)


def received() -> str | None:
  """The name of the first stop signal this process received (SIGTERM, SIGINT), or None."""
  return signal.Signals(_state["received"]).name if _state["received"] else None


def _handler(signum, frame):  # the main thread runs it between two bytecodes
  del frame
  if _state["received"] is None:
    _state["received"] = signum
  if signum == signal.SIGINT and _jax_sync_manager():
    os.kill(os.getpid(), signal.SIGTERM)  # JAX's handler tells every process


def _watch(read_fd: int) -> None:
  """Woken by every signal this process receives (the wakeup fd); exits if no step ran yet."""
  while True:
    try:
      data = os.read(read_fd, 64)
    except OSError:
      data = b""
    if not data:  # uninstall() closed the pipe
      os.close(read_fd)
      return
    if not any(b in SIGNALS for b in data):
      continue
    with _lock:
      if _state["training"]:
        continue  # the main thread stops after the step in flight
      name = signal.Signals(next(b for b in data if b in SIGNALS)).name
      for callback in _on_exit:
        callback()
      print(f"temoe: {name} before the first step: nothing new to checkpoint, stopping now (exit "
            f"{exits.REQUEUE}: requeue; the run resumes from its latest checkpoint).", file=sys.stderr, flush=True)
      os._exit(exits.REQUEUE)  # pylint: disable=protected-access


def training_starts(start_step: int) -> None:
  """From here on a signal stops the run after a step (the restore is done, the compile is next)."""
  with _lock:
    _state["training"] = True
  sync_from(start_step)


def sync_from(start_step: int) -> None:
  """Tells JAX's sync service (several processes) the step before this run's first: a notice before
  any step would otherwise agree on step 1, which a resumed run has passed, and never stop it."""
  if _jax_sync_manager() and start_step > 0:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    multihost_utils.reached_preemption_sync_point(start_step - 1)


def due(step: int) -> bool:
  """Whether the run stops after `step` (which just ran): a signal here, or, with several processes,
  JAX's agreed step. Call once per step, on every process."""
  if _jax_sync_manager():
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    return multihost_utils.reached_preemption_sync_point(step)
  return _state["received"] is not None


def _jax_sync_manager() -> bool:
  """Whether JAX's preemption sync service runs here (jax.distributed with more than one process)."""
  if "jax" not in sys.modules:
    return False
  import jax  # pylint: disable=import-outside-toplevel

  return jax.distributed.is_initialized() and jax.process_count() > 1 and bool(
      jax.config.jax_enable_preemption_service)
