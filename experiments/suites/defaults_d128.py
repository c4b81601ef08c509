"""The `defaults` grid (init × learning rate) at a second width: d_model 128 (8 heads of 16),
everything else the default config's. A default should hold at more than one width."""

from experiments.suite import Suite
from experiments.suites._defaults import grid
from experiments.suites._presets import GPU, TINY

SUITE = Suite(
  name='defaults_d128',
  description='the default config at d_model 128 over init × learning rate',
  base='configs/rope_swiglu.py:d_model=128',
  variants=grid(),
  presets={'tiny': TINY, 'cpu': {}, 'gpu': GPU},
)
