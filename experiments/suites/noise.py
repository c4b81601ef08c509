"""The seed-to-seed spread of the default config: what every other suite's differences are
measured against (≥ 5 seeds)."""

from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS

SUITE = Suite(
  name='noise',
  description='configs/rope_swiglu.py as is, several seeds: the noise floor',
  base='configs/rope_swiglu.py',
  variants=(Variant('default'),),
  presets=PRESETS,
  seeds=5,
)
