"""A suite's figures: loss curves with a band over seeds, and final loss against training FLOPs."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use('Agg')  # files only, no display
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.patches import Patch


def finish(fig, ax, path: str, legend: bool = True) -> str:
  ax.grid(alpha=0.3)
  if legend:
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def _mean_and_band(
  ax, name: str, curves: list[dict], min_points: int, style: str = '-', **line_kw
) -> bool:
  """One variant's curves ({'step': x, 'loss': y} per seed) at the x they share: the mean,
  shaded min–max band over seeds; False (nothing drawn) below `min_points` shared points."""
  xs = sorted(set.intersection(*(set(c['step']) for c in curves)))
  if len(xs) < min_points:
    return False
  losses = np.array([[dict(zip(c['step'], c['loss']))[x] for x in xs] for c in curves])
  (line,) = ax.plot(
    xs, losses.mean(0), style, lw=1.2, label=f'{name} ({len(curves)} seeds)', **line_kw
  )
  if len(curves) > 1:
    ax.fill_between(xs, losses.min(0), losses.max(0), color=line.get_color(), alpha=0.2)
  return True


def loss_curves(suite, results: dict, path: str) -> str | None:
  """Train loss against step per variant: the mean over seeds, shaded min–max band. A fine-tuning
  variant's curve continues its parent's, from the parent's last step."""
  fig, ax = plt.subplots(figsize=(7, 4.5))
  drawn = False
  last_step = {
    (r['variant'], r['seed']): r['curve']['step'][-1]
    for r in results['runs']
    if r.get('curve') and r['curve']['step']
  }
  for variant in suite.variants:
    runs = [r for r in results['runs'] if r['variant'] == variant.name and r.get('curve')]
    if not runs:
      continue
    offsets = [last_step.get((variant.starts_from, r['seed']), 0) for r in runs]
    curves = [
      {'step': [s + o for s in r['curve']['step']], 'loss': r['curve']['loss']}
      for r, o in zip(runs, offsets)
    ]
    drawn |= _mean_and_band(ax, variant.name, curves, min_points=1)
  if not drawn:
    plt.close(fig)
    return None
  ax.set(xlabel='step', ylabel='train loss', title=f'suite {suite.name}: train loss')
  return finish(fig, ax, path)


def pareto(suite, rows: list[dict], path: str) -> str | None:
  """Final metric (mean ± std over seeds) against training FLOPs per run, one point per variant."""
  points = [r for r in rows if r['n'] and r.get('train_flops')]
  if not points:
    return None
  fig, ax = plt.subplots(figsize=(6, 4.5))
  for row in points:
    ax.errorbar(row['train_flops'], row['mean'], yerr=row['std'], fmt='o', capsize=3)
    ax.annotate(
      row['variant'],
      (row['train_flops'], row['mean']),
      fontsize=8,
      xytext=(4, 4),
      textcoords='offset points',
    )
  flops = [row['train_flops'] for row in points]
  if max(flops) > 10 * min(flops):  # a log axis only when compute spans a decade
    ax.set_xscale('log')
  else:
    ax.ticklabel_format(axis='x', style='sci', scilimits=(0, 0))
  ax.set(
    xlabel='training FLOPs per run',
    ylabel=suite.metric,
    title=f'suite {suite.name}: {suite.metric} vs compute',
  )
  return finish(fig, ax, path, legend=False)


# Each verdict category's colour (verdicts.CATEGORIES); the contradictions share red, and a row
# the literature says nothing of is black.
JUDGEMENT_COLOURS = {
  'agrees': 'tab:green',
  'agrees in direction, not size': 'tab:olive',
  "rules out the paper's effect": 'tab:blue',
  'no difference detected': 'tab:gray',
  'cannot resolve at this power': 'tab:orange',
  'contradicts': 'tab:red',
  '': 'black',
}
CLIP = 3.0  # a CI half-width beyond CLIP x the rows' median is cut at the axis (a diverged seed's)


def forest_rows(rows: list[dict], effects: dict[str, float | None]) -> list[dict]:
  """What `deltas` draws, top row first: each tested row's label, Δ, simultaneous CI (cut to
  Δ ± CLIP x the rows' median half-width, `clipped` saying which ends were cut), the smallest Δ
  it could see, the paper's gap scaled to our reference (`effects`, None without one) and its
  verdict category's colour."""
  tested = [r for r in rows if r.get('test') is not None]
  if not tested:
    return []
  widths = [(r['ci_all'][1] - r['ci_all'][0]) / 2 for r in tested]
  cap = CLIP * float(np.median(widths))
  reference = tested[0]['versus']
  drawn = []
  for row in tested:
    mean, (low, high) = row['test'].mean, row['ci_all']
    category = row.get('judgement', '')
    drawn.append(
      {
        'label': row['variant'] + ('' if row['versus'] == reference else f" vs {row['versus']}"),
        'mean': mean,
        'low': max(low, mean - cap),
        'high': min(high, mean + cap),
        'clipped': (low < mean - cap, high > mean + cap),
        'seen': row['detectable'],
        'effect': effects.get(row['variant']),
        'colour': JUDGEMENT_COLOURS[
          'contradicts' if category.startswith('contradicts') else category
        ],
        'category': category,
      }
    )
  return drawn


