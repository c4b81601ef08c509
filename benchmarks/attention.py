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
import os
import platform
import shlex
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.attention_tables import MiB, fmt, ms_cell, write_outputs
from benchmarks.machine import cpu_model
from mllm.ops.attention import ATTENTION_IMPLS, PALLAS_IMPLS, AttentionMask, attend, pallas_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DENSE = ('xla',)  # implementations that materialize [B, H, N, N] scores


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


def fill_defaults(args, backend: str) -> None:
  """The defaults that depend on the backend: dtype, KV heads, scratch budget, output paths."""
  args.dtype = args.dtype or ('float32' if backend == 'cpu' else 'bfloat16')
  args.kv_heads = args.kv_heads or args.heads
  if args.max_gb is None:
    limit = (jax.devices()[0].memory_stats() or {}).get('bytes_limit') if backend != 'cpu' else None
    args.max_gb = limit / 1e9 if limit else 12.0
  if args.out is None:
    args.out = os.path.join(ROOT, 'benchmarks', 'results', f'attention-{backend}.md')
  if args.plot is None and args.out:
    args.plot = os.path.splitext(args.out)[0] + '.png'


def usable_impls(names: str, backend: str) -> tuple[list[str], list[str]]:
  """The comma list's implementations that run here, and a note for each of the others."""
  impls, notes = [], []
  for impl in names.split(','):
    if impl not in ATTENTION_IMPLS:
      notes.append(
        f"{impl}: not registered in ATTENTION_IMPLS ({', '.join(sorted(ATTENTION_IMPLS))})"
      )
    elif why := ATTENTION_IMPLS[impl].refuses_backend(backend):
      notes.append(f'{impl}: {why}')
    else:
      impls.append(impl)
  return impls, notes


def random_inputs(n: int, batch: int, args) -> list[jax.Array]:
  """q, k, v and the cotangent dO of one N, seeded by N so that every impl sees the same."""
  keys = jax.random.split(jax.random.key(n), 4)
  shapes = [
    (batch, n, args.heads),
    (batch, n, args.kv_heads),
    (batch, n, args.kv_heads),
    (batch, n, args.heads),
  ]
  dtype = jnp.dtype(args.dtype)
  return [jax.random.normal(key, s + (args.head_dim,), dtype) for key, s in zip(keys, shapes)]


def print_row(impl: str, row, repeats: int) -> None:
  """The log line of one cell; `impl` is the name asked for, without row's ' (interpreted)'."""
  where = f"[{impl} causal={row['causal']} N={row['N']} B={row['batch']}]"
  if 'skipped' in row:
    print(f"{where} skipped: {row['skipped']}", flush=True)
    return
  print(
    f"{where} fwd {ms_cell(row, 'fwd', repeats, ' ms')}, "
    f"fwd+bwd {ms_cell(row, 'fwdbwd', repeats, ' ms')}, fwd+bwd "
    f"{fmt(row.get('fwdbwd_tflops'), '.3f')} TFLOP/s, scratch "
    f"{fmt(row.get('fwd_scratch'), '.1f', MiB)} / {fmt(row.get('fwdbwd_scratch'), '.1f', MiB)} MiB, "
    f"compile {fmt(row.get('fwd_compile_s'))} + {fmt(row.get('fwdbwd_compile_s'))} s",
    flush=True,
  )


def main(argv=None) -> None:
  args = parse_args(argv)
  backend = jax.default_backend()
  fill_defaults(args, backend)
  budget_bytes = args.max_gb * 1e9
  env = environment(args)
  for key, value in env.items():
    print(f'{key}: {value}', flush=True)
  impls, notes = usable_impls(args.impls, backend)
  for note in notes:
    print(f'skipping {note}', flush=True)
  causals = {'true': [True], 'false': [False], 'both': [True, False]}[args.causal]
  rows = []
  for causal in causals:
    for n in [int(x) for x in args.seq_lens.split(',')]:
      batch = max(1, args.tokens_per_batch // n) if args.tokens_per_batch else args.batch
      inputs = random_inputs(n, batch, args)
      for impl in impls:
        row = run_cell(impl, causal, n, batch, inputs, args, budget_bytes)
        rows.append(row)
        print_row(impl, row, args.repeats)
      del inputs
      write_outputs(rows, args, env, notes, backend, final=False)  # a killed run keeps its rows
  write_outputs(rows, args, env, notes, backend, final=True)


if __name__ == '__main__':
  main()
