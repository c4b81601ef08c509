"""Attention forward and forward+backward per implementation and N: time, TFLOP/s, scratch memory.

The benchmark table of FlashAttention (Dao et al. 2022, sec. 4.3 and app. E) for
`mllm.ops.attention.attend`, one row per (impl, causal, N):
  - fwd: jit of attend(q, k, v); fwd+bwd: jit of the gradient w.r.t. (q, k, v) of sum(out ⊙ dO),
    dO a fixed random cotangent passed as an argument, so that XLA cannot simplify it away;
  - time: median of --repeats runs after --warmup runs, each blocked on (block_until_ready);
  - scratch memory: compiled.memory_analysis().temp_size_in_bytes (where the N×N scores of dense
    attention live; arguments and outputs are not included);
  - XLA's own count of FLOPs and bytes accessed: compiled.cost_analysis().
FLOP convention (FlashAttention-2, Dao 2023, sec. 4.1): forward = 4·B·H·N²·D (two matmuls, 2 FLOPs a
multiply-add; H = query heads), halved when causal; backward = 2.5 × forward (five matmuls instead
of two, counting recomputation); fwd+bwd = 3.5 × forward. TFLOP/s = these FLOPs / median time, so an
implementation is not credited for recomputing or for computing the masked half.

CPU (defaults: float32, batch 1, 8 heads, d 64, N 512…16384; dense scores capped by --max_gb):
    python -m benchmarks.attention
    python -m benchmarks.attention --seq_lens=128,256 --repeats=1 --impls=xla --out=/tmp/a.md  # smoke
GPU (FlashAttention's setting: 16k tokens per batch, model width 2048):
    python -m benchmarks.attention --dtype=bfloat16 --tokens_per_batch=16384 --heads=16 \\
        --head_dim=128 --causal=both --impls=xla,pallas,pallas_mgpu,cudnn

Implementations come from the registry ATTENTION_IMPLS; one that is not registered, or not available
on the backend ('cudnn' needs a GPU), is skipped with a printed reason, and one that raises for a
combination is recorded as n/a. Block sizes are the implementations' defaults. Pallas on CPU runs in
interpret mode (the kernel emulated with ordinary XLA ops, one grid step at a time): its CPU times
say nothing about GPU speed, and --pallas_cpu_max_n (2048) caps N there.
Writes --out (default benchmarks/results/attention-<backend>.md), the raw rows as JSON next to it
and a log-log plot (--plot, default next to the .md; --out= / --plot= with no value: none).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.machine import cpu_model
from mllm.ops.attention import ATTENTION_IMPLS, PALLAS_IMPLS, AttentionMask, attend, pallas_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DENSE = ('xla',)  # implementations that materialize [B, H, N, N] scores
MiB = 2**20


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
    epilog=__doc__,
  )
  p.add_argument('--impls', default='xla,blockwise,pallas,cudnn', help='comma list')
  p.add_argument('--seq_lens', default='512,1024,2048,4096,8192,16384', help='comma list of N')
  p.add_argument('--batch', type=int, default=1)
  p.add_argument(
    '--tokens_per_batch',
    type=int,
    default=None,
    help='if set, batch = tokens_per_batch // N (overrides --batch)',
  )
  p.add_argument('--heads', type=int, default=8, help='query heads H')
  p.add_argument('--kv_heads', type=int, default=None, help='key/value heads (default: --heads)')
  p.add_argument('--head_dim', type=int, default=64)
  p.add_argument(
    '--dtype',
    choices=['float32', 'bfloat16', 'float16'],
    default=None,
    help='default float32 on CPU, bfloat16 elsewhere',
  )
  p.add_argument('--causal', choices=['true', 'false', 'both'], default='true')
  p.add_argument('--repeats', type=int, default=5)
  p.add_argument('--warmup', type=int, default=1)
  p.add_argument(
    '--time_budget_s',
    type=float,
    default=None,
    help='per measurement: no further repeats once this much time is spent',
  )
  p.add_argument(
    '--max_gb',
    type=float,
    default=None,
    help='skip a cell needing more scratch (default 12 on CPU, the device limit on GPU)',
  )
  p.add_argument('--pallas_cpu_max_n', type=int, default=2048)
  p.add_argument(
    '--out', default=None, help='markdown (default benchmarks/results/attention-<backend>.md)'
  )
  p.add_argument('--plot', default=None, help='png (default: the --out path with .png)')
  return p.parse_args(argv)


def environment(args) -> dict:
  dev = jax.devices()[0]
  cpu = cpu_model()
  size = (
    f'{args.tokens_per_batch} tokens per batch' if args.tokens_per_batch else f'batch {args.batch}'
  )
  machine = (
    cpu
    if dev.platform == 'cpu'
    else f'{dev.device_kind} ({jax.device_count()} device(s)), host {cpu}'
  )
  return {
    'machine': f'{machine}, {os.cpu_count()} CPU cores',
    'versions': f'python {platform.python_version()}, jax {jax.__version__} ({jax.default_backend()})',
    'date': datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC'),
    'command': ' '.join(shlex.quote(a) for a in ['python'] + sys.argv),
    'setting': (
      f'{size}, '
      f'{args.heads} query heads / {args.kv_heads} KV heads, head_dim {args.head_dim}, '
      f'{args.dtype}, {args.warmup} warm-up + {args.repeats} timed runs'
      f"{f', time budget {args.time_budget_s:g} s' if args.time_budget_s else ''}, "
      f'scratch budget {args.max_gb:g} GB'
    ),
  }


def timed(run, repeats: int, warmup: int, budget_s: float | None) -> tuple[float, int]:
  """Median seconds of `repeats` blocked runs after `warmup`, fewer once `budget_s` is spent."""
  start = time.perf_counter()
  for _ in range(warmup):
    jax.block_until_ready(run())
  times = []
  while len(times) < repeats:
    t0 = time.perf_counter()
    jax.block_until_ready(run())
    times.append(time.perf_counter() - t0)
    if budget_s is not None and time.perf_counter() - start > budget_s:
      break
  return statistics.median(times), len(times)


def measure(fn, fn_args, args, budget_bytes: float) -> dict:
  """Compile, read XLA's cost and memory analyses, then time (unless the scratch is over budget)."""
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*fn_args).compile()
  r = {'compile_s': time.perf_counter() - t0}
  cost = compiled.cost_analysis()
  cost = (cost[0] if cost else None) if isinstance(cost, (list, tuple)) else cost
  for key, name in (('flops', 'xla_flops'), ('bytes accessed', 'xla_bytes')):
    value = (cost or {}).get(key)
    r[name] = float(value) if value is not None and value >= 0 else None
  r['scratch'] = getattr(compiled.memory_analysis(), 'temp_size_in_bytes', None)
  if r['scratch'] is not None and r['scratch'] > budget_bytes:
    r['skipped'] = f"memory (compiled scratch {r['scratch'] / 1e9:.3g} GB > {args.max_gb:g} GB)"
    return r
  seconds, r['runs'] = timed(
    lambda: compiled(*fn_args), args.repeats, args.warmup, args.time_budget_s
  )
  r['ms'] = 1e3 * seconds
  return r