def deltas(suite, rows: list[dict], path: str, effects: dict[str, float | None]) -> str | None:
  """A forest plot of the table: each row's Δ to its reference with its simultaneous 95% CI,
  coloured by its verdict against the literature; shaded, the smallest Δ the row could see (80%
  power); ◇, the paper's gap scaled to our reference's loss where the paper gives one."""
  drawn = forest_rows(rows, effects)
  if not drawn:
    return None
  fig, ax = plt.subplots(figsize=(7.5, 1.4 + 0.42 * len(drawn)))
  span = max(max(abs(d['low']), abs(d['high']), abs(d['effect'] or 0.0)) for d in drawn) * 1.08
  for i, d in enumerate(drawn):
    y = len(drawn) - 1 - i
    seen = min(d['seen'], span)
    ax.fill_betweenx([y - 0.32, y + 0.32], -seen, seen, color='0.88', lw=0)
    ax.errorbar(
      d['mean'],
      y,
      xerr=[[d['mean'] - d['low']], [d['high'] - d['mean']]],
      fmt='o',
      color=d['colour'],
      capsize=3,
    )
    for end, cut, marker in ((d['low'], d['clipped'][0], '<'), (d['high'], d['clipped'][1], '>')):
      if cut:
        ax.plot(end, y, marker, color=d['colour'], ms=6)
    if d['effect'] is not None:
      ax.plot(d['effect'], y, 'D', mfc='none', mec='black', ms=7)
  ax.axvline(0.0, color='black', lw=0.8)
  ax.set_yticks(range(len(drawn)), [d['label'] for d in reversed(drawn)], fontsize=8)
  ax.set_xlim(-span, span)
  ax.set(
    xlabel=f'Δ {suite.metric} vs {rows[0]["variant"]} (lower is better)',
    title=f'suite {suite.name}: Δ with simultaneous 95% CIs',
  )
  shown = dict.fromkeys(
    'contradicts' if d['category'].startswith('contradicts') else d['category'] for d in drawn
  )
  handles = [
    Line2D([], [], marker='o', ls='', color=JUDGEMENT_COLOURS[c], label=c or 'no paper claim')
    for c in shown
  ]
  handles.append(Patch(color='0.88', label='could see (80% power)'))
  if any(any(d['clipped']) for d in drawn):
    handles.append(Line2D([], [], marker='>', ls='', color='black', label='CI cut here'))
  if any(d['effect'] is not None for d in drawn):
    handles.append(
      Line2D([], [], marker='D', ls='', mfc='none', mec='black', label="the paper's gap")
    )
  ax.legend(handles=handles, fontsize=7, loc='best')
  return finish(fig, ax, path, legend=False)


def loss_vs_context(suite, results: dict, path: str) -> str | None:
  """Validation loss against evaluation context (k × the training context L, log axis): the mean
  over seeds with a min–max band. k = 1 is the run's own eval_loss when it has no loss_at_1L."""
  fig, ax = plt.subplots(figsize=(7, 4.5))
  drawn = False
  for variant in suite.variants:
    runs = [r for r in results['runs'] if r['variant'] == variant.name]
    factors = sorted(
      {
        int(k[len('loss_at_') : -1])
        for r in runs
        for k in r
        if k.startswith('loss_at_') and k.endswith('L')
      }
    )
    if not factors:
      continue
    if 1 not in factors:
      factors = [1] + factors
    table = np.array(
      [
        [r.get(f'loss_at_{k}L', r['eval_loss'] if k == 1 else np.nan) for k in factors]
        for r in runs
      ],
      dtype=float,
    )
    keep = ~np.isnan(table).any(0)  # n/a lengths (learned positions past L) are left out
    if not keep.any():
      continue
    ks = np.array(factors)[keep]
    (line,) = ax.plot(
      ks, table[:, keep].mean(0), marker='o', lw=1.2, label=f'{variant.name} ({len(runs)} seeds)'
    )
    if len(runs) > 1:
      ax.fill_between(
        ks, table[:, keep].min(0), table[:, keep].max(0), color=line.get_color(), alpha=0.2
      )
    drawn = True
  if not drawn:
    plt.close(fig)
    return None
  ax.set_xscale('log', base=2)
  ax.set(
    xlabel='evaluation context / training context L',
    ylabel='validation loss',
    title=f'suite {suite.name}: loss vs context length',
  )
  return finish(fig, ax, path)


