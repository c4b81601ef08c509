"""The default config as `make train` runs it (configs/rope_swiglu.py, d_model 256, 500 steps of
8 × 256 tokens), over a grid of initialisation × learning rate: which pair should be the default
(experiments/suites/_defaults.py)."""

from experiments.suite import Suite
from experiments.suites._defaults import grid
from experiments.suites._presets import GPU, TINY

SUITE = Suite(
  name='defaults',
  description='the default config over init × learning rate: which pair is the default',
  base='configs/rope_swiglu.py',
  variants=grid(),
  # cpu: the default config unchanged, so the rows are what `make train` trains.
  presets={'tiny': TINY, 'cpu': {}, 'gpu': GPU},
)
