"""Every suite's verdicts against the literature in one table: experiments/results/overview.md.

    python -m experiments.overview [--out=experiments/results] [--reports]

Reads each suite's results.json (whatever has finished) and recomputes its rows with
verdicts.summarize, corrected over the whole project: Bonferroni over every test of every suite at
once (each suite's noise pooled over its own rows), simultaneous CIs and detectable effects at
that family's size. Each row with a literature expectation lands in one of verdicts.CATEGORIES.
Diagnosis suites (`Suite.diagnoses_of`) are scored like the others (a contradiction they find is
a contradiction, counted), and also listed as the evidence they are. The README's Results
section opens with the totals.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from experiments import (
  provenance,
  report,
  report_notes,
  speedup,
  stability,
  transfer,
  verdicts,
)
from experiments.diagnosis import Evidence
from experiments.suite import Suite, available, load_suite

COLUMNS = verdicts.CATEGORIES
RULES_OUT = "rules out the paper's effect"


def protocol(results: dict, suite: Suite | None = None) -> str:
  if suite is not None and not any(v.tune for v in suite.variants):
    return 'lr is a row (grid)'
  if results.get('tuning') or results.get('lr_from'):
    return 'tuned lr'
  return "baseline's lr (old)"


def _known(suite: Suite, results: dict) -> dict:
  """results without runs of variants the suite no longer has."""
  known = {v.name for v in suite.variants}
  return {**results, 'runs': [r for r in results['runs'] if r['variant'] in known]}


def project_family(loaded: list[tuple[Suite, dict]]) -> verdicts.Family:
  """The family of every test of every suite in `loaded` together: the table rows' and the
  claims'."""
  rows = sum(
    'test' in r for suite, results in loaded for r in verdicts.measured_rows(suite, results)
  )
  return verdicts.Family(rows + sum(len(_claims(s, r)) for s, r in loaded))


def _claims(suite: Suite, results: dict, family: verdicts.Family | None = None, evidence=None):
  """The suite's tested claims apart from its rows (a stability sweep's, experiments/stability.py;
  a best rate's slope against width, experiments/transfer.py; a speed-up in steps,
  experiments/speedup.py) under `family` (default: the suite's claims alone), their diagnoses
  read from `evidence` (default: this suite's results alone)."""
  m = family.m if family else None
  found = []
  if suite.stability:
    vocab = report.vocab_size(suite, results)
    found += stability.claims(suite, results, vocab, evidence=evidence, family=m)
  if suite.lr_transfer_expect:
    found += transfer.claims(suite, results, evidence=evidence, family=m)
  if suite.tokens_to_baseline_expect:
    found += speedup.claims(suite, results, evidence=evidence, family=m)
  return [c for c in found if c.test is not None]


def tally(suite: Suite, results: dict, family: verdicts.Family | None = None, out=None) -> dict:
  """The suite's counts per category (under `family`; default: its own table's), its rows
  that are not plain agreements, how many verdicts the project-wide adjustment changed, and how
  many code versions its runs come from."""
  results = _known(suite, results)
  evidence = Evidence(out, (suite.name, results))
  rows = verdicts.summarize(suite, results, evidence=evidence, family=family)
  table_rows = verdicts.summarize(suite, results, evidence=evidence)
  own = {r['variant']: r.get('verdict') for r in table_rows}
  table_counts = dict.fromkeys(COLUMNS, 0)
  for row in table_rows:
    if row['judgement']:
      table_counts[row['judgement']] += 1
  counts = dict.fromkeys(COLUMNS, 0)
  notes = {c: [] for c in COLUMNS}
  for row in rows:
    if row['judgement']:
      counts[row['judgement']] += 1
      notes[row['judgement']].append(f"`{suite.name}` {row['variant']}: {row['agreement']}")
  claims = _claims(suite, results, family, evidence)
  own_claims = {c.label: c for c in _claims(suite, results, None, evidence)}
  for claim in own_claims.values():
    table_counts[claim.judgement] += 1
  for claim in claims:
    counts[claim.judgement] += 1
    notes[claim.judgement].append(f"`{suite.name}` {claim.label}: {claim.cell}")
  return {
    'suite': suite.name,
    'protocol': protocol(results, suite),
    'seeds': results.get('seeds'),
    'rows': len(rows),
    'claims': len(claims),
    'counts': counts,
    'table_counts': table_counts,
    'tests': sum('test' in r for r in rows) + len(claims),
    'noise': _noise(rows, table_rows),
    'notes': notes,
    'changed': [
      f"`{suite.name}` {r['variant']}: {own[r['variant']]} in its table, {r['verdict']} "
      'project-wide'
      for r in rows
      if 'test' in r and own[r['variant']] != r['verdict']
    ]
    + [
      f"`{suite.name}` {c.label}: {own_claims[c.label].judgement} in its table, {c.judgement} "
      'project-wide'
      for c in claims
      if own_claims[c.label].judgement != c.judgement
    ],
    'code_versions': len(provenance.by_version(results['runs'])),
    # Checked by experiments.reproduce to draw the same (one group): the rows pair as draws.
    'versions_pair': len((results.get('versions_pair') or {}).get('groups', ())) == 1,
  }


