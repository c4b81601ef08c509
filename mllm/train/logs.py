"""Where a run's library output goes: Orbax's and JAX's loggers, tracebacks of background threads
and exceptions Python could only ignore (at interpreter shutdown) are written to the workdir's
run log, not the terminal. A fault then ends in the one line the entry point prints, and the
tracebacks stay in `run.log` for debugging (issue: a full disk printed two Orbax tracebacks and a
hundred lines of asyncio's "Event loop is closed" before its error line)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import traceback

import jax
from absl import logging as absl_logging

from mllm.paths import RunDir


class _LogFile:
  """The run log as a stream that never raises: the disk it is on may be the one that filled up
  (a log line that cannot be written is dropped, not turned into a second fault on stderr)."""

  def __init__(self, path: str):
    self.path, self.file = path, None  # opened at the first line: a quiet run leaves no file

  def write(self, text: str) -> int:
    try:
      if self.file is None:
        self.file = open(self.path, 'a', buffering=1)  # noqa: SIM115 (closed by close())
      return self.file.write(text)
    except Exception:  # OSError; or, at interpreter exit, a builtin already torn down
      return 0

  def flush(self) -> None:
    with contextlib.suppress(OSError):
      if self.file is not None:
        self.file.flush()

  def close(self) -> None:
    with contextlib.suppress(OSError):
      if self.file is not None:
        self.file.close()
    self.file = None  # a later line opens it again


def _from_orbax(record: logging.LogRecord) -> bool:
  """Whether an asyncio report is about one of Orbax's tasks (named in the message, or a frame of
  the exception's traceback inside Orbax)."""
  where = f'{os.sep}orbax{os.sep}'
  if where in record.getMessage():
    return True
  exc = record.exc_info[2] if record.exc_info else None  # frames' file names, no source read
  return exc is not None and any(where in f.f_code.co_filename for f, _ in traceback.walk_tb(exc))


class _OrbaxLeftovers(logging.Filter):
  """On asyncio's logger: its reports of Orbax's tasks ('Task exception was never retrieved', the
  sibling reads of a failed checkpoint read, finalized whenever their last reference goes: often
  at interpreter exit, after the run put logging back) go to the latest run's log, not stderr."""

  def __init__(self):
    super().__init__()
    self.stream = None

  def filter(self, record: logging.LogRecord) -> bool:
    try:  # a filter's exception would reach the code that logged (often at interpreter exit)
      if self.stream is None or not _from_orbax(record):
        return True
      text = logging.Formatter().format(record) + '\n'
    except Exception:
      return True
    self.stream.write(text)  # dropped if it cannot be written, as every run-log line (_LogFile)
    return False


_LEFTOVERS = _OrbaxLeftovers()
logging.getLogger('asyncio').addFilter(_LEFTOVERS)


def route_library_output(workdir: str):
  """Send library logging, threads' uncaught exceptions and unraisable exceptions to the run log
  from now on; returns a function that puts logging and the thread hook back.

  Unraisable exceptions and asyncio's reports of Orbax's tasks keep going to this run's log after
  it ends, until another run routes them: a failed checkpoint read leaves Orbax coroutines that
  Python finalizes whenever their last reference goes, often at interpreter exit, and each would
  print a traceback on stderr."""
  stream = _LogFile(RunDir(workdir).run_log(jax.process_index()))
  handler = absl_logging.get_absl_handler()
  saved = (handler.python_handler.stream, threading.excepthook)
  handler.python_handler.stream = (
    stream  # absl's: Orbax's logs, and the root logger's under app.run
  )

  def thread_hook(args):
    stream.write(f'uncaught in thread {args.thread.name if args.thread else "?"}:\n')
    traceback.print_exception(args.exc_type, args.exc_value, args.exc_traceback, file=stream)

  def unraisable_hook(args):
    stream.write(f'{args.err_msg or "Exception ignored"}: {args.object!r}\n')
    traceback.print_exception(args.exc_type, args.exc_value, args.exc_traceback, file=stream)

  threading.excepthook, sys.unraisablehook = thread_hook, unraisable_hook
  _LEFTOVERS.stream = stream

  def undo() -> None:
    handler.python_handler.stream, threading.excepthook = saved
    stream.close()

  return undo
