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

import math

import numpy as np

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


def claim_lines(suite, results: dict, vocab_size: int) -> list[str]:
  """Each claim of `suite.stability_claims` read off the tuning points: the variant's measure
  against the baseline's, 'agrees' where it is lower (one tuning seed per rate: no interval)."""
  tuning = results.get('tuning') or {}
  base = tuning.get(suite.baseline.name)
  if not base:
    return []
  L0 = initial_loss(vocab_size)
  out = []
  claims = [(v, m) for v, measures in suite.stability_claims.items() for m in measures]
  for variant, measure in claims:
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
    where = '' if got[2] is None else f' (at {got[2]:.3g})'
    verdict = 'agrees' if got[0] < got[1] else 'contradicts'
    out.append(
      f'- {variant}: {MEASURES[measure]}{where} {got[0]:.3f} against {suite.baseline.name}\'s '
      f'{got[1]:.3f}: {verdict} (the paper: lower)'
    )
  if out:
    out = ['', "The paper's stability claims, read off the tuning seeds (no interval):"] + out
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
