"""Where `make test`'s time goes: a pytest plugin that records, per test, its wall seconds, its CPU
seconds (this process's, and its waited-for children's), and the XLA programs it built (JAX's
backend-compile event, which fires for a program read from the persistent cache too: the hits
column says how many were), with their seconds; then a per-file table.

    make test PYTEST_ARGS='-n 2 --dist loadgroup -p benchmarks.test_cost' MLLM_TEST_COST=/tmp/cost
    .venv/bin/python -m benchmarks.test_cost /tmp/cost     # the table, costliest file first

Each pytest process (xdist's workers included) appends one JSON line per test to
$MLLM_TEST_COST/<worker>.jsonl. A module-scoped fixture's cost lands on the first test that uses it.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import resource
import sys
import time

import pytest

COUNTED = ('compiles', 'compile_s', 'cache_hits')  # from JAX's events, into _counts
FIELDS = ('wall', 'self_cpu', 'child_cpu', *COUNTED)
_counts = collections.Counter()
_listening = False


def _listen() -> None:
  """Count programs built and persistent-cache hits from JAX's monitoring events (jax imported
  here, after conftest.py has set the cache's environment)."""
  global _listening
  if _listening:
    return
  _listening = True
  import jax.monitoring

  def on_duration(event, seconds, **_):
    if event == '/jax/core/compile/backend_compile_duration':
      _counts['compiles'] += 1
      _counts['compile_s'] += seconds

  def on_event(event, **_):
    if event == '/jax/compilation_cache/cache_hits':
      _counts['cache_hits'] += 1

  jax.monitoring.register_event_duration_secs_listener(on_duration)
  jax.monitoring.register_event_listener(on_event)


def _snapshot() -> dict:
  own = resource.getrusage(resource.RUSAGE_SELF)
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return {
    'wall': time.perf_counter(),
    'self_cpu': own.ru_utime + own.ru_stime,
    'child_cpu': children.ru_utime + children.ru_stime,
    **{k: _counts[k] for k in COUNTED},
  }


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  folder = os.environ.get('MLLM_TEST_COST')
  if not folder:
    yield
    return
  _listen()
  before = _snapshot()
  yield
  after = _snapshot()
  record = {'id': item.nodeid, **{k: round(after[k] - before[k], 3) for k in FIELDS}}
  os.makedirs(folder, exist_ok=True)
  worker = os.environ.get('PYTEST_XDIST_WORKER', 'main')
  with open(os.path.join(folder, f'{worker}.jsonl'), 'a', encoding='utf-8') as f:
    f.write(json.dumps(record) + '\n')


def table(folder: str) -> str:
  """Per test file: tests, summed CPU / wall seconds, programs built, their seconds, cache hits."""
  per_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  for path in glob.glob(os.path.join(folder, '*.jsonl')):
    with open(path, encoding='utf-8') as f:
      for line in f:
        record = json.loads(line)
        totals = per_file[record['id'].split('::')[0]]
        totals['tests'] += 1
        totals.update({k: record[k] for k in FIELDS})
  if not per_file:
    raise SystemExit(f'test_cost: no records under {folder} (was MLLM_TEST_COST set?)')
  everything = collections.Counter()
  for totals in per_file.values():
    everything.update(totals)
  head = '| file | tests | CPU s (own + children) | wall s | programs | their s | cache hits |'
  rows = [head, '|' + '---|' * 7]
  for name, t in [*sorted(per_file.items(), key=lambda kv: -_cpu(kv[1])), ('all', everything)]:
    rows.append(
      f'| {name} | {t["tests"]} | {_cpu(t):.0f} ({t["self_cpu"]:.0f} + {t["child_cpu"]:.0f}) '
      f'| {t["wall"]:.0f} | {t["compiles"]} | {t["compile_s"]:.0f} | {t["cache_hits"]} |'
    )
  return '\n'.join(rows)


def _cpu(totals) -> float:
  return totals['self_cpu'] + totals['child_cpu']


if __name__ == '__main__':
  if len(sys.argv) != 2:
    raise SystemExit('usage: python -m benchmarks.test_cost FOLDER')
  print(table(sys.argv[1]))
