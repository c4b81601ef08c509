"""benchmarks/test_cost.py: the per-file table sums each worker's records and ranks files by CPU."""

import json

from benchmarks.test_cost import table


def test_the_table_sums_every_workers_records_per_file_and_ranks_by_cpu(tmp_path):
  records = {
    'gw0': [
      ('tests/test_a.py::t1', 1.0, 2.0, 0.5, 10, 3.0, 4),
      ('tests/test_b.py::t1', 9.0, 1.0, 0.0, 2, 0.5, 0),
    ],
    'gw1': [('tests/test_a.py::t2[x]', 2.0, 3.0, 0.0, 5, 1.0, 1)],
  }
  for worker, rows in records.items():
    with open(tmp_path / f'{worker}.jsonl', 'w') as f:
      for row in rows:
        keys = ('id', 'wall', 'self_cpu', 'child_cpu', 'compiles', 'compile_s', 'cache_hits')
        f.write(json.dumps(dict(zip(keys, row))) + '\n')
  lines = table(str(tmp_path)).splitlines()
  # test_a: CPU 2 + 0.5 + 3 = 5.5 over 2 tests, ahead of test_b's 1.0 despite test_b's wall.
  assert lines[2] == '| tests/test_a.py | 2 | 6 (5 + 0) | 3 | 15 | 4 | 5 |'
  assert lines[3] == '| tests/test_b.py | 1 | 1 (1 + 0) | 9 | 2 | 0 | 0 |'
  assert lines[4] == '| all | 3 | 6 (6 + 0) | 12 | 17 | 4 | 5 |'
