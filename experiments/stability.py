"""The stability harness (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer
training instabilities", arXiv 2309.14322): a suite with `Suite.stability` sweeps each variant's
learning rate over its tuning grid (two decades in `suites/stability.py`) and results.md and
stability.png report, per variant and rate, what their Figures 1-4 plot:

- the final eval loss, a diverged run marked;
- the largest attention logit q·kᵀ·scale at the end (attention-logit growth, Fig. 2; the
  evaluation step measures it, mllm/train/step.py), on a log axis;
- the output's mean log Z at the end (output-logit divergence, Fig. 4);

and each variant's LR sensitivity (their Section 3.1): the mean over the rates tried of
min(loss(η), L0) − min_η loss(η), L0 the loss at initialisation (here ln V, the uniform
predictor's, which a small-init model starts at); a diverged rate counts L0.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from experiments import stats
from experiments.plots import finish, plt


def _mean(values: list) -> float:
  """The mean of a grid point's per-seed values; NaN if any is missing or not finite."""
  if not values or any(v is None or not math.isfinite(v) for v in values):
    return math.nan
  return float(np.mean(values))


def lr_sensitivity(points: list[dict], initial_loss: float) -> float | None:
  """Wortsman et al. 2023, Sec. 3.1: E_η[min(loss(η), L0)] − min_η loss(η) over the grid
  `points` (results.json's tuning points: a diverged or non-finite rate counts L0); None with
  fewer than two rates or no finite loss."""
  losses = [_mean(p['eval_loss']) for p in points if p['eval_loss']]
  capped = [min(x, initial_loss) if math.isfinite(x) else initial_loss for x in losses]
  if len(capped) < 2 or all(not math.isfinite(x) for x in losses):
    return None
  return float(np.mean(capped) - min(capped))


def initial_loss(vocab_size: int) -> float:
  """L0: ln V, the loss of the uniform predictor (a model with a small init starts there)."""
  return math.log(vocab_size)


def lines(suite, results: dict, vocab_size: int) -> list[str]:
  """results.md's stability section: per variant, its LR sensitivity and, per rate, the final
  loss, largest attention logit and log Z (the mean over the tuning seeds)."""
  tuning = results.get('tuning') or {}
  if not tuning:
    return []
  L0 = initial_loss(vocab_size)
  out = [
    '',
    f'Stability (Wortsman et al. 2023): per rate, the final eval loss, the largest attention '
    f'logit and the output log Z on the tuning seeds; LR sensitivity = mean over the rates of '
    f'min(loss, L0) − the best loss, L0 = ln V = {L0:.3f} (a diverged rate counts L0).',
    '',
    '| variant | LR sensitivity | rates diverged | per rate: loss / max attention logit / log Z |',
    '|---|---:|---:|---|',
  ]
  for name, t in tuning.items():
    points = sorted((p for p in t['points'] if p['eval_loss']), key=lambda p: p['lr'])
    sens = lr_sensitivity(points, L0)
    diverged = sum(not math.isfinite(_mean(p['eval_loss'])) for p in points)
    cells = '; '.join(
      f"{p['lr']:.3g}: {_fmt(_mean(p['eval_loss']), '.3f', 'diverged')}"
      f" / {_fmt(_mean(p.get('max_attention_logit') or []), '.1f')}"
      f" / {_fmt(_mean(p.get('eval_log_z') or []), '.2f')}"
      for p in points
    )
    shown = '' if sens is None else f'{sens:.3f}'
    out.append(f'| {name} | {shown} | {diverged} of {len(points)} | {cells} |')
  return out


# What a stability suite's claims compare with the baseline (Suite.stability_claims: variant ->
# the measures the paper says the variant lowers), as results.md names them.
MEASURES = {
  'lr_sensitivity': 'LR sensitivity',
  'max_attention_logit': 'largest attention logit at the highest rate both finished',
  'abs_log_z': '|log Z| at the highest rate both finished',
}


def _at_top_rate(points_a: list[dict], points_b: list[dict], key: str):
  """(a's, b's) mean of `key` at the highest rate both have finite, or None."""

  def by_rate(points):
    out = {}
    for p in points:
      y = _mean(p.get(key) or [])
      if math.isfinite(y) and math.isfinite(_mean(p['eval_loss'])):
        out[p['lr']] = y
    return out

  a, b = by_rate(points_a), by_rate(points_b)
  shared = sorted(set(a) & set(b))
  return None if not shared else (a[shared[-1]], b[shared[-1]], shared[-1])


