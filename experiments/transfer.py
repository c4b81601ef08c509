"""Does the best learning rate transfer across widths? (Tensor Programs V, Yang et al. 2022,
Figure 1.) For a suite with `Suite.lr_transfer` ({family: {variant: width}}), results.md gets
each family's tuned best rate per width and the slope of log2(best rate) against log2(width),
fitted by least squares: about 0 where the rate transfers (µP), about −1 where it halves per
doubling (the standard parametrization under Adam, TP5 Sec. 1). A best rate at an edge of its
grid is marked: the true best lies beyond it and the slope is then a bound.
"""

from __future__ import annotations

import numpy as np

# |slope| under this reads as flat: less than half a factor 2 per doubling of the width.
FLAT = 0.5


def slope(widths: list[int], rates: list[float]) -> float | None:
  """The least-squares slope of log2(rate) against log2(width); None below two widths."""
  if len(widths) < 2:
    return None
  return float(np.polyfit(np.log2(widths), np.log2(rates), 1)[0])


def lines(suite, results: dict) -> list[str]:
  tuning = results.get('tuning') or {}
  out = []
  for family, widths in suite.lr_transfer.items():
    found = [
      (width, tuning[name]['best_lr'], tuning[name].get('edge'))
      for name, width in sorted(widths.items(), key=lambda kv: kv[1])
      if name in tuning and tuning[name].get('best_lr') is not None
    ]
    if not found:
      continue
    fitted = slope([w for w, _, _ in found], [lr for _, lr, _ in found])
    cells = ', '.join(f"d{w}: {lr:.3g}{' (edge)' if edge else ''}" for w, lr, edge in found)
    if fitted is None:
      reading = 'one width so far'
    else:
      shape = 'flat' if abs(fitted) < FLAT else ('falls' if fitted < 0 else 'rises')
      reading = f'slope {fitted:+.2f} per doubling: {shape}'
    per_doubling = '' if fitted is None else f' (x{2**fitted:.2f} per doubling of the width)'
    out += ['', f'Best rate by width, {family}: {cells}; {reading}{per_doubling}.']
  return out
