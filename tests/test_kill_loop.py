"""A run killed with SIGKILL again and again still finishes as if it never was.

At least 15 kills land at random moments (start-up and compile, restores, steps, checkpoint saves)
and at least 3 during checkpoint deletion (tests/kill_harness.py). Then the run is let finish:
its final state must equal an uninterrupted run's bit for bit, no half-done folder may be left,
and metrics.jsonl must hold each step exactly once, with the uninterrupted run's losses.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import LAUNCH_CONFIG, ROOT, load_state, make_config, run_overrides

from mllm.paths import COMMIT_MARKERS, DELETING
from mllm.train.metrics import read_metrics

pytestmark = pytest.mark.slow
STEPS = 300
MIN_KILLS, MIN_DELETE_KILLS = 15, 3


def flags(corpus, cache) -> list[str]:
  overrides = run_overrides(
    corpus,
    cache,
    train__steps=STEPS,
    train__checkpoint_every=4,
    train__max_to_keep=2,
    train__eval_every=100,
    train__warmup_steps=10,
  )
  return [LAUNCH_CONFIG] + [f'--config.{k}={v}' for k, v in overrides.items()]


def start(args, workdir, harness=False):
  script = [os.path.join('tests', 'kill_harness.py')] if harness else ['launch.py']
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  return subprocess.Popen(
    [sys.executable, *script, *args, f'--workdir={workdir}'],
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


def n_records(workdir) -> int:
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    return 0
  with open(path, 'rb') as f:
    return f.read().count(b'\n')


def test_sigkill_at_random_moments_then_finish_is_bitwise_the_uninterrupted_run(corpus, tmp_path):
  cache = str(tmp_path / 'cache')
  args = flags(corpus, cache)
  reference = str(tmp_path / 'reference')
  done = start(args, reference)
  out, _ = done.communicate(timeout=600)
  assert done.returncode == 0, out

  workdir = str(tmp_path / 'killed')
  rng = random.Random(0)
  kills, delete_kills, log = 0, 0, []
  while kills < MIN_KILLS or delete_kills < MIN_DELETE_KILLS:
    assert len(log) < 60, log
    in_delete = kills >= 4 and delete_kills < MIN_DELETE_KILLS and len(log) % 4 == 3
    before = n_records(workdir)
    proc = start(args, workdir, harness=in_delete)
    if not in_delete:
      if rng.random() < 0.3:  # anywhere in start-up: imports, compile, tidying, restore
        time.sleep(rng.uniform(0.0, 4.0))
      else:  # once training has resumed: steps, saves, deletions
        deadline = time.time() + 120
        while n_records(workdir) == before and proc.poll() is None and time.time() < deadline:
          time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.6))
      proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    assert 'Traceback' not in out, out
    if proc.returncode == 0:  # it finished before the kill landed: start over, still killed
      log.append('finished')
      break
    assert proc.returncode == -signal.SIGKILL, out
    kills += 1
    trash = os.path.join(workdir, 'checkpoints', DELETING)
    if in_delete:
      assert os.listdir(trash), 'the harness kills mid-deletion, leaving part of a step'
      delete_kills += 1
    log.append(('delete' if in_delete else 'kill', n_records(workdir)))
  assert kills >= MIN_KILLS and delete_kills >= MIN_DELETE_KILLS, log
  # Most kills landed mid-training: the logged records grew under them.
  grew = sum(1 for (_, a), (_, b) in zip([('', 0)] + log, log) if b > a)
  assert grew >= MIN_KILLS // 2, log
  print(f'{kills} kills ({delete_kills} mid-deletion), records after each: {log}')

  proc = start(args, workdir)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0 and 'Traceback' not in out, out
  assert f'done at step {STEPS}' in out, out

  config = make_config(
    corpus,
    cache,
    train__steps=STEPS,
    train__checkpoint_every=4,
    train__max_to_keep=2,
    train__eval_every=100,
    train__warmup_steps=10,
  )
  ref_state, state = load_state(config, reference), load_state(config, workdir)
  assert int(state['step']) == int(ref_state['step']) == STEPS  # both latest checkpoints
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # Nothing half-done is left: only committed steps, an empty .deleting/, no tmp or set-aside copy.
  checkpoints = os.path.join(workdir, 'checkpoints')
  for name in os.listdir(checkpoints):
    path = os.path.join(checkpoints, name)
    if name == DELETING:
      assert os.listdir(path) == []
    else:
      assert name.isdigit(), name
      assert all(os.path.exists(os.path.join(path, m)) for m in COMMIT_MARKERS), name
  assert not [n for n in os.listdir(workdir) if n.endswith('.tmp')]

  # metrics.jsonl: valid JSON lines, each step once, the same losses as the uninterrupted run.
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  reference_records = read_metrics(os.path.join(reference, 'metrics.jsonl'))
  for split in ('train', 'eval'):
    ours = [(r['step'], r['loss']) for r in records if r['split'] == split]
    theirs = [(r['step'], r['loss']) for r in reference_records if r['split'] == split]
    assert ours == theirs, split
  assert [r['step'] for r in records if r['split'] == 'train'] == list(range(1, STEPS + 1))
