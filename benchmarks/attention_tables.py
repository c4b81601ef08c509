"""The outputs of benchmarks/attention.py: its rows as markdown tables (results, then ratios to a
reference implementation), the footnotes, the log-log plot and the .md / .json files."""

from __future__ import annotations

import json
import os

MiB = 2**20


def fmt(value, spec='.1f', scale=1.0) -> str:
  return 'n/a' if value is None else format(value / scale, spec)


def ms_cell(row, kind, repeats, unit='') -> str:
  if f'{kind}_ms' not in row:
    skipped = row.get('skipped') or row.get(f'{kind}_skipped')
    return f'skipped ({skipped.split(" (")[0]})' if skipped else 'n/a'
  runs = row[f'{kind}_runs']
  return fmt(row[f'{kind}_ms'], '.2f') + (f' ({runs})' if runs < repeats else '') + unit


def _header_lines(header) -> list[str]:
  """A markdown header whose first two columns are left-aligned and the rest right-aligned."""
  return ['| ' + ' | '.join(header) + ' |', '|---|---|' + '---:|' * (len(header) - 2)]


def results_table(rows, repeats) -> str:
  """One line per row: times, TFLOP/s, scratch and both FLOP counts."""
  header = [
    'impl',
    'causal',
    'N',
    'batch',
    'fwd ms',
    'fwd+bwd ms',
    'fwd TFLOP/s',
    'fwd+bwd TFLOP/s',
    'scratch fwd MiB',
    'scratch fwd+bwd MiB',
    'FA GFLOPs fwd / fwd+bwd',
    'XLA GFLOPs fwd / fwd+bwd',
    'XLA GB accessed fwd / fwd+bwd',
  ]
  lines = _header_lines(header)
  for r in rows:
    g = lambda key, spec, scale: fmt(r.get(key), spec, scale)  # noqa: E731, B023 (runs within this iteration)
    lines.append(
      '| '
      + ' | '.join(
        [
          r['impl'],
          str(r['causal']).lower(),
          str(r['N']),
          str(r['batch']),
          ms_cell(r, 'fwd', repeats),
          ms_cell(r, 'fwdbwd', repeats),
          g('fwd_tflops', '.3f', 1),
          g('fwdbwd_tflops', '.3f', 1),
          g('fwd_scratch', '.1f', MiB),
          g('fwdbwd_scratch', '.1f', MiB),
          f"{g('fa_fwd_flops', '.2f', 1e9)} / {g('fa_fwdbwd_flops', '.2f', 1e9)}",
          f"{g('fwd_xla_flops', '.2f', 1e9)} / {g('fwdbwd_xla_flops', '.2f', 1e9)}",
          f"{g('fwd_xla_bytes', '.3f', 1e9)} / {g('fwdbwd_xla_bytes', '.3f', 1e9)}",
        ]
      )
      + ' |'
    )
  return '\n'.join(lines)


# The columns compared with each reference implementation, and their names in the header.
RATIO_COLUMNS = {
  'xla': ['fwd_ms', 'fwdbwd_ms', 'fwd_scratch', 'fwdbwd_scratch'],
  'cudnn': ['fwd_tflops', 'fwdbwd_tflops'],
}
RATIO_NAMES = {
  'fwd_ms': 'fwd time',
  'fwdbwd_ms': 'fwd+bwd time',
  'fwd_scratch': 'scratch fwd',
  'fwdbwd_scratch': 'scratch fwd+bwd',
  'fwd_tflops': 'fwd TFLOP/s',
  'fwdbwd_tflops': 'fwd+bwd TFLOP/s',
}


def ratios_table(rows, refs) -> str:
  """Each row's columns divided by those of the reference impls `refs` at the same (causal, N)."""
  by_key = {(r['impl'], r['causal'], r['N']): r for r in rows}

  def ratio(r, ref_impl, key):
    a, b = r.get(key), by_key.get((ref_impl, r['causal'], r['N']), {}).get(key)
    return '-' if r['impl'] == ref_impl or a is None or not b else f'{a / b:.2f}'

  header = ['impl', 'causal', 'N'] + [
    f'{RATIO_NAMES[k]} / {ref}' for ref in refs for k in RATIO_COLUMNS[ref]
  ]
  lines = _header_lines(header)
  for r in rows:
    if r['impl'] != 'xla' or 'cudnn' in refs:
      cells = [r['impl'], str(r['causal']).lower(), str(r['N'])]
      lines.append(
        '| '
        + ' | '.join(cells + [ratio(r, ref, k) for ref in refs for k in RATIO_COLUMNS[ref]])
        + ' |'
      )
  return '\n'.join(lines)


