"""The machine a benchmark ran on, for the header of its results file."""

from __future__ import annotations

import platform

from experiments.provenance import cpu_model, host

__all__ = ['cpu_model', 'describe', 'host']


def describe() -> str:
  """'H100 (gpu; <cpu>, 16 cores: avx2 fma avx512f), jax 0.11.2, Python 3.12.3, 2026-11-23':
  device, host (experiments.provenance.host), versions, date."""
  import datetime

  import jax

  device = jax.devices()[0]
  return (
    f'{device.device_kind} ({jax.default_backend()}; {host()}), jax {jax.__version__}, '
    f'Python {platform.python_version()}, {datetime.date.today().isoformat()}'
  )
