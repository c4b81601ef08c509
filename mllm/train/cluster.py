"""The processes of a job: joining a multi-process job (`jax.distributed`), and stopping all of
its processes at the same step when a signal reaches one of them."""

from __future__ import annotations

import os
import signal
import threading

import jax
import numpy as np

from mllm.checks import InputError
from mllm.supervisor import several_processes


def maybe_initialize_distributed() -> None:
  """`jax.distributed.initialize()` when the launcher started several processes.

  JAX reads the coordinator, process count and id itself from SLURM, Open MPI, Kubernetes
  JobSets and Cloud TPU pods; JAX_COORDINATOR_ADDRESS (with JAX_NUM_PROCESSES, JAX_PROCESS_ID)
  covers anything else.
  """
  env = os.environ
  if not several_processes(env) or jax.distributed.is_initialized():
    return
  # CPU devices of different processes exchange data over gloo (JAX's CPU default has no
  # cross-process collectives); GPUs and TPUs are not affected by this setting.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  # A process that dies (SIGKILL, a lost host) leaves the others blocked in a collective; JAX's
  # coordinator ends them once it has missed the dead one's heartbeats this long.
  timeout = env.get('MLLM_HEARTBEAT_TIMEOUT_S', '100')
  if not timeout.isdigit() or int(timeout) < 1:
    raise InputError(
      'MLLM_HEARTBEAT_TIMEOUT_S',
      timeout,
      'allowed: a whole number of seconds >= 1 (JAX\'s default: 100)',
    )
  jax.distributed.initialize(**explicit_cluster(env), heartbeat_timeout_seconds=int(timeout))


def explicit_cluster(env) -> dict:
  """initialize()'s arguments from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID
  (jax reads only the first itself; without the others it fails with 'Number of processes must
  be defined'); {} where a cluster JAX detects (SLURM, Open MPI, TPU pods) names the job."""
  address = env.get('JAX_COORDINATOR_ADDRESS')
  if not address:
    return {}
  values = {}
  for key, name in (('JAX_NUM_PROCESSES', 'num_processes'), ('JAX_PROCESS_ID', 'process_id')):
    value = env.get(key, '')
    if not value.isdigit():
      raise InputError(
        key,
        value or '(unset)',
        f'JAX_COORDINATOR_ADDRESS={address} starts '
        'a job of several processes; allowed: JAX_NUM_PROCESSES (a count) and '
        'JAX_PROCESS_ID (0 to that count - 1) set beside it in every process',
      )
    values[name] = int(value)
  if values['process_id'] >= values['num_processes']:
    raise InputError(
      'JAX_PROCESS_ID',
      values['process_id'],
      f"allowed: 0 to JAX_NUM_PROCESSES - 1 = {values['num_processes'] - 1}",
    )
  return {'coordinator_address': address, **values}


class StopRequest:
  """SIGTERM / SIGINT set a flag; the loop saves a checkpoint after the current step and returns.
  A second signal stops at once."""

  def __init__(self):
    self.signal = None
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    if self.signal is not None:
      raise KeyboardInterrupt
    self.signal = signal.Signals(signum).name

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def agreed(self) -> str | None:
    """The request as every process of the job sees it: a signal can reach them a step apart
    (or reach one only), and all must save the same step and leave the loop together, or the
    others would wait in the next step's collectives for ever."""
    if jax.process_count() == 1:
      return self.signal
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.array(self.signal is not None))
    if not np.any(flags):
      return None
    return self.signal or 'a signal to another process of the job'