def grad_norms(suite, results: dict, path: str) -> str | None:
  """Each layer's FFN gradient norm (mean over seeds, log axis) at initialisation and after
  training, as Xiong et al. 2020 Fig. 3. Variants whose initial curves coincide (same
  architecture, another learning rate) share one line in the first panel."""
  curves = {}
  for when in ('init', 'final'):
    for variant in suite.variants:
      found = [
        r[f'ffn_grad_norm_{when}']
        for r in results['runs']
        if r['variant'] == variant.name and f'ffn_grad_norm_{when}' in r
      ]
      if found:
        curves.setdefault(when, []).append((variant.name, np.mean(found, axis=0)))
  if not curves:
    return None
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=False)
  for ax, when in zip(axes, ('init', 'final')):
    merged = {}
    for name, curve in curves.get(when, []):
      key = tuple(np.round(curve, 6)) if when == 'init' else name
      merged.setdefault(key, (curve, []))[1].append(name)
    for curve, names in merged.values():
      label = names[0] if len(names) == 1 else f'{names[0]} (+{len(names) - 1} same init)'
      ax.plot(np.arange(1, len(curve) + 1), curve, marker='o', lw=1.2, label=label)
    ax.set_yscale('log')
    ax.set(
      xlabel='layer',
      ylabel='‖∂loss/∂W_ffn‖',
      title=f"{'at initialisation' if when == 'init' else 'after training'}",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
  fig.suptitle(f'suite {suite.name}: FFN gradient norm per layer')
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def lr_sensitivity(suite, results: dict, path: str) -> str | None:
  """Final eval loss against learning rate (log axis) on the tuning seeds, one curve per variant
  (Wortsman et al. 2023, Fig. 1): the mean over seeds, each variant's chosen rate filled; a
  diverged point is an x on the top edge."""
  tuning = results.get('tuning') or {}
  finite = [
    loss
    for t in tuning.values()
    for p in t['points']
    for loss in p['eval_loss']
    if np.isfinite(loss)
  ]
  if not finite:
    return None
  top = max(finite) + 0.05 * (max(finite) - min(finite) or 1.0)
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, t in tuning.items():
    points = [p for p in t['points'] if p['eval_loss']]
    ok = [p for p in points if all(np.isfinite(p['eval_loss']))]
    (line,) = ax.plot(
      [p['lr'] for p in ok],
      [np.mean(p['eval_loss']) for p in ok],
      'o-',
      lw=1.2,
      mfc='none',
      label=name,
    )
    bad = [p['lr'] for p in points if not all(np.isfinite(p['eval_loss']))]
    if bad:
      ax.plot(bad, [top] * len(bad), 'x', color=line.get_color(), ms=8)
    best = [p for p in ok if t['best_lr'] is not None and np.isclose(p['lr'], t['best_lr'])]
    if best:
      ax.plot([best[0]['lr']], [np.mean(best[0]['eval_loss'])], 'o', color=line.get_color())
    fine = [p for p in (t.get('refined') or {}).get('points', []) if p['eval_loss']]
    if fine:  # the half-step refinement, on its own seeds: squares, the chosen one filled
      ax.plot(
        [p['lr'] for p in fine],
        [np.mean(p['eval_loss']) for p in fine],
        's:',
        color=line.get_color(),
        mfc='none',
        lw=1,
      )
  ax.set_xscale('log')
  ax.set(
    xlabel='peak learning rate',
    ylabel='eval loss (tuning seeds)',
    title=f'suite {suite.name}: learning-rate sensitivity\n(x: diverged; filled: chosen; '
    'squares: refined)',
  )
  return finish(fig, ax, path)


def loss_vs_tokens(suite, results: dict, path: str) -> str | None:
  """Eval loss against training tokens (log axis) per variant, from runs evaluated during
  training (train.eval_every): the mean over seeds, shaded min–max band. Where two curves cross,
  one variant overtakes the other at that budget (within one schedule: the points before the end
  are at a learning rate not yet decayed)."""
  fig, ax = plt.subplots(figsize=(7, 4.5))
  drawn = False
  for variant in suite.variants:
    runs = [r for r in results['runs'] if r['variant'] == variant.name and r.get('eval_curve')]
    if not runs:
      continue
    per_step = runs[0]['tokens'] / runs[0]['steps']
    curves = [
      {'step': [s * per_step for s in r['eval_curve']['step']], 'loss': r['eval_curve']['loss']}
      for r in runs
    ]
    drawn |= _mean_and_band(ax, variant.name, curves, min_points=2, style='o-', ms=3)
  if not drawn:
    plt.close(fig)
    return None
  ax.set_xscale('log')
  ax.set(
    xlabel='training tokens',
    ylabel='eval loss',
    title=f'suite {suite.name}: eval loss against tokens',
  )
  return finish(fig, ax, path)


def write_all(
  suite, results: dict, rows: list[dict], folder: str, effects: dict | None = None
) -> list[str]:
  """Every figure the suite's runs can make, in results.md's order (`effects`: each row's
  paper gap for the forest plot); the paths written."""
  made = [
    deltas(suite, rows, os.path.join(folder, 'deltas.png'), effects or {}),
    loss_curves(suite, results, os.path.join(folder, 'loss_curves.png')),
    lr_sensitivity(suite, results, os.path.join(folder, 'lr_sensitivity.png')),
    loss_vs_context(suite, results, os.path.join(folder, 'loss_vs_context.png')),
    loss_vs_tokens(suite, results, os.path.join(folder, 'loss_vs_tokens.png')),
    grad_norms(suite, results, os.path.join(folder, 'grad_norms.png')),
    pareto(suite, rows, os.path.join(folder, 'pareto.png')),
  ]
  return [p for p in made if p]
