"""Shared helpers: tiny configs that build and run in milliseconds on a CPU."""

from __future__ import annotations

import os
import sys
import sysconfig
import tempfile

import pytest

from experiments.engines import pythonpath
from mllm.multiprocess import with_host_devices

# The training tests compile the same step in several runs and subprocesses (each train() call
# builds new jitted closures); JAX's persistent compilation cache, keyed by the HLO, lets every
# compile after the first be a disk read. Subprocesses inherit it through the environment. Every
# program is cached, however fast it compiled: a tiny model's forward compiles in ~0.3 s and many
# tests build the same one (a threshold of 0.5 s cost 5% of the model, train-parts, resume and
# KV-cache tests' time, serial, cold cache, 2026-11-28).
os.environ.setdefault(
  'JAX_COMPILATION_CACHE_DIR',
  os.path.join(tempfile.gettempdir(), f'mllm-tests-jax-cache-{os.getuid()}'),
)
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')

# XLA sizes its CPU thread pool by $NPROC, else one thread per core, when JAX starts. JAX's Mosaic
# GPU interpreter holds one pool thread per warpgroup waiting on a barrier, plus the launch: on a
# 2-core machine it deadlocks (pallas_kernels/flash_attention_mgpu.py refuses a pool under 4).
os.environ.setdefault('NPROC', '8')

# The float64-reference tolerances assume float32 matmuls in full precision: on a GPU, XLA's default
# runs them in TF32 (10-bit mantissa, ~1e-3 relative error). 'highest' is what the CPU does anyway;
# read when JAX is imported, so subprocesses inherit it too. `make test-gpu` sets it as well.
os.environ.setdefault('JAX_DEFAULT_MATMUL_PRECISION', 'highest')
if 'jax' in sys.modules:  # imported before this file (a plugin): set it on the live config too
  sys.modules['jax'].config.update(
    'jax_default_matmul_precision', os.environ['JAX_DEFAULT_MATMUL_PRECISION']
  )

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A child process's PYTHONPATH: this checkout first, then whatever reaches this process (packages
# installed with --target, as on a lent GPU, where a bare ROOT lost them).
CHILD_PYTHONPATH = pythonpath(ROOT)
BASE = os.path.join(ROOT, 'configs', 'base.py')


def cpu_devices_env(devices: int) -> dict:
  """This process's environment for a child on `devices` CPU devices: its XLA flags kept (the
  Makefile's optimisation level: a child compiled otherwise rounds otherwise, and a comparison
  with this process's numbers fails at the 1e-5 level), the host's device count replaced."""
  flags = with_host_devices(os.environ.get('XLA_FLAGS', ''), devices)
  return dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=flags)


TINY = {
  'model.vocab_size': 32,
  'model.d_model': 16,
  'model.n_layers': 2,
  'model.n_heads': 4,
  'model.n_kv_heads': 2,
  'model.max_seq_len': 16,
  'data.seq_len': 16,
}


# launch.py's --config for a run that compares with tiny_config's: the rate as given too.
LAUNCH_CONFIG = '--config=configs/base.py:lr_base_d_model=none'


def tiny_config(choices: str = '', **overrides):
  """configs/base.py with `choices`, shrunk to TINY, then `overrides` (dotted keys as kwargs
  with '__' for '.', e.g. model__n_layers=1)."""
  import mllm

  # The rate as given (not scaled by 256 / d_model: the tests set the rates they train at).
  spec = f'{BASE}:lr_base_d_model=none' + (f',{choices}' if choices else '')
  merged = dict(TINY)
  merged.update({k.replace('__', '.'): v for k, v in overrides.items()})
  return mllm.load_config(spec, merged)


@pytest.fixture
def tiny():
  return tiny_config


# --- A tiny training run on a small local corpus (byte tokenizer): tests of the loop and resume.