def one_line(e: Exception) -> str:
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def interpreted(impl: str) -> bool:
  """Does this impl run a Pallas kernel in an interpreter here (any on CPU, the TPU kernel off a
  TPU, the Mosaic GPU one off a GPU)?"""
  if impl not in PALLAS_IMPLS:
    return False
  backend = jax.default_backend()
  home = {'tpu': 'tpu', 'mgpu': 'gpu'}.get(pallas_kernel(impl, backend), backend)
  return backend == 'cpu' or backend != home


def run_cell(impl, causal, n, batch, inputs, args, budget_bytes) -> dict:
  B, H, D = batch, args.heads, args.head_dim
  fa_fwd = 4 * B * H * n * n * D / (2 if causal else 1)
  row = dict(
    impl=impl, causal=causal, N=n, batch=B, fa_fwd_flops=fa_fwd, fa_fwdbwd_flops=3.5 * fa_fwd
  )
  if interpreted(impl):
    row['impl'] = f'{impl} (interpreted)'  # its times say nothing about the kernel's speed
    if n > args.pallas_cpu_max_n:
      row['skipped'] = (
        f'N > pallas_cpu_max_n (Pallas interpret mode; --pallas_cpu_max_n={args.pallas_cpu_max_n})'
      )
      return row
  dense_bytes = 4 * B * H * n * n * 4  # ~4 float32 score-sized tensors in the dense fwd+bwd
  if impl in DENSE and dense_bytes > budget_bytes:
    row['skipped'] = f'memory (dense scores ~{dense_bytes / 1e9:.3g} GB > {args.max_gb:g} GB)'
    return row
  mask = AttentionMask(causal=causal)

  def fwd(q, k, v):
    return attend(q, k, v, mask=mask, impl=impl)

  def loss(q, k, v, d_out):
    return jnp.sum(fwd(q, k, v).astype(jnp.float32) * d_out.astype(jnp.float32))

  q, k, v, d_out = inputs
  for kind, fn, fn_args in (
    ('fwd', fwd, (q, k, v)),
    ('fwdbwd', jax.grad(loss, argnums=(0, 1, 2)), (q, k, v, d_out)),
  ):
    try:
      r = measure(fn, fn_args, args, budget_bytes)
    except Exception as e:  # an unsupported combination, or out of device memory
      row[f'{kind}_error'] = one_line(e)
      print(f'  {impl} causal={causal} N={n} {kind}: n/a, {row[f"{kind}_error"]}', flush=True)
      continue
    row.update({f'{kind}_{key}': value for key, value in r.items()})
    if 'ms' in r:
      row[f'{kind}_tflops'] = row[f'fa_{kind}_flops'] / r['ms'] / 1e9
  return row