def tables(rows, repeats) -> str:
  """The results table, then, when a reference impl ran beside another, the ratios to it."""
  present = {r['impl'] for r in rows}
  refs = [ref for ref in ('xla', 'cudnn') if ref in present]
  if len(present) < 2 or not refs:
    return results_table(rows, repeats)
  what = ['time and scratch: impl / xla, below 1 is faster or smaller'] * ('xla' in refs)
  what += ['TFLOP/s: impl / cudnn, above 1 is faster'] * ('cudnn' in refs)
  return (
    results_table(rows, repeats) + f"\n\nRatios ({'; '.join(what)}):\n\n" + ratios_table(rows, refs)
  )


FOOTNOTES = """\
- TFLOP/s and "FA GFLOPs" use FlashAttention's convention (fwd 4·B·H·N²·D, halved when causal;
  fwd+bwd 3.5 × fwd), not XLA's count. ms (k): only k timed runs, --time_budget_s was reached.
- XLA's FLOPs and bytes come from `cost_analysis()` of the compiled program and count only what it
  sees as HLO: a while loop's body is counted once, not once per iteration (blockwise attention, and
  Pallas interpreted on CPU, are loops), and a Pallas kernel on GPU or cuDNN attention is a custom
  call counted as little or nothing. Read them as a lower bound for those implementations.
- Scratch = `memory_analysis().temp_size_in_bytes` (excludes arguments and outputs; in fwd+bwd it
  includes whatever the forward saves for the backward). skipped (memory): the estimated dense
  scores (~4 × B·H·N² float32) or the compiled scratch exceed --max_gb; n/a: the implementation
  raised for this combination (message in the log and the JSON).
- Rows marked (interpreted) run a Pallas kernel in an interpreter (Triton's on CPU, the TPU kernel
  off a TPU, the Mosaic GPU one off a GPU): their times say nothing about the kernel's speed on its
  hardware."""


def plot(rows, path, title) -> None:
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  colors = {}
  for impl, causal in sorted(
    {(r['impl'], r['causal']) for r in rows}, key=lambda x: (x[0], not x[1])
  ):
    cell = sorted(
      (r for r in rows if r['impl'] == impl and r['causal'] == causal), key=lambda r: r['N']
    )
    color = colors.setdefault(impl, f'C{len(colors)}')
    for ax, key, scale in ((axes[0], 'fwdbwd_ms', 1), (axes[1], 'fwdbwd_scratch', MiB)):
      pts = [(r['N'], r[key] / scale) for r in cell if r.get(key)]  # zero scratch cannot be drawn
      if pts:
        ax.plot(
          *zip(*pts),
          '-' if causal else '--',
          marker='o',
          color=color,
          label=f"{impl} {'causal' if causal else 'full'}",
        )
  for ax, ylabel in zip(axes, ('fwd+bwd time (ms)', 'fwd+bwd scratch memory (MiB)')):
    ax.set_xscale('log', base=2)
    ax.set_yscale('log')
    ax.set(xlabel='sequence length N', ylabel=ylabel)
    ax.grid(True, which='both', alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def write_outputs(rows, args, env, notes, backend, *, final: bool) -> None:
  """The markdown table, the raw rows as JSON and (final) the plot; printed when final."""
  text = tables(rows, args.repeats)
  if final:
    print('\n' + text + '\n\n' + FOOTNOTES)
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, 'w') as f:
      f.write(
        f'# Attention benchmark ({backend})\n\n'
        + '\n'.join(f'- {k}: {v}' for k, v in env.items())
        + ''.join(f'\n- skipped {note}' for note in notes)
        + ('' if final else '\n- INCOMPLETE: the run stopped before its last cell')
        + '\n\n'
        + text
        + '\n\n'
        + FOOTNOTES
        + '\n'
      )
    json_path = os.path.splitext(args.out)[0] + '.json'
    with open(json_path, 'w') as f:
      json.dump(
        {
          'environment': env,
          'args': vars(args),
          'skipped_impls': notes,
          'rows': rows,
          'complete': final,
        },
        f,
        indent=1,
      )
    if final:
      print(f'wrote {args.out} and {json_path}')
  if final and args.plot and rows:
    plot(rows, args.plot, f"attention {env['setting']}; {env['machine']}")
    print(f'wrote {args.plot}')