# A claim's value against the baseline's, with the noise of each: the measure as the table runs
# record it, and the scale its spread is measured on (the attention logit spans decades: logs).
_NOISE_OF = {
  'lr_sensitivity': ('eval_loss', 'eval loss', False),
  'max_attention_logit': ('max_attention_logit', 'ln largest attention logit', True),
  'abs_log_z': ('eval_log_z', 'log Z', False),
}


def noise(results: dict, measure: str) -> tuple[float, int]:
  """(σ, df) of `measure` between seeds: the table runs' (each row at its best rate) spread
  about their row's mean, pooled over the rows, on the scale the claim compares."""
  key, _, logs = _NOISE_OF[measure]
  by_row: dict[str, list[float]] = {}
  for run in results.get('runs', ()):
    value = run.get(key)
    if value is None or not math.isfinite(value) or (logs and value <= 0):
      continue
    by_row.setdefault(run['variant'], []).append(math.log(value) if logs else value)
  squares = sum(float(((np.asarray(v) - np.mean(v)) ** 2).sum()) for v in by_row.values())
  df = sum(len(v) - 1 for v in by_row.values())
  return (math.sqrt(squares / df), df) if df else (math.nan, 0)


def sensitivity_se(sigma: float, rates: int, base_rates: int) -> float:
  """The standard error of a difference of two LR sensitivities, each the mean of `rates`
  independent losses of std σ minus their minimum: with the best rate fixed,
  S = Σ_{i≠j} L_i / n − (1 − 1/n) L_j, so Var S = σ² (1 − 1/n); a capped or diverged rate
  varies less, so this errs wide."""
  return sigma * math.sqrt((1 - 1 / rates) + (1 - 1 / base_rates))


@dataclasses.dataclass(frozen=True)
class Claim:
  variant: str
  measure: str  # a key of MEASURES
  ours: float
  baseline: float
  at: float | None  # the rate a one-rate measure is read at
  test: stats.Contrast | None  # ours − baseline on the claim's scale; None: no noise measured
  judgement: str  # a verdicts.CATEGORIES entry, or '' (not judged)
  cell: str  # the judgement in words

  @property
  def label(self) -> str:
    return f'{self.variant}, {MEASURES[self.measure]}'


def claims(
  suite, results: dict, vocab_size: int, *, evidence=None, family: int | None = None
) -> list[Claim]:
  """Each claim of `suite.stability_claims` read off the tuning points (one seed per rate): the
  variant's measure against the baseline's, tested on the noise of that measure between the
  table's seeds (`noise`; at each row's best rate, where high rates are likely noisier), at
  α / m over `family` tests (default: the suite's claims). The paper says lower: 'agrees'
  where the simultaneous CI of the difference is below zero, a contradiction (its diagnosis,
  `suite.diagnoses['variant: measure']`, recomputed from `evidence`) where above, else 'no
  difference detected'."""
  from experiments import verdicts
  from experiments.diagnosis import Evidence

  tuning = results.get('tuning') or {}
  base = tuning.get(suite.baseline.name)
  if not base:
    return []
  evidence = evidence or Evidence(None, (suite.name, results))
  L0 = initial_loss(vocab_size)
  read = []
  for variant, measures in suite.stability_claims.items():
    for measure in measures:
      if variant not in tuning:
        continue
      mine = tuning[variant]['points']
      if measure == 'lr_sensitivity':
        got = (lr_sensitivity(mine, L0), lr_sensitivity(base['points'], L0), None)
        if None in got[:2]:
          continue
      else:
        key = 'eval_log_z' if measure == 'abs_log_z' else measure
        got = _at_top_rate(mine, base['points'], key)
        if got is None:
          continue
        if measure == 'abs_log_z':
          got = (abs(got[0]), abs(got[1]), got[2])
      read.append((variant, measure, mine, *got))
  m = family or len(read)
  out = []
  for variant, measure, mine, ours, theirs, at in read:
    sigma, df = noise(results, measure)
    logs = _NOISE_OF[measure][2]
    test = None
    if df and (not logs or min(ours, theirs) > 0):
      if measure == 'lr_sensitivity':
        n = lambda points: sum(bool(p['eval_loss']) for p in points)  # noqa: E731
        se = sensitivity_se(sigma, n(mine), n(base['points']))
      else:
        se = sigma * math.sqrt(2)
      diff = math.log(ours / theirs) if logs else ours - theirs
      test = stats.Contrast(n=1, mean=diff, se=se, df=df, source='pooled', diff_std=math.nan)
    if test is None:
      judgement, cell = '', 'not judged: no table seeds to measure the noise'
    elif not test.significant(m, verdicts.ALPHA):
      seen = test.detectable(m, verdicts.ALPHA)
      judgement, cell = 'no difference detected', f'no difference detected (could see ±{seen:.3f})'
    elif test.mean < 0:
      judgement, cell = 'agrees', 'agrees'
    else:
      judgement, cell = verdicts.contradiction(suite, f'{variant}: {measure}', evidence)
    out.append(Claim(variant, measure, ours, theirs, at, test, judgement, cell))
  return out