STEPS = 40


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
  """Under `--dist loadgroup`, a test marked xdist_group must carry its group in its id (the
  scheduler keeps a group on one worker by that suffix); a pytest that drops it would silently
  build every shared training fixture once per worker. Then MLLM_DESELECT's tests are dropped."""
  _deselect_listed(config, items)
  if not config.getoption('loadgroup', default=False):  # set on xdist's workers only
    return
  for item in items:
    if item.get_closest_marker('xdist_group') and '@' not in item.nodeid:
      raise pytest.UsageError(
        f'pytest-xdist did not tag {item.nodeid} with its xdist_group (pytest {pytest.__version__}'
        "): --dist loadgroup would not group tests; pyproject.toml's pytest range says why"
      )


# --- MLLM_DESELECT=FILE: the test ids it lists (whitespace-separated, as pytest -v reports them,
# xdist's @group suffix or not) are deselected: a run cut by a time limit on a lent GPU resumes
# with the tests it did not reach (benchmarks/gpu_checklist.sh).


def _deselect_listed(config, items):
  path = os.environ.get('MLLM_DESELECT')
  if not path:
    return

  def without_group(nodeid: str) -> str:  # xdist's '@group' suffix, not an '@' in a parameter
    head, at, tail = nodeid.rpartition('@')
    return head if at and ']' not in tail else nodeid

  with open(path) as f:
    listed = {without_group(nodeid) for nodeid in f.read().split()}
  keep, drop = [], []
  for item in items:
    (drop if without_group(item.nodeid) in listed else keep).append(item)
  if drop:
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


# --- MLLM_FAILURE_LOG=FILE: each failure's traceback appended as it happens (by the controller
# under xdist). A run cut by a time limit prints no summary; on a lent GPU (2026-11-27) two cut runs
# kept the names of 41 failures and none of their reasons.


def pytest_runtest_logreport(report):
  path = os.environ.get('MLLM_FAILURE_LOG')
  if not path or not report.failed or 'PYTEST_XDIST_WORKER' in os.environ:
    return
  with open(path, 'a') as f:
    f.write(f'=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n')


# --- Tests of one backend's behaviour: `@pytest.mark.cpu_only(reason=...)` runs where JAX's default
# backend is the CPU and `gpu_only` where it is a GPU (a twin asserting what the other does), judged
# by the backend the test process really has (JAX_PLATFORMS included). Marks registered in
# pyproject.toml; docs/testing.md lists the tests that differ on a GPU.

BACKEND_MARKS = {'cpu_only': 'cpu', 'gpu_only': 'gpu'}


def pytest_runtest_setup(item):
  for name, needed in BACKEND_MARKS.items():
    mark = item.get_closest_marker(name)
    if mark is None:
      continue
    reason = mark.kwargs.get('reason') or (mark.args[0] if mark.args else '')
    if not reason:
      raise pytest.UsageError(f'{item.nodeid}: @pytest.mark.{name} needs reason=...')
    import jax  # deferred: only a marked test makes this process pick its backend here

    backend = jax.default_backend()
    if backend != needed:
      pytest.skip(f'{name} (this run: {backend}): {reason}')


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """14 real documents: standard-library modules copied as .txt files."""
  return write_corpus(tmp_path_factory.mktemp('corpus'))


def write_corpus(root) -> str:
  """`corpus`'s 14 documents written into the folder `root`; returns its path."""
  stdlib = sysconfig.get_paths()['stdlib']
  names = sorted(n for n in os.listdir(stdlib) if n.endswith('.py'))
  picked = [n for n in names if 2_000 < os.path.getsize(os.path.join(stdlib, n)) < 30_000][:14]
  for name in picked:
    with open(os.path.join(stdlib, name), encoding='utf-8', errors='replace') as f:
      (root / f'{name}.txt').write_text(f.read(), encoding='utf-8')
  return str(root)


