"""A process of a multi-process job that loses another one ends in one line where Python gets the
chance: which process, the last committed checkpoint, the command to resume.

JAX's runtime notices a dead process in one of two ways:
- a collective in flight fails (gloo: 'Connection closed by peer'): a JaxRuntimeError in the
  training step, which launch.py turns into the line (`is_lost_peer`, `report_lost_peer`), exiting
  1 before JAX's own shutdown at exit, which would abort on the failed shutdown barrier;
- its coordinator misses the process's heartbeats and tells every other process's client, whose
  default answer is to abort the process from a C++ thread (exit 134, JAX's "Terminating process
  because the JAX distributed service detected fatal errors ... another task died" and a stack
  dump). That cannot be caught in the process: jaxlib's `get_distributed_runtime_client` takes a
  `missed_heartbeat_callback`, but calling it from Python ended in `std::bad_cast` and the same
  abort (jaxlib 0.12.0.1, 2026-11-27), and `jax.distributed.initialize` does not expose it. So
  launch.py runs each process of a job under a supervisor (mllm/supervisor.py), which prints
  the same line when the abort ends its child, whose stack dump went to the run log (`watch`).
Either way the relaunch resumes from the last committed checkpoint (docs/multi-host.md).
"""

from __future__ import annotations

import os
import re
import sys

from mllm import supervisor
from mllm.paths import RunDir

_WORKDIR: list[str] = []  # the run's workdir, once train() opened it


def watch(workdir: str) -> None:
  """Name the run whose last committed step the line reports; under a supervisor
  (mllm/supervisor.py), tell it this process's place and files and send native stderr to the
  run log, where JAX's abort would otherwise print its stack dump on the terminal."""
  import jax

  _WORKDIR[:] = [workdir]
  log = RunDir(workdir).run_log(jax.process_index())
  supervisor.tell(process=jax.process_index(), count=jax.process_count(), workdir=workdir, log=log)
  supervisor.native_stderr_to(log)


def message(reason: str) -> str:
  """The one line: this process, what was lost, the last committed step, what to do."""
  import jax

  workdir = _WORKDIR[0] if _WORKDIR else None
  return supervisor.lost_the_job(jax.process_index(), jax.process_count(), workdir, reason)


def is_lost_peer(err: BaseException) -> bool:
  """Whether a training step's error is a collective that lost its peer (several processes)."""
  import jax

  text = str(err)
  return jax.process_count() > 1 and any(
    words in text
    for words in ('Connection closed by peer', 'Connection reset by peer', 'heartbeat timeout')
  )


def report_lost_peer(err: BaseException) -> None:
  """The line for `err` (a collective's failure), then exit 1 before JAX's shutdown at exit."""
  reason = str(err).strip().splitlines()[0]
  reason = re.sub(r'\[[^\]]*\.cc:\d+\]\s*', '', reason)[:160]  # gloo's source locations
  print(message(f'a collective failed: {reason}'), file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(1)
