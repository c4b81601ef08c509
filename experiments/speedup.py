"""Tokens to reach the baseline's final loss: how much sooner a variant gets there (a suite with
`Suite.tokens_to_baseline`; its runs evaluate during training, `train.eval_every`).

For each table seed, the baseline's final eval loss is the target; a variant's eval curve of the
same seed reaches it at the first evaluation at or below it, interpolated linearly in steps
between that evaluation and the one before. The ratio to the baseline's own steps is what
modded-nanogpt's record history and "Muon is Scalable" (arXiv 2502.16982) report as a speed-up
(there: Muon ~1.5x fewer tokens than tuned AdamW at 124M).

A variant with a paper's ratio (`Suite.tokens_to_baseline_expect`) is a claim the overview
counts (`claims`): the per-seed ratios' mean with its paired CI (t on n − 1 df, simultaneous over
the suite's claims), judged against 1 (no speed-up) and the paper's ratio as a table row is.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from experiments import stats


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


@dataclasses.dataclass(frozen=True)
class Claim:
  variant: str
  expected: float  # the paper's ratio of steps (below 1: sooner)
  test: stats.Contrast | None  # the mean ratio − 1 over seeds, its own variance; None: not judged
  judgement: str  # a verdicts.CATEGORIES entry, or '' (not judged)
  cell: str

  @property
  def label(self) -> str:
    return f"{self.variant}, steps to the baseline's final loss"


def claims(suite, results: dict, *, evidence=None, family: int | None = None) -> list[Claim]:
  """Each variant of `suite.tokens_to_baseline_expect`: its ratio − 1 and CI at α / m over
  `family` tests (default: the suite's claims), judged against the paper's ratio − 1 as a row's
  effect is (verdicts.judge_effect: below 1 holding the paper's ratio agrees); a contradiction
  takes its diagnosis (`suite.diagnoses['variant: steps']`, recomputed). A seed that never got
  there, or under two seeds: not judged."""
  from experiments import verdicts
  from experiments.diagnosis import Evidence

  evidence = evidence or Evidence(None, (suite.name, results))
  read = []
  for variant, expected in suite.tokens_to_baseline_expect.items():
    by_seed = ratios(results, suite.baseline.name, variant)
    values = list(by_seed.values())
    why = (
      'under two seeds'
      if len(values) < 2
      else 'a seed never reached the baseline\'s loss'
      if None in values
      else ''
    )
    read.append((variant, expected, values, why))
  m = family or sum(not why for *_, why in read)
  out = []
  for variant, expected, values, why in read:
    if why:
      out.append(Claim(variant, expected, None, '', f'not judged: {why}'))
      continue
    mean, std = stats.mean_std(values)
    n = len(values)
    test = stats.Contrast(
      n=n, mean=mean - 1.0, se=std / math.sqrt(n), df=n - 1, source='own', diff_std=std
    )
    judgement = cell = verdicts.judge_effect(test, m, expected - 1.0)
    if judgement == 'contradicts':
      judgement, cell = verdicts.contradiction(suite, f'{variant}: steps', evidence)
    out.append(Claim(variant, expected, test, judgement, cell))
  return out


def claim_lines(suite, results: dict, *, evidence=None) -> list[str]:
  """results.md's list of the speed-up claims (`claims`), each with its ratio's CI, judged."""
  from experiments import verdicts

  found = claims(suite, results, evidence=evidence)
  judged = sum(c.test is not None for c in found)
  out = []
  for c in found:
    shown = ''
    if c.test is not None:
      low, high = (1.0 + x for x in c.test.ci(judged, verdicts.ALPHA))
      shown = f' {1.0 + c.test.mean:.2f}x [{low:.2f}, {high:.2f}] the steps:'
    out.append(f'- {c.variant}:{shown} {c.cell} (the paper: {c.expected:.2f}x)')
  if out:
    out = [
      '',
      "The paper's speed-up, as the mean over seeds of the steps to the baseline's final loss "
      'over its own, with a paired CI (t on n − 1 df) simultaneous over the '
      f'{judged} judged claims:',
      '',
    ] + out
  return out