def fmt(value, spec='.1f', scale=1.0) -> str:
  return 'n/a' if value is None else format(value / scale, spec)


def ms_cell(row, kind, repeats, unit='') -> str:
  if f'{kind}_ms' not in row:
    skipped = row.get('skipped') or row.get(f'{kind}_skipped')
    return f'skipped ({skipped.split(" (")[0]})' if skipped else 'n/a'
  runs = row[f'{kind}_runs']
  return fmt(row[f'{kind}_ms'], '.2f') + (f' ({runs})' if runs < repeats else '') + unit


def tables(rows, repeats) -> str:
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
  lines = ['| ' + ' | '.join(header) + ' |', '|---|---|' + '---:|' * (len(header) - 2)]
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
  by_key = {(r['impl'], r['causal'], r['N']): r for r in rows}
  present = {r['impl'] for r in rows}
  refs = [ref for ref in ('xla', 'cudnn') if ref in present]
  if len(present) < 2 or not refs:
    return '\n'.join(lines)

  def ratio(r, ref_impl, key):
    a, b = r.get(key), by_key.get((ref_impl, r['causal'], r['N']), {}).get(key)
    return '-' if r['impl'] == ref_impl or a is None or not b else f'{a / b:.2f}'

  cols = {
    'xla': ['fwd_ms', 'fwdbwd_ms', 'fwd_scratch', 'fwdbwd_scratch'],
    'cudnn': ['fwd_tflops', 'fwdbwd_tflops'],
  }
  names = {
    'fwd_ms': 'fwd time',
    'fwdbwd_ms': 'fwd+bwd time',
    'fwd_scratch': 'scratch fwd',
    'fwdbwd_scratch': 'scratch fwd+bwd',
    'fwd_tflops': 'fwd TFLOP/s',
    'fwdbwd_tflops': 'fwd+bwd TFLOP/s',
  }
  header = ['impl', 'causal', 'N'] + [f'{names[k]} / {ref}' for ref in refs for k in cols[ref]]
  ratios = ['| ' + ' | '.join(header) + ' |', '|---|---|' + '---:|' * (len(header) - 2)]
  for r in rows:
    if r['impl'] != 'xla' or 'cudnn' in refs:
      cells = [r['impl'], str(r['causal']).lower(), str(r['N'])]
      ratios.append(
        '| ' + ' | '.join(cells + [ratio(r, ref, k) for ref in refs for k in cols[ref]]) + ' |'
      )
  what = ['time and scratch: impl / xla, below 1 is faster or smaller'] * ('xla' in refs)
  what += ['TFLOP/s: impl / cudnn, above 1 is faster'] * ('cudnn' in refs)
  return '\n'.join(lines) + f"\n\nRatios ({'; '.join(what)}):\n\n" + '\n'.join(ratios)


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


