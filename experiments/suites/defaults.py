"""The default learning rate and initialisation, chosen together: the default config as `make
train` runs it (configs/rope_swiglu.py, d_model 256, 500 steps of 8 × 256 tokens) over a grid of
initialisation × learning rate, each pair a row on the same paired seeds (defaults_d128: the same
grid at a second width). The baseline row is the pair configs/base.py ships. Run with
--no-tune_lr (the rate is the thing measured)."""

from experiments.suite import Suite, Variant
from experiments.suites._presets import GPU, TINY

INITS = ('fan_in', 'fixed')
# A factor-2 grid; 1.5e-3 was added when fan_in's first seed put its best at 3e-3, the lowest
# rate of the first grid (2026-11-26).
RATES = (1.5e-3, 3e-3, 6e-3, 1.2e-2)
SHIPPED = ('fan_in', 3e-3)  # configs/base.py's pair when the grid was run (2026-11-26)


def grid(inits=INITS, rates=RATES, shipped=SHIPPED) -> tuple[Variant, ...]:
  """One variant per (init, lr), the shipped pair first (the baseline)."""
  pairs = [shipped] + [(i, r) for i in inits for r in rates if (i, r) != shipped]
  return tuple(
    Variant(
      f'{init}-lr{lr:g}',
      overrides={'model.init': init, 'train.learning_rate': lr},
      tune=False,
    )
    for init, lr in pairs
  )


SUITE = Suite(
  name='defaults',
  description='the default config over init × learning rate: which pair is the default',
  base='configs/rope_swiglu.py',
  variants=grid(),
  # cpu: the default config unchanged, so the rows are what `make train` trains.
  presets={'tiny': TINY, 'cpu': {}, 'gpu': GPU},
)
