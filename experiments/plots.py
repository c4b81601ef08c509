"""A suite's figures: loss curves with a band over seeds, and final loss against training FLOPs."""
from __future__ import annotations

import os

import matplotlib

matplotlib.use('Agg')  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def loss_curves(suite, results: dict, path: str) -> str | None:
  """Train loss against step per variant: the mean over seeds, shaded min–max band."""
  fig, ax = plt.subplots(figsize=(7, 4.5))
  drawn = False
  for variant in suite.variants:
    curves = [r['curve'] for r in results['runs'] if r['variant'] == variant.name and r.get('curve')]
    if not curves:
      continue
    steps = sorted(set.intersection(*(set(c['step']) for c in curves)))
    losses = np.array([[dict(zip(c['step'], c['loss']))[s] for s in steps] for c in curves])
    line, = ax.plot(steps, losses.mean(0), label=f'{variant.name} ({len(curves)} seeds)', lw=1.2)
    if len(curves) > 1:
      ax.fill_between(steps, losses.min(0), losses.max(0), color=line.get_color(), alpha=0.2)
    drawn = True
  if not drawn:
    plt.close(fig)
    return None
  ax.set(xlabel='step', ylabel='train loss', title=f'suite {suite.name}: train loss')
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def pareto(suite, rows: list[dict], path: str) -> str | None:
  """Final metric (mean ± std over seeds) against training FLOPs per run, one point per variant."""
  points = [r for r in rows if r['n'] and r.get('train_flops')]
  if not points:
    return None
  fig, ax = plt.subplots(figsize=(6, 4.5))
  for row in points:
    ax.errorbar(row['train_flops'], row['mean'], yerr=row['std'], fmt='o', capsize=3)
    ax.annotate(row['variant'], (row['train_flops'], row['mean']), fontsize=8,
                xytext=(4, 4), textcoords='offset points')
  flops = [row['train_flops'] for row in points]
  if max(flops) > 10 * min(flops):  # a log axis only when compute spans a decade
    ax.set_xscale('log')
  else:
    ax.ticklabel_format(axis='x', style='sci', scilimits=(0, 0))
  ax.set(xlabel='training FLOPs per run', ylabel=suite.metric,
         title=f'suite {suite.name}: {suite.metric} vs compute')
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def write_all(suite, results: dict, rows: list[dict], folder: str) -> list[str]:
  made = [loss_curves(suite, results, os.path.join(folder, 'loss_curves.png')),
          pareto(suite, rows, os.path.join(folder, 'pareto.png'))]
  return [p for p in made if p]