def main(argv=None) -> None:
  args = parse_args(argv)
  backend = jax.default_backend()
  args.dtype = args.dtype or ('float32' if backend == 'cpu' else 'bfloat16')
  args.kv_heads = args.kv_heads or args.heads
  if args.max_gb is None:
    limit = (jax.devices()[0].memory_stats() or {}).get('bytes_limit') if backend != 'cpu' else None
    args.max_gb = limit / 1e9 if limit else 12.0
  budget_bytes = args.max_gb * 1e9
  if args.out is None:
    args.out = os.path.join(ROOT, 'benchmarks', 'results', f'attention-{backend}.md')
  if args.plot is None and args.out:
    args.plot = os.path.splitext(args.out)[0] + '.png'
  env = environment(args)
  for key, value in env.items():
    print(f'{key}: {value}', flush=True)
  impls, notes = [], []
  for impl in args.impls.split(','):
    if impl not in ATTENTION_IMPLS:
      notes.append(
        f"{impl}: not registered in ATTENTION_IMPLS ({', '.join(sorted(ATTENTION_IMPLS))})"
      )
    elif why := ATTENTION_IMPLS[impl].refuses_backend(backend):
      notes.append(f'{impl}: {why}')
    else:
      impls.append(impl)
  for note in notes:
    print(f'skipping {note}', flush=True)
  causals = {'true': [True], 'false': [False], 'both': [True, False]}[args.causal]
  dtype = jnp.dtype(args.dtype)
  rows = []
  for causal in causals:
    for n in [int(x) for x in args.seq_lens.split(',')]:
      batch = max(1, args.tokens_per_batch // n) if args.tokens_per_batch else args.batch
      keys = jax.random.split(jax.random.key(n), 4)
      shapes = [
        (batch, n, args.heads),
        (batch, n, args.kv_heads),
        (batch, n, args.kv_heads),
        (batch, n, args.heads),
      ]
      inputs = [jax.random.normal(key, s + (args.head_dim,), dtype) for key, s in zip(keys, shapes)]
      for impl in impls:
        row = run_cell(impl, causal, n, batch, inputs, args, budget_bytes)
        rows.append(row)
        if 'skipped' in row:
          print(f"[{impl} causal={causal} N={n} B={batch}] skipped: {row['skipped']}", flush=True)
          continue
        print(
          f"[{impl} causal={causal} N={n} B={batch}] fwd {ms_cell(row, 'fwd', args.repeats, ' ms')}, "
          f"fwd+bwd {ms_cell(row, 'fwdbwd', args.repeats, ' ms')}, fwd+bwd "
          f"{fmt(row.get('fwdbwd_tflops'), '.3f')} TFLOP/s, scratch "
          f"{fmt(row.get('fwd_scratch'), '.1f', MiB)} / {fmt(row.get('fwdbwd_scratch'), '.1f', MiB)} MiB, "
          f"compile {fmt(row.get('fwd_compile_s'))} + {fmt(row.get('fwdbwd_compile_s'))} s",
          flush=True,
        )
      del inputs
      write_outputs(rows, args, env, notes, backend, final=False)  # a killed run keeps its rows
  write_outputs(rows, args, env, notes, backend, final=True)


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


if __name__ == '__main__':
  main()