def run_overrides(corpus: str, cache: str, **extra) -> dict:
  overrides = {
    'model.vocab_size': 258,
    'model.d_model': 32,
    'model.n_layers': 2,
    'model.n_heads': 4,
    'model.n_kv_heads': 2,
    'model.max_seq_len': 32,
    'model.dropout': 0.1,
    'data.source': 'text',
    'data.path': corpus,
    'data.tokenizer': 'byte',
    'data.seq_len': 32,
    'data.batch_size': 4,
    'data.val_fraction': 0.3,
    'data.cache_dir': cache,
    'train.steps': STEPS,
    'train.warmup_steps': 4,
    'train.learning_rate': 3e-3,
    'train.log_every': 1,
    'train.eval_every': 0,
    'train.eval_batches': 4,
    'train.checkpoint_every': 1000,
    'train.tensorboard': False,
  }
  overrides.update({k.replace('__', '.'): v for k, v in extra.items()})
  return overrides


def make_config(corpus, cache, **extra):
  return tiny_config(
    **{k.replace('.', '__'): v for k, v in run_overrides(corpus, cache, **extra).items()}
  )


def trains_and_resumes_bitwise(config, tmp_path) -> str:
  """Train `config` to its end in tmp_path/reference, and in tmp_path/resumed stopped after just
  over half its steps and resumed; assert the loss falls by over a nat and both end in the same
  state, bit for bit. Returns the reference workdir."""
  import jax
  import numpy as np

  from mllm.paths import RunDir
  from mllm.train import train
  from mllm.train.metrics import read_metrics

  reference, resumed = str(tmp_path / 'reference'), str(tmp_path / 'resumed')
  train(config, reference, progress=False)
  losses = [r['loss'] for r in read_metrics(RunDir(reference).metrics) if r['split'] == 'train']
  assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0, losses
  train(config, resumed, stop_after=config.train.steps // 2 + 1, progress=False)
  train(config, resumed, progress=False)
  a, b = load_state(config, resumed), load_state(config, reference)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  return reference


def load_state(config, workdir, step=None):
  """The train state saved in `workdir` at `step` (default: the latest), read without tidying."""
  from mllm.train.checkpoint import Checkpointer
  from mllm.train.sharding import make_mesh
  from mllm.train.state import setup

  model, _ = setup(config, make_mesh(config.mesh))
  ckpt = Checkpointer(workdir, read_only=True)
  try:
    return ckpt.restore(ckpt.latest_step() if step is None else step, model.abstract_state)
  finally:
    ckpt.close()


def read_tensorboard_scalars(directory: str) -> dict[str, list[tuple[int, float]]]:
  """{tag: [(step, value), ...]} from the event files in `directory` (not its subfolders), parsed
  without TensorBoard: TFRecords of [u64 length][u32 crc][Event proto][u32 crc]."""
  import struct

  from tensorboardX.proto import event_pb2

  scalars = {}
  for name in sorted(os.listdir(directory)):
    path = os.path.join(directory, name)
    if not name.startswith('events') or not os.path.isfile(path):
      continue
    with open(path, 'rb') as f:
      raw = f.read()
    offset = 0
    while offset < len(raw):
      (length,) = struct.unpack('<Q', raw[offset : offset + 8])
      event = event_pb2.Event.FromString(raw[offset + 12 : offset + 12 + length])
      offset += 12 + length + 4
      for value in event.summary.value:
        if value.HasField('simple_value'):
          scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
  return scalars


def hand_made_results(losses: dict[str, list[float]], **fields) -> dict:
  """A suite's results.json from {variant: [eval loss of seed 0, 1, ...]}: the report's and the
  statistics' tests, with no training."""
  runs = [
    {
      'variant': name,
      'seed': seed,
      'eval_loss': loss,
      'params': 100,
      'active_params': 100,
      'tokens': 1000,
      'tokens_per_s': 1.0,
      'learning_rate': 1e-3,
      'train_flops': 1.0,
    }
    for name, values in losses.items()
    for seed, loss in enumerate(values)
  ]
  return {'runs': runs, 'failed': [], 'pending': [], **fields}
