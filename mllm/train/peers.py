"""A process of a multi-process job that loses another one ends in one line where Python gets the
chance: which process, the last committed checkpoint, the command to resume.

JAX's runtime notices a dead process in one of two ways:
- a collective in flight fails (gloo: 'Connection closed by peer'): a JaxRuntimeError in the
  training step, which launch.py turns into the line (`is_lost_peer`, `report_lost_peer`), exiting
  1 before JAX's own shutdown at exit, which would abort on the failed shutdown barrier;
- its coordinator misses the process's heartbeats and tells every other process's client, whose
  default answer is to abort the process from a C++ thread (exit 134, JAX's "Terminating process
  because the JAX distributed service detected fatal errors ... another task died" and a stack
  dump). That cannot be caught here: jaxlib's `get_distributed_runtime_client` takes a
  `missed_heartbeat_callback`, but calling it from Python ended in `std::bad_cast` and the same
  abort (jaxlib 0.12.0.1, 2026-11-27), and `jax.distributed.initialize` does not expose it.
Either way the relaunch resumes from the last committed checkpoint (docs/multi-host.md).
"""

from __future__ import annotations

import os
import re
import sys

_WORKDIR: list[str] = []  # the run's workdir, once train() opened it


def watch(workdir: str) -> None:
  """Name the run whose last committed step the line reports."""
  _WORKDIR[:] = [workdir]


def message(reason: str) -> str:
  """The one line: this process, what was lost, the last committed step, what to do."""
  import jax

  from mllm.train.checkpoint import committed_steps

  last = 'no checkpoint is committed yet'
  if _WORKDIR:
    steps = committed_steps(_WORKDIR[0])
    if steps:
      last = f'the last committed checkpoint in {_WORKDIR[0]} is step {steps[-1]}'
  return (
    f'error: process {jax.process_index()} of {jax.process_count()} lost the job ({reason}); '
    f'{last}; run the same command in every process again to resume from it'
  )


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
