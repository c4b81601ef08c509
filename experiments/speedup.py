"""Tokens to reach the baseline's final loss: how much sooner a variant gets there (a suite with
`Suite.tokens_to_baseline`; its runs evaluate during training, `train.eval_every`).

For each table seed, the baseline's final eval loss is the target; a variant's eval curve of the
same seed reaches it at the first evaluation at or below it, interpolated linearly in steps
between that evaluation and the one before. The ratio to the baseline's own steps is what
modded-nanogpt's record history and "Muon is Scalable" (arXiv 2502.16982) report as a speed-up
(there: Muon ~1.5x fewer tokens than tuned AdamW at 124M).
"""

from __future__ import annotations

import math
import statistics


def steps_to_reach(curve: dict, target: float) -> float | None:
  """The step at which an eval curve ({'step': [...], 'loss': [...]}) first falls to `target`,
  linear between evaluations; None if it never does."""
  points = [(s, x) for s, x in zip(curve['step'], curve['loss']) if x is not None]
  before = None
  for step, loss in points:
    if math.isfinite(loss) and loss <= target:
      if before is None or not math.isfinite(before[1]) or before[1] == loss:
        return float(step)
      (s0, x0) = before
      return s0 + (step - s0) * (x0 - target) / (x0 - loss)
    before = (step, loss)
  return None


def ratios(results: dict, baseline: str, variant: str) -> dict[int, float | None]:
  """seed -> the variant's steps to the baseline's final eval loss / the baseline's steps (below
  1: sooner), for the seeds both finished with an eval curve; None where it never gets there."""
  runs = {(r['variant'], r['seed']): r for r in results['runs']}
  out = {}
  for (name, seed), run in sorted(runs.items()):
    base = runs.get((baseline, seed))
    if name != variant or base is None or 'eval_curve' not in run:
      continue
    if not math.isfinite(base['eval_loss']):
      continue
    reached = steps_to_reach(run['eval_curve'], base['eval_loss'])
    out[seed] = None if reached is None else reached / base['steps']
  return out


def lines(suite, results: dict) -> list[str]:
  """results.md's lines: per variant, the steps it takes to reach the baseline's final loss as a
  fraction of the baseline's, by seed."""
  baseline = suite.baseline.name
  out = []
  for v in suite.variants[1:]:
    by_seed = ratios(results, baseline, v.name)
    if not by_seed:
      continue
    reached = [r for r in by_seed.values() if r is not None]
    shown = ', '.join(f'{"never" if r is None else f"{r:.2f}"}' for r in by_seed.values())
    summary = (
      f'mean {statistics.fmean(reached):.2f}x the steps ({1 / statistics.fmean(reached):.2f}x '
      'sooner)'
      if reached and len(reached) == len(by_seed)
      else f'reached on {len(reached)} of {len(by_seed)} seeds'
    )
    out += [
      '',
      f"Tokens to {baseline}'s final eval loss: {v.name} gets there in {summary}; by seed: "
      f'{shown} (interpolated between evaluations, `train.eval_every`).',
    ]
  return out
