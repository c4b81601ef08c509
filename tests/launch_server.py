"""`python launch.py ARGS` (or `python -m MODULE ARGS`) as a forked child of one warm process, for
tests that run it many times.

Python's start and the imports of JAX and Flax are ~1.4 s of each launch.py run that stops at a bad
flag; test_bad_inputs.py runs 140+. The server imports them once, single-threaded, then forks a
child per request. The child is a real process: its own argv, environment, working directory, file
descriptors 0-2 (stdin /dev/null, stdout and stderr to files) and exit status; launch.py runs as
`__main__` with nothing of it imported before, and an uncaught exception ends it as it would end
`python launch.py` (a traceback on stderr, status 1). What the fork cannot redo is read at import:
variables such as JAX_PLATFORMS, so `run` starts a fresh interpreter when one of them changes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

from conftest import ROOT

# Read when JAX is imported (its config flags), so a child forked after the import ignores them.
IMPORT_TIME_PREFIXES = ('JAX_', 'XLA_', 'TF_', 'PYTHON')

SERVER = r'''
import gc, json, os, runpy, sys, threading
sys.path.insert(0, ROOT)
os.chdir(ROOT)
import absl.app, absl.flags, jax, flax.nnx  # what every launch.py run imports first
import mllm.checks, mllm.config, mllm.config_keys, mllm.paths, mllm.validation
import mllm.train  # Orbax and Grain: ~0.5 s of every run that reaches the data or a checkpoint
import experiments.runner  # `python -m experiments`: matplotlib, the generation API, the scheduler
assert threading.active_count() == 1, threading.enumerate()  # fork() keeps only this thread
# Out of the collector's reach: a child's exit otherwise collects (and so copies, page by page)
# this whole heap, 0.65 s of each request; 0.19 s with it (what gc.freeze is for).
gc.freeze()
print('READY', flush=True)
while line := sys.stdin.readline():
  request = json.loads(line)
  pid = os.fork()
  if pid:
    print(pid, flush=True)  # the client kills it past its timeout
  else:  # the child: becomes `python launch.py ARGS`
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request['stdout'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = os.open(request['stderr'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
      os.dup2(fd, target)
    os.environ.clear()
    os.environ.update(request['env'])
    if request['module']:  # what `python -m MODULE` does: sys.argv[0] becomes its __main__'s path
      sys.argv = ['-m', *request['args']]
      runpy.run_module(request['module'], run_name='__main__', alter_sys=True)
    else:
      sys.argv = ['launch.py', *request['args']]
      runpy.run_path('launch.py', run_name='__main__')
    sys.exit(0)  # what falling off the end of a script does
  _, status = os.waitpid(pid, 0)
  print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
'''


def _kill(pid: int) -> None:
  with contextlib.suppress(ProcessLookupError):  # it ended as the timer fired
    os.kill(pid, signal.SIGKILL)


@dataclass
class Result:
  """subprocess.run's fields that the tests read."""

  returncode: int
  stdout: str
  stderr: str


def run_fresh(args: list[str], env: dict, timeout: float = 300, module: str = '') -> Result:
  """`python launch.py ARGS` (`python -m MODULE ARGS` with a module) in a new interpreter, what
  LaunchServer.run stands for."""
  proc = subprocess.run(
    [sys.executable, *(['-m', module] if module else ['launch.py']), *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  return Result(proc.returncode, proc.stdout, proc.stderr)


class LaunchServer:
  def __init__(self):
    env = dict(os.environ, JAX_PLATFORMS='cpu')
    self._env = env
    self._proc = subprocess.Popen(
      [sys.executable, '-c', SERVER.replace('ROOT', repr(ROOT))],
      cwd=ROOT,
      env=env,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
    )
    ready = self._proc.stdout.readline()
    assert ready == 'READY\n', ready
    self._dir = tempfile.mkdtemp(prefix='launch-server-')

  def run(
    self, args: list[str], env_extra: dict | None = None, timeout: float = 300, module: str = ''
  ) -> Result:
    """launch.py (or `-m module`) with `args` and the environment plus `env_extra`, as
    subprocess.run gives it."""
    env = dict(self._env, **(env_extra or {}))
    if any(k.startswith(IMPORT_TIME_PREFIXES) for k in (env_extra or {})):
      return run_fresh(args, env, timeout, module)
    out, err = os.path.join(self._dir, 'stdout'), os.path.join(self._dir, 'stderr')
    request = {'args': args, 'env': env, 'stdout': out, 'stderr': err, 'module': module}
    self._proc.stdin.write(json.dumps(request) + '\n')
    self._proc.stdin.flush()
    pid = int(self._proc.stdout.readline())
    # A timer, not select(): the status line may already sit in the pipe reader's buffer.
    fired = threading.Event()
    watchdog = threading.Timer(timeout, lambda: (fired.set(), _kill(pid)))
    watchdog.start()
    returncode = json.loads(self._proc.stdout.readline())
    watchdog.cancel()
    if fired.is_set():
      raise subprocess.TimeoutExpired(['launch.py', *args], timeout)
    with open(out) as f_out, open(err) as f_err:
      return Result(returncode, f_out.read(), f_err.read())

  def close(self):
    self._proc.stdin.close()
    self._proc.wait(timeout=60)
    shutil.rmtree(self._dir, ignore_errors=True)


_shared: LaunchServer | None = None


def shared() -> LaunchServer:
  """This process's server, started on first use and closed when the process exits."""
  global _shared
  if _shared is None:
    import atexit

    _shared = LaunchServer()
    atexit.register(_shared.close)
  return _shared
