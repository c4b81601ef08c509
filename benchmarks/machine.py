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
