"""One process of a multi-process job as two: this one supervises, its child trains.

JAX's runtime ends a process whose peer died in one of two ways (mllm/train/peers.py): a failed
collective, which Python catches and turns into one line; or, when the coordinator notices first,
an abort from a C++ thread (exit 134 and a stack dump), after which nothing in that process runs.
So in a job of several processes launch.py runs itself again as a child and waits for it:
- the child tells its supervisor, through a pipe, which process of the job it is and its workdir
  (`tell`), and once it trains, sends its native stderr (JAX's C++ logs, an abort's stack dump) to
  its run log (`native_stderr_to`), keeping Python's own lines on the terminal;
- a child that dies by a signal ends in the supervisor's one line (which process, how it ended,
  the last committed step, the command to resume), exit 1; any other exit status passes through;
- SIGTERM / SIGINT reach the child once: directly when they were sent to the process group (a
  terminal's Ctrl-C) or to every process (a scheduler), else forwarded. The child's C signal
  handler writes each signal's number to the pipe (`report_signals`, Python's wakeup fd), so the
  report comes at once even while the child is deep in XLA; the supervisor forwards a signal only
  when no report follows it within `GRACE_S`, so a save-and-stop request is never doubled into a
  stop at once; a child a stop signal ended before it could save exits 128 + the signal, quietly;
- the child dies with its supervisor (Linux: PR_SET_PDEATHSIG), so killing the process a
  scheduler or launcher started still kills the job's process.
This module imports no JAX: the supervisor stays a small process.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time

from mllm.paths import committed_steps

CHILD_FD = 'MLLM_SUPERVISOR_FD'  # set in the child: the pipe to its supervisor
GRACE_S = 0.3  # how long a signal the child may have got directly waits before it is forwarded
STOPS = (signal.SIGTERM, signal.SIGINT)


def several_processes(env) -> bool:
  """Whether the environment starts this process as one of several (a cluster's variables)."""
  return bool(
    env.get('JAX_COORDINATOR_ADDRESS')
    or int(env.get('SLURM_NTASKS', '1')) > 1
    or int(env.get('OMPI_COMM_WORLD_SIZE', '1')) > 1
    or ',' in env.get('TPU_WORKER_HOSTNAMES', '')
  )


def wanted(env) -> bool:
  """Whether launch.py should run under a supervisor: a process of a multi-process job, not
  already the supervised child, and not asked to run bare (MLLM_SUPERVISE=0)."""
  return several_processes(env) and CHILD_FD not in env and env.get('MLLM_SUPERVISE', '1') != '0'


def supervise(argv: list[str]) -> int:
  """Run `python argv...` as the supervised child; its exit status, or 1 with one line if a
  signal nobody asked for ended it."""
  read_fd, write_fd = os.pipe()
  child = subprocess.Popen(
    [sys.executable, *argv],
    env={**os.environ, CHILD_FD: str(write_fd)},
    pass_fds=(write_fd,),
    preexec_fn=_die_with_parent(os.getpid()),
  )
  os.close(write_fd)
  received: list[tuple[int, float]] = []  # signals to this process, and when

  def note(signum, frame):
    received.append((signum, time.monotonic()))

  previous = {s: signal.signal(s, note) for s in STOPS}
  pipe = _ChildPipe(read_fd)
  forwarded = 0
  try:
    while child.poll() is None:
      if select.select([read_fd], [], [], 0.05)[0]:
        pipe.read()
      # A signal the child did not report within the grace came to this process alone.
      waiting = received[pipe.signals + forwarded :]
      if waiting and time.monotonic() - waiting[0][1] > GRACE_S and child.poll() is None:
        child.send_signal(waiting[0][0])
        forwarded += 1
    pipe.read_to_end()  # what the child wrote just before it ended
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
    os.close(read_fd)
  facts = pipe.facts
  code = child.returncode
  if code >= 0:
    return code
  if received and -code in STOPS:  # asked to stop, and stopped by it before it could save
    return 128 - code
  print(ended_by_signal(-code, facts), file=sys.stderr, flush=True)
  return 1


class _ChildPipe:
  """What the child writes to its supervisor: JSON lines of facts, and single bytes (a signal's
  number, from its C signal handler; JSON never holds a raw control character)."""

  def __init__(self, fd: int):
    self.fd, self.facts, self.signals, self._line = fd, {}, 0, b''
    # Never blocks: a process the child forked may still hold the write end after the child ended.
    os.set_blocking(fd, False)

  def read(self) -> bytes:
    try:
      chunk = os.read(self.fd, 4096)
    except BlockingIOError:
      return b''
    for byte in chunk:
      if byte == ord('\n'):
        with contextlib.suppress(ValueError):
          self.facts.update(json.loads(self._line))
        self._line = b''
      elif byte < 0x20:
        self.signals += byte in STOPS
      else:
        self._line += bytes([byte])
    return chunk

  def read_to_end(self) -> None:
    """Everything the pipe holds once the child has ended."""
    while self.read():
      pass


def _die_with_parent(parent: int):
  def set_death_signal():
    if sys.platform.startswith('linux'):
      import ctypes

      ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
      if os.getppid() != parent:  # the supervisor died before prctl
        os._exit(1)

  return set_death_signal


def ended_by_signal(signum: int, facts: dict) -> str:
  """The supervisor's line for a child that a signal ended, from what the child told it."""
  log = facts.get('log')
  if signum == signal.SIGABRT and log and _tail_says(log, 'another task died'):
    reason = "JAX's runtime aborted it: its coordinator found another process of the job dead"
  else:
    reason = f'it was ended by {signal.Signals(signum).name}'
  if log:
    reason += f'; details in {log}'
  return lost_the_job(facts.get('process'), facts.get('count'), facts.get('workdir'), reason)


def lost_the_job(process: int | None, count: int | None, workdir: str | None, reason: str) -> str:
  """The one line of a process that lost its job: which, why, the last committed step, what to
  do (a failed collective's line, mllm/train/peers.py, and the supervisor's)."""
  who = 'this process' if process is None else f'process {process} of {count}'
  last = 'no checkpoint is committed yet'
  if workdir:
    steps = committed_steps(workdir)
    if steps:
      last = f'the last committed checkpoint in {workdir} is step {steps[-1]}'
  return (
    f'error: {who} lost the job ({reason}); {last}; run the same command in every process '
    'again to resume from it'
  )


def _tail_says(path: str, words: str, size: int = 65536) -> bool:
  try:
    with open(path, 'rb') as f:
      f.seek(max(0, os.path.getsize(path) - size))
      return words.encode() in f.read()
  except OSError:
    return False


# ----------------------------------------------------------------------------------------------
# The child's side.
# ----------------------------------------------------------------------------------------------


def report_signals() -> None:
  """Under a supervisor: every signal this process gets with a Python handler (SIGINT always,
  SIGTERM once training installs its stop request) writes its number to the supervisor's pipe
  from the C handler, at once, however long the main thread is busy in XLA."""
  fd = os.environ.get(CHILD_FD)
  if fd is not None:
    os.set_blocking(int(fd), False)
    signal.set_wakeup_fd(int(fd))


def tell(**facts) -> None:
  """Send facts (process, count, workdir, log) to the supervisor, if any: one JSON line."""
  fd = os.environ.get(CHILD_FD)
  if fd is None:
    return
  with contextlib.suppress(OSError):  # the supervisor is gone, or the pipe is full
    os.write(int(fd), (json.dumps(facts) + '\n').encode())


def native_stderr_to(path: str) -> None:
  """Under a supervisor: file descriptor 2 (what C++ code writes: JAX's logs, an abort's stack
  dump) goes to `path`; Python's sys.stderr keeps writing to the terminal."""
  if os.environ.get(CHILD_FD) is None:
    return
  sys.stderr.flush()
  terminal = os.dup(2)
  log = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  os.dup2(log, 2)
  os.close(log)
  sys.stderr = os.fdopen(terminal, 'w', buffering=1, encoding='utf-8', errors='backslashreplace')