def _noise(rows: list[dict], table_rows: list[dict]) -> dict:
  """The suite's pooled σ and df, and the smallest Δ a row could see (80% power) at the project's
  and at the table's family: one value for the pooled rows, each own-variance row apart."""
  tested = [r for r in rows if 'test' in r]
  if not tested:
    return {}
  table = {r['variant']: r for r in table_rows}
  # The default noise family's pool; a row of another family (Variant.noise) is listed apart.
  main = [r for r in tested if not r.get('noise')] or tested
  pooled = [r for r in main if r['test'].source == 'pooled']
  pool = main[0]['pool']
  return {
    'sigma': pool.sigma,
    'df': pool.df,
    'tokens_per_param': [
      r['tokens'] / r['active_params'] for r in rows if r.get('tokens') and r.get('active_params')
    ],
    'project': max((r['detectable'] for r in pooled), default=None),
    'table': max((table[r['variant']]['detectable'] for r in pooled), default=None),
    'own': [
      (r['variant'], r['detectable'], table[r['variant']]['detectable'])
      for r in tested
      if r['test'].source == 'own' or r not in main
    ],
  }


def load(out: str, name: str) -> tuple[Suite, dict] | None:
  """(training suite `name`, its results.json under `out` without runs of variants it no longer
  has); None for a benchmark suite or one without results."""
  suite = load_suite(name)
  path = os.path.join(out, name, 'results.json')
  if not isinstance(suite, Suite) or not os.path.exists(path):
    return None
  with open(path) as f:
    return suite, _known(suite, json.load(f))


def finished(out: str) -> list[tuple[Suite, dict]]:
  """load()'s (suite, results) of every training suite that has results under `out`."""
  return [found for name in available() if (found := load(out, name)) is not None]


def collect(out: str) -> tuple[list[dict], list[dict]]:
  """(the scored suites' tallies under the project-wide family, the diagnosis suites: what each
  re-measures)."""
  loaded = [(s, r) for s, r in finished(out) if not s.checks_method_of]
  diagnoses = []
  for suite, results in loaded:
    if suite.diagnoses_of:
      diagnoses.append(
        {
          'suite': suite.name,
          'of': suite.diagnoses_of,
          'rows': [v.name for v in suite.variants],
          'seeds': results.get('seeds'),
          'finished': len(results['runs']),
          'planned': sum(len(results.get(k, [])) for k in ('runs', 'failed', 'pending')),
        }
      )
  family = project_family(loaded)
  return [tally(s, r, family, out) for s, r in loaded], diagnoses


def _sentence(totals: dict) -> str:
  contradict = sum(v for c, v in totals.items() if c.startswith('contradicts'))
  return (
    f"{totals['agrees']} agree, {totals['agrees in direction, not size']} agree in direction "
    f"but not in size, {totals[RULES_OUT]} rule out the paper's effect, "
    f"{totals['no difference detected']} detect no difference, "
    f"{totals['cannot resolve at this power']} cannot resolve the paper's effect at their power, "
    f"{contradict} contradict it ({totals['contradicts, diagnosed']} diagnosed, "
    f"{totals['contradicts, unexplained']} unexplained after the checks their rows recompute, "
    f"{totals['contradicts, diagnosis not supported']} with a diagnosis the runs no longer "
    f"support, {totals['contradicts, undiagnosed']} not diagnosed yet)"
  )


def _noise_rows(tallies: list[dict]) -> list[str]:
  """The table of each suite's pooled noise and the smallest Δ its rows could see."""
  lines = [
    '| suite | tokens/param | seeds | pooled σ (df) | could see: its table | could see: project '
    '| rows with their own variance (could see: project, table) |',
    '|---|---:|---:|---:|---:|---:|---|',
  ]
  for t in tallies:
    noise = t['noise']
    if not noise:
      continue
    per_param = noise['tokens_per_param']
    per_param = report_notes.tokens_per_param(per_param, short=True) if per_param else ''
    sigma = f"{noise['sigma']:.4f} ({noise['df']})" if noise['df'] else '—'
    own = ', '.join(f'{v} (±{p:.3g}, ±{q:.3g})' for v, p, q in noise['own'])
    seen = ['' if noise[k] is None else f'±{noise[k]:.3f}' for k in ('table', 'project')]
    lines.append(
      f"| `{t['suite']}` | {per_param} | {t['seeds']} | {sigma} | {seen[0]} | {seen[1]} | {own} |"
    )
  return lines