def claim_lines(suite, results: dict, vocab_size: int, *, evidence=None) -> list[str]:
  """results.md's list of the claims (`claims`), each with its difference, CI and judgement."""
  from experiments import verdicts

  found = claims(suite, results, vocab_size, evidence=evidence)
  out = []
  for c in found:
    where = '' if c.at is None else f' (at {c.at:.3g})'
    shown = ''
    if c.test is not None:
      low, high = c.test.ci(len(found), verdicts.ALPHA)
      on = ' on a log scale' if c.measure == 'max_attention_logit' else ''
      shown = f'; difference{on} {c.test.mean:+.3f} [{low:+.3f}, {high:+.3f}]'
    out.append(
      f'- {c.variant}: {MEASURES[c.measure]}{where} {c.ours:.3f} against '
      f"{suite.baseline.name}'s {c.baseline:.3f}{shown}: {c.cell} (the paper: lower)"
    )
  if out:
    sigmas = ', '.join(
      f'{_NOISE_OF[m][1]} σ {s:.4f} ({df} df)'
      for m in dict.fromkeys(c.measure for c in found)
      for s, df in [noise(results, m)]
      if df
    )
    out = [
      '',
      "The paper's stability claims, read off the tuning seeds (one per rate) and tested on the "
      "noise between the table's seeds at each row's best rate (pooled; high rates are likely "
      'noisier, so a claim near its bound is weak): simultaneous 95% CIs over the '
      f'{len(found)} claims (Bonferroni, t on the pooled df). Noise: {sigmas or "none measured"}; '
      'an LR sensitivity difference has standard error σ·√((1 − 1/n) + (1 − 1/n′)) over n and '
      "n′ rates, a one-rate value's σ·√2.",
      '',
    ] + out
  return out


def _fmt(x: float, spec: str, missing: str = '—') -> str:
  return format(x, spec) if math.isfinite(x) else missing


def curves(suite, results: dict, path: str) -> str | None:
  """stability.png: final eval loss, largest attention logit (log axis) and output log Z against
  the learning rate (log axis), one line per variant over its tuning grid; x: diverged."""
  tuning = results.get('tuning') or {}
  if not tuning:
    return None
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
  panels = (
    ('eval_loss', 'final eval loss'),
    ('max_attention_logit', 'largest attention logit'),
    ('eval_log_z', 'output log Z (eval)'),
  )
  for ax, (key, label) in zip(axes, panels):
    for name, t in tuning.items():
      points = sorted((p for p in t['points'] if p['eval_loss']), key=lambda p: p['lr'])
      ok = [(p['lr'], _mean(p.get(key) or [])) for p in points]
      ok = [(lr, y) for lr, y in ok if math.isfinite(y)]
      (line,) = ax.plot(*zip(*ok), 'o-', mfc='none', lw=1.2, label=name) if ok else (None,)
      bad = [p['lr'] for p in points if not math.isfinite(_mean(p['eval_loss']))]
      if bad and key == 'eval_loss' and line is not None:
        top = max(y for _, y in ok)
        ax.plot(bad, [top] * len(bad), 'x', color=line.get_color(), ms=8)
    ax.set_xscale('log')
    if key == 'max_attention_logit':
      ax.set_yscale('log')
    ax.set(xlabel='peak learning rate', ylabel=label)
    ax.grid(alpha=0.3)
  axes[0].set_title(f'suite {suite.name}: stability against the learning rate (x: diverged)')
  return finish(fig, axes[-1], path)
