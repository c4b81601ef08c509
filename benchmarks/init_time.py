"""Start-up: seconds until a run's parameters and optimizer state are ready, and how many XLA
programs that compiles.

    python -m benchmarks.init_time                     # 125m at 12/24 unrolled layers, 12 scanned
    python -m benchmarks.init_time --variants=12,24,12scan,24scan,12whole --repeat=3 --out=t.md

Each variant runs in a fresh Python process (nothing cached: JAX's persistent compilation cache is
off) on benchmarks/train_step.py's '125m' config with `model.n_layers` set:

    12, 24          unrolled layers: mllm.train.state.setup's init (one program per layer shape)
    12scan          model.scan_layers=True: one whole-model program over a scanned layer
    12whole         unrolled layers, one jitted program building the whole model (the init that
                    `setup` returned before the layer-by-layer one; for comparison)

setup = `setup(config, mesh)` (abstract model, optimizer, shardings); compile = the tracing, lowering
and XLA compile of the programs that init runs (JAX's compile events, summed); run = the rest of
init, blocked until every array is ready; ready = setup + init. programs = the XLA programs compiled
from the start of setup until the state is ready (JAX's '/jax/core/compile/backend_compile_duration'
events), eager little ones included. With --repeat, each number is the min over the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# jax/_src/dispatch.py: the same names in jax 0.10-0.12
TRACE, LOWER, BACKEND = (
  '/jax/core/compile/jaxpr_trace_duration',
  '/jax/core/compile/jaxpr_to_mlir_module_duration',
  '/jax/core/compile/backend_compile_duration',
)


KINDS = {
  '': 'unrolled, layer by layer',
  'scan': 'scanned',
  'whole': 'unrolled, whole-model program (before)',
}


def parse(variant: str) -> tuple[int, str]:
  """'24scan' -> (24, 'scan')."""
  match = re.fullmatch(r'(\d+)(scan|whole)?', variant)
  if not match:
    raise SystemExit(f'error: --variants: {variant!r}; allowed: N, Nscan or Nwhole (N layers)')
  return int(match[1]), match[2] or ''


def measure(variant: str) -> dict:
  """Run one variant in this process: {setup, compile, run, ready (s), programs}."""
  import jax

  from benchmarks.train_step import load
  from mllm.config import load_config
  from mllm.train.sharding import make_mesh
  from mllm.train.state import _parts, setup

  events: list[tuple[str, float]] = []
  jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, **_: events.append((event, secs))
  )
  n_layers, kind = parse(variant)
  config = load_config(
    load('125m'), {'model.n_layers': n_layers, 'model.scan_layers': kind == 'scan'}
  )
  mesh = make_mesh(config.mesh)

  t0 = time.perf_counter()
  train_setup, init = setup(config, mesh)
  t1 = time.perf_counter()
  in_setup = len(events)
  if kind == 'whole':
    init = jax.jit(_parts(config).init, out_shardings=train_setup.shardings)
  jax.block_until_ready(init())
  t2 = time.perf_counter()
  compile_s = sum(s for e, s in events[in_setup:] if e in (TRACE, LOWER, BACKEND))
  from benchmarks.machine import describe

  return {
    'machine': describe(),  # here, not in the parent: JAX there would hold the GPU's memory
    'setup': t1 - t0,
    'compile': compile_s,
    'run': t2 - t1 - compile_s,
    'ready': t2 - t0,
    'programs': sum(e == BACKEND for e, _ in events),
  }


def run_fresh(variant: str) -> dict:
  """`measure(variant)` in a new interpreter, without the persistent compilation cache."""
  env = {**os.environ, 'JAX_ENABLE_COMPILATION_CACHE': 'false'}
  env.pop('JAX_COMPILATION_CACHE_DIR', None)
  code = f'import json; from benchmarks.init_time import measure; print(json.dumps(measure({variant!r})))'
  out = subprocess.run(
    [sys.executable, '-c', code], cwd=ROOT, env=env, capture_output=True, text=True, check=False
  )
  if out.returncode:
    raise SystemExit(f'error: variant {variant} failed:\n{out.stderr[-3000:]}')
  return json.loads(out.stdout.strip().splitlines()[-1])


def table(results: dict) -> str:
  lines = [
    '| model | layers | init | setup s | compile s | run s | ready s | programs |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for variant, r in results.items():
    n, kind = parse(variant)
    lines.append(
      f"| 125m | {n} | {KINDS[kind]} | {r['setup']:.2f} | {r['compile']:.2f} | {r['run']:.2f} | "
      f"{r['ready']:.2f} | {r['programs']} |"
    )
  return '\n'.join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--variants', default='12,24,12scan', help='comma list: N, Nscan, Nwhole')
  parser.add_argument('--repeat', type=int, default=1, help='runs per variant; the min is kept')
  parser.add_argument('--out', help='also write the machine, the command and the table here (.md)')
  args = parser.parse_args()
  for variant in args.variants.split(','):
    parse(variant)  # refuse a bad list before the first run
  results = {}
  for variant in args.variants.split(','):
    runs = [run_fresh(variant) for _ in range(args.repeat)]
    results[variant] = {k: min(r[k] for r in runs) for k in runs[0] if k != 'machine'}
    machine = runs[0]['machine']
    print(f'{variant}: {results[variant]}', flush=True)
    if args.out:  # after each variant: a run cut short by a time limit keeps what it measured
      write(args.out, machine, args.repeat, table(results))
  print(table(results))


def write(path: str, machine: str, repeat: int, text: str) -> None:
  command = 'python -m benchmarks.init_time ' + ' '.join(sys.argv[1:])
  with open(path, 'w') as f:
    f.write(
      f'# Start-up: model + optimizer state ready\n\n- machine: {machine}\n'
      f'- command: `{command}`\n- each number: min over {repeat} fresh processes\n\n{text}\n'
    )


if __name__ == '__main__':
  main()
