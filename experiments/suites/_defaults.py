"""The default learning rate and initialisation, chosen together: every (init, lr) pair of a grid
on the default config (`defaults`) and at a second width (`defaults_d128`), each pair a row on
the same paired seeds. The baseline row is the pair configs/base.py ships; a row better than it on
both widths is the better default. Run with --no-tune_lr (the rate is the thing measured)."""

from experiments.suite import Variant

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
