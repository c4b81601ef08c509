"""The machine a benchmark ran on, for the header of its results file."""

from __future__ import annotations

import platform


def cpu_model() -> str:
  """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` knows."""
  try:
    with open('/proc/cpuinfo') as f:
      return next(line.split(':', 1)[1].strip() for line in f if line.startswith('model name'))
  except (OSError, StopIteration):
    return platform.processor() or platform.machine()


def describe() -> str:
  """'H100 (gpu; <cpu>, 16 cores), jax 0.11.2, Python 3.12.3, 2026-11-23': device, versions, date."""
  import datetime
  import os

  import jax

  device = jax.devices()[0]
  return (
    f'{device.device_kind} ({jax.default_backend()}; {cpu_model()}, {os.cpu_count()} '
    f'cores), jax {jax.__version__}, Python {platform.python_version()}, '
    f'{datetime.date.today().isoformat()}'
  )
