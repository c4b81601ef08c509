"""A suite's results: results.json, results.md (the table: means ± std, each row's Δ and
verdict from experiments/verdicts.py, the lines around it from experiments/report_notes.py), the
plots and the TensorBoard log."""

from __future__ import annotations

import json
import math
import os

from experiments import (
  plots,
  report_notes,
  reproduce,
  speedup,
  stability,
  tensorboard,
  transfer,
  verdicts,
)
from experiments.diagnosis import Evidence
from experiments.run import resolve
from experiments.suite import Suite


def _cell(key: str, row: dict) -> str:
  if key not in row:
    return ''
  return 'n/a' if math.isnan(row[key]) else verdicts.EXTRA_COLUMNS[key][1].format(row[key])


def _name(suite: Suite, name: str) -> str:
  """The row's label: a starts_from variant says where its parameters come from."""
  variant = next(v for v in suite.variants if v.name == name)
  if not variant.starts_from:
    return name
  return f"{name} ({'fine-tuned' if variant.trains else 'evaluated'} from {variant.starts_from})"


def markdown(suite: Suite, results: dict, rows: list[dict]) -> str:
  """results.md's text: what the suite compares, one table row per variant, notes below."""
  extras = [
    k for k in verdicts.EXTRA_COLUMNS if k != suite.metric and any(k in row for row in rows)
  ]
  lines = report_notes.preamble(suite, results)
  lines += [
    '| variant | params | tokens/param | lr | mean ± std | Δ [simultaneous 95% CI] | '
    'p (Bonferroni) | could see | verdict | paper | vs paper | train tokens/s |'
    + ''.join(f' {verdicts.EXTRA_COLUMNS[k][0]} |' for k in extras),
    '|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---:|' + '---:|' * len(extras),
  ]
  lines += [_table_row(suite, row, extras) for row in rows]
  return '\n'.join(lines + report_notes.below(suite, results, rows)) + '\n'


def _table_row(suite: Suite, row: dict, extras: list[str]) -> str:
  """One variant's line of the table; a variant without a finished run says why."""
  if not row['n']:
    what = row.get('verdict', 'no finished run')
    return f"| {_name(suite, row['variant'])} | | | | {what} | | | | | | | |"
  params = f"{row['params']:,}"
  if row['active_params'] != row['params']:
    params += f" ({row['active_params']:,} active)"
  test = row.get('test')
  versus = '' if row['versus'] == suite.baseline.name else f"vs {row['versus']}: "
  own = ' (own σ)' if test and test.source == 'own' else ''
  delta = (
    f"{versus}{test.mean:+.4f} [{row['ci_all'][0]:+.4f}, {row['ci_all'][1]:+.4f}]{own}"
    if test
    else ('baseline' if row['variant'] == suite.baseline.name else '')
  )
  p = f"{row['p_adjusted']:.3g}" if test else ''
  seen = f"±{row['detectable']:.3f}" if test else ''
  paper = '' if row['paper'] is None else f"{row['paper']:.3f}"
  spread = f" ± {row['std']:.4f}" if row['n'] > 1 else ' (1 seed)'
  speed = '—' if row['tokens_per_s'] is None else f"{row['tokens_per_s']:,.0f}"
  per_param = f"{row['tokens'] / row['active_params']:.2f}" if row.get('tokens') else ''
  return (
    f"| {_name(suite, row['variant'])} | {params} | {per_param} | {_lr_cell(row)} | "
    f"{row['mean']:.4f}{spread} | {delta} | {p} | {seen} | {row.get('verdict', '')} | "
    f"{paper} | {row['agreement']} | {speed} |" + ''.join(f' {_cell(k, row)} |' for k in extras)
  )


def _lr_cell(row: dict) -> str:
  """The run's learning rate (→ the peak it ran at where the parametrization scaled it); a tuned
  rate at an edge of its grid says which (the best may lie beyond it)."""
  if row.get('lr') is None:
    return ''
  edge = report_notes.EDGES.get(row.get('lr_edge'), '')
  peak = row.get('peak_lr')
  scaled = '' if peak is None or math.isclose(peak, row['lr']) else f' → {peak:.3g}'
  return f"{row['lr']:.3g}{scaled}{edge}"


def _add_peak_rates(suite: Suite, preset: str, rows: list[dict]) -> None:
  """Each row's peak rate (`peak_lr`), where its config scales the given rate (the standard
  parametrization's width rule: suites give theirs as they are, a row may keep the rule)."""
  from mllm.layers.parametrization import learning_rate_scale

  for row in rows:
    if row.get('lr') is None:
      continue
    variant = next(v for v in suite.variants if v.name == row['variant'])
    # The row's rate is the one its runs trained with, derived rates already applied (a variant
    # that sets its rate from the config's, e.g. 4x, must not scale it a second time here).
    row['peak_lr'] = row['lr'] * learning_rate_scale(resolve(suite, variant, preset, 0).model)


def write(suite: Suite, results: dict, out: str) -> str:
  """Write <out>/<suite>/results.json, results.md, the plots and the TensorBoard log; the
  markdown's path."""
  folder = os.path.join(out, suite.name)
  os.makedirs(folder, exist_ok=True)
  # Whether the table's code versions pair (experiments/reproduce.py), from every check.
  checks = reproduce.read_all(out) + reproduce.recorded(out)
  pairing = reproduce.pairing(results['runs'], checks)
  elsewhere = report_notes.tuned_elsewhere(results, checks)
  checks = reproduce.relevant(results['runs'], checks)
  results = {**results, **({'reproduced': checks} if checks else {})}
  results = {**results, **({'tuned_elsewhere': elsewhere} if elsewhere else {})}
  results = {**results, **({'versions_pair': pairing} if pairing else {})}
  # Every suite's results the diagnoses read, loaded once for the rows and the claims.
  evidence = Evidence(out, (suite.name, results))
  rows = verdicts.summarize(suite, results, evidence=evidence)
  _add_peak_rates(suite, results['preset'], rows)
  with open(os.path.join(folder, 'results.json'), 'w') as f:
    json.dump(results, f, indent=1)
  effects = {r['variant']: verdicts.paper_effect(suite, r, rows) for r in rows}
  figures = plots.write_all(suite, results, rows, folder, effects)
  if suite.stability:
    figures.append(stability.curves(suite, results, os.path.join(folder, 'stability.png')))
    figures = [f for f in figures if f]
  tensorboard.write(suite, results, folder, final=('eval_loss', *verdicts.EXTRA_COLUMNS))
  text = markdown(suite, results, rows)
  if suite.lr_transfer:
    text += '\n'.join(transfer.lines(suite, results)) + '\n'
    text += '\n'.join(transfer.claim_lines(suite, results, evidence=evidence)) + '\n'
  if suite.tokens_to_baseline:
    text += '\n'.join(speedup.lines(suite, results)) + '\n'
    text += '\n'.join(speedup.claim_lines(suite, results, evidence=evidence)) + '\n'
  if suite.stability:
    vocab = vocab_size(suite, results)
    text += '\n'.join(stability.lines(suite, results, vocab)) + '\n'
    text += '\n'.join(stability.claim_lines(suite, results, vocab, evidence=evidence)) + '\n'
  text += ''.join(f'\n![{os.path.basename(p)}]({os.path.basename(p)})\n' for p in figures)
  path = os.path.join(folder, 'results.md')
  with open(path, 'w') as f:
    f.write(text)
  return path


def vocab_size(suite: Suite, results: dict) -> int:
  """The vocabulary the suite's runs trained with (the stability claims' L0 = ln V)."""
  return resolve(suite, suite.baseline, results['preset'], 0).model.vocab_size
