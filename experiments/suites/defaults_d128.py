"""The `defaults` grid (init × learning rate) at a second width: d_model 128 (8 heads of 16),
everything else the default config's. A default should hold at more than one width."""

import dataclasses

from experiments.suites import defaults

SUITE = dataclasses.replace(
  defaults.SUITE,
  name='defaults_d128',
  description='the default config at d_model 128 over init × learning rate',
  base='configs/rope_swiglu.py:d_model=128',
)
