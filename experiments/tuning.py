"""Per-variant learning-rate tuning: the learning rate is a nuisance parameter of every
architecture comparison, so each variant gets its own best one before the table compares them
(Google's Deep Learning Tuning Playbook; Wortsman et al. 2023 plot final loss against learning
rate, one curve per intervention).

A variant's grid is log-spaced around its own configured rate (`LrGrid`: 5 points a factor 2
apart span 16x). The tuning runs use seeds of their own (`tuning_seeds`, from 1000), never the
table's paired seeds 0..S-1, so the table's runs are not the ones the rate was picked on. Where the
best rate sits at an edge of the grid, the grid grows one point past that edge (up to
`max_widen` times a side); a diverged run is a data point (an infinite loss), not a failure.

A refinement (`--refine_lr=VARIANT,...`) then halves the grid's step around a named variant's best
(rates best / √ratio, best, best · √ratio) on more tuning seeds (`--refine_seeds`), for the rows
whose verdict hangs on the rate's resolution; the table runs at the refined best.

A suite that trains another suite's rows longer (`lr_from`) takes their tuned rates; its
`retune_lr` rows are tuned again at its own budget on BUDGET_GRID, centred on the borrowed rate,
since the best rate of a run need not stay where it was at a quarter of its tokens.
"""

from __future__ import annotations

import dataclasses
import math

TUNING_SEED_BASE = 1000  # tuning seeds are 1000, 1001, ...; the table's are 0, 1, ...


@dataclasses.dataclass(frozen=True)
class LrGrid:
  points: int = 5  # log-spaced rates around the variant's own learning rate
  ratio: float = 2.0  # between neighbours: 5 points span 2^4 = 16x
  max_widen: int = 2  # points added past an edge where the best rate sits, per side

  def __post_init__(self):
    if self.points < 2 or not self.ratio > 1 or self.max_widen < 0:
      raise ValueError(
        f'LrGrid(points={self.points}, ratio={self.ratio}, max_widen='
        f'{self.max_widen}); allowed: points >= 2, ratio > 1, max_widen >= 0'
      )

  def steps(self) -> list[int]:
    """The grid's exponents k (rate = center · ratio^k), centred on 0."""
    low = -(self.points // 2)
    return list(range(low, low + self.points))

  def lr(self, center: float, k: float) -> float:
    """center · ratio^k, rounded to 12 significant digits, so that the same rate reached by two
    routes (3e-3 · √2² and 6e-3) is one config, one run."""
    return float(f'{center * self.ratio**k:.12g}')


# Around a rate borrowed from a shorter run: √2 apart, widened past an edge twice (a factor 2).
BUDGET_GRID = LrGrid(points=3, ratio=math.sqrt(2), max_widen=2)


def refine(losses: dict[float, list[float]]) -> float | None:
  """The best rate of a refinement: {rate: eval losses over the refinement seeds} -> the rate with
  the lowest mean (a diverged seed: infinitely bad; ties to the lower rate); None if empty."""
  if not losses:
    return None
  return min(sorted(losses), key=lambda lr: (_mean(losses[lr]), lr))


def tuning_seeds(n: int) -> list[int]:
  return [TUNING_SEED_BASE + i for i in range(n)]


def _mean(losses: list[float]) -> float:
  """The mean over seeds; a diverged (NaN) seed makes the point infinitely bad."""
  return (
    math.inf
    if not losses or any(not math.isfinite(x) for x in losses)
    else (sum(losses) / len(losses))
  )


@dataclasses.dataclass(frozen=True)
class Choice:
  best: int | None  # exponent of the best rate; None when nothing finished
  edge: str | None  # 'low' / 'high': the best is the lowest / highest rate tried
  widen: int | None  # the exponent to try next (past that edge), or None: done


def choose(losses: dict[int, list[float]], grid: LrGrid) -> Choice:
  """The best exponent from {k: eval losses over the tuning seeds}, whether it sits at an edge,
  and the next point to try. Ties go to the lower rate; if every point diverged, the lowest is
  'best' and the grid widens downwards."""
  tried = sorted(losses)
  if not tried:
    return Choice(None, None, None)
  best = min(tried, key=lambda k: (_mean(losses[k]), k))
  edge = 'low' if best == tried[0] else 'high' if best == tried[-1] else None
  first = grid.steps()
  widen = None
  if edge == 'low' and first[0] - tried[0] < grid.max_widen:
    widen = tried[0] - 1
  elif edge == 'high' and tried[-1] - first[-1] < grid.max_widen:
    widen = tried[-1] + 1
  return Choice(best, edge, widen)