def markdown(tallies: list[dict], diagnoses: list[dict] = ()) -> str:
  totals = {c: sum(t['counts'][c] for t in tallies) for c in COLUMNS}
  per_table = {c: sum(t['table_counts'][c] for t in tallies) for c in COLUMNS}
  tests = sum(t['tests'] for t in tallies)
  lines = [
    '# Verdicts against the literature, every suite',
    '',
    f'Of {sum(totals.values())} rows and claims where the literature states a direction or a '
    "size (a paper's number, or a stated expectation, against the row's reference; a claim: "
    "what a paper says of a suite's sweep apart from its rows, e.g. a lower LR sensitivity, a "
    'best rate flat across widths, fewer steps to the baseline\'s loss), '
    f'corrected over the whole project (Bonferroni over all {tests} tests of every suite at '
    "once, each suite's noise pooled over its rows; simultaneous CIs and detectable effects at "
    f'that family size): {_sentence(totals)}.',
    '',
    f"Corrected over each suite's own table instead, as each results.md is: {_sentence(per_table)}.",
    '',
    "Generated by `python -m experiments.overview` from each suite's results.json; the table "
    'counts rows corrected over the project. Diagnosis suites are scored like the others: what '
    'they find against the literature counts.',
    '',
    '| suite | protocol | seeds | rows | code versions | '
    + ' | '.join(c.replace('contradicts, ', 'contradicts: ') for c in COLUMNS)
    + ' |',
    '|---|---|---:|---:|---:|' + '---:|' * len(COLUMNS),
  ]
  for t in tallies:
    mixed = ' (checked: they pair)' if t['versions_pair'] else ' (mixed)'
    versions = str(t['code_versions']) + (mixed if t['code_versions'] > 1 else '')
    claims = f" + {t['claims']} claims" if t.get('claims') else ''
    lines.append(
      f"| [`{t['suite']}`]({t['suite']}/results.md) | {t['protocol']} | {t['seeds']} "
      f"| {t['rows']}{claims} | {versions} | "
      + ' | '.join(str(t['counts'][c]) for c in COLUMNS)
      + ' |'
    )
  lines += [
    '',
    'What each table could see (tables under '
    f'{report_notes.EARLY_TRAINING:g} tokens per parameter are early training, where rankings still '
    'move): the smallest Δ a row detects with 80% power (noncentral t) at '
    "its table's level (0.05 / its tests) and at the project's (0.05 / "
    f'{tests}), from the pooled σ; a row set apart from the pool (its own paired differences '
    'spread far beyond it), or of another noise family (pooled apart: e.g. losses at 4x the '
    'trained context), is listed with its own.',
    '',
    *_noise_rows(tallies),
  ]
  for category in COLUMNS[1:]:
    noted = [n for t in tallies for n in t['notes'][category]]
    if noted:
      lines += ['', f'{category[0].upper()}{category[1:]}:', ''] + [f'- {n}' for n in noted]
  changed = [c for t in tallies for c in t['changed']]
  if changed:
    lines += ['', 'Verdicts the project-wide correction changes:', ''] + [f'- {c}' for c in changed]
  if diagnoses:
    lines += [
      '',
      'Diagnosis suites (evidence for the diagnoses above, and scored in the table too):',
      '',
    ] + [
      f"- [`{d['suite']}`]({d['suite']}/results.md) re-measures `{d['of']}`'s "
      f"{', '.join(d['rows'])} ({d['seeds']} seeds"
      + (
        f"; in progress: {d['finished']} of {d['planned']} runs finished)"
        if d.get('finished', 0) < d.get('planned', 0)
        else ')'
      )
      for d in diagnoses
    ]
  versions = [t['suite'] for t in tallies if t['code_versions'] > 1]
  paired = [t['suite'] for t in tallies if t['code_versions'] > 1 and t['versions_pair']]
  lines += [
    '',
    'Provenance: '
    + (
      f"the runs of {', '.join(f'`{v}`' for v in versions)} come from more than one code "
      'version, package set or device (each results.md lists them); runs finished before '
      'provenance was recorded count as one version per commit that added them.'
      if versions
      else 'every suite\'s runs come from one code version each (each results.md names it).'
    )
    + (
      f" Checked by `python -m experiments.reproduce` to draw the same initial weights and "
      f"batches, so their rows pair: {', '.join(f'`{v}`' for v in paired)}."
      if paired
      else ''
    ),
  ]
  return '\n'.join(lines) + '\n'


def rewrite_reports(out: str) -> list[str]:
  """Every training suite's results.md (and plots) written again from its results.json."""
  return [report.write(suite, results, out) for suite, results in finished(out)]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog='python -m experiments.overview',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--out', default='experiments/results')
  parser.add_argument(
    '--reports',
    action='store_true',
    help="first rewrite every suite's results.md from its results.json (after a change to the "
    'statistics or a diagnosis; trains nothing)',
  )
  args = parser.parse_args(argv)
  if args.reports:
    rewrite_reports(args.out)
  text = markdown(*collect(args.out))
  with open(os.path.join(args.out, 'overview.md'), 'w') as f:
    f.write(text)
  print(text)
  return 0


if __name__ == '__main__':
  sys.exit(main())
