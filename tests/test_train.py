"""The training loop end to end on a tiny model and a small local corpus (byte tokenizer).

Exactness: a resumed run (after a planned stop or a SIGTERM) must give bitwise the same parameters
and optimizer state as an uninterrupted one on the same backend (on a GPU with deterministic
reductions, --xla_gpu_deterministic_ops, as `make test-gpu` sets).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import (
  CHILD_PYTHONPATH,
  LAUNCH_CONFIG,
  ROOT,
  STEPS,
  load_state,
  make_config,
  read_tensorboard_scalars,
  run_overrides,
)

from mllm.checks import InputError
from mllm.config import ConfigError
from mllm.paths import RunDir
from mllm.train import TrainingDiverged, evaluate, train
from mllm.train.checkpoint import Checkpointer
from mllm.train.metrics import read_metrics
from mllm.train.sharding import make_mesh
from mllm.train.state import setup

# One xdist worker runs this whole file, so the module-scoped reference run is trained once.
pytestmark = pytest.mark.xdist_group('train')


def assert_bitwise_equal(a, b):
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b)
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope='module')
def reference_run(corpus, tmp_path_factory):
  """STEPS uninterrupted steps (with dropout on, so the RNG path is exercised)."""
  cache = str(tmp_path_factory.mktemp('cache'))
  workdir = str(tmp_path_factory.mktemp('reference'))
  config = make_config(corpus, cache, train__tensorboard=True, train__peak_flops=1e12)
  summary = train(config, workdir, progress=False)
  return config, workdir, summary, cache


def test_loss_falls_and_metrics_are_written(reference_run):
  config, workdir, summary, _ = reference_run
  records = read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  train_losses = [r['loss'] for r in records if r['split'] == 'train']
  assert len(train_losses) == STEPS
  first, last = np.mean(train_losses[:5]), np.mean(train_losses[-5:])
  assert first > math.log(258) - 0.5  # starts near uniform over the byte vocabulary
  assert last < first - 1.0, (first, last)
  assert all(
    r['tokens_per_s'] > 0 and r['step_time_s'] > 0 and math.isfinite(r['log_z'])
    for r in records
    if r['split'] == 'train'
  )
  # MFU = FLOPs/token × tokens/s ÷ peak, with 6·N + attention FLOPs at the training length.
  from mllm.accounting import count_params, training_flops_per_token

  flops = training_flops_per_token(config, count_params(config), config.data.seq_len).total
  for r in records:
    if r['split'] == 'train':
      assert r['mfu'] == pytest.approx(flops * r['tokens_per_s'] / 1e12, rel=1e-4)
  evals = [r for r in records if r['split'] == 'eval']
  assert evals and evals[-1]['step'] == STEPS
  assert summary['step'] == STEPS and summary['eval']['loss'] == pytest.approx(
    evals[-1]['loss'], rel=1e-5
  )
  assert os.path.isfile(os.path.join(workdir, 'loss.png'))
  scalars = read_tensorboard_scalars(os.path.join(workdir, 'tensorboard'))
  tb_losses = [v for _, v in sorted(scalars['train/loss'])]
  np.testing.assert_allclose(tb_losses, train_losses, rtol=1e-5)
  assert [s for s, _ in scalars['eval/bits_per_byte']] == [STEPS]
  assert os.path.isfile(os.path.join(workdir, 'config.json'))


def test_the_run_folder_holds_what_rundir_names_and_nothing_else(reference_run):
  """RunDir is the one place a run's file names are written: every file training leaves is one
  of its names (a byte-level run has no tokenizer.json; run.log only if a library logged)."""
  _, workdir, _, _ = reference_run
  run = RunDir(workdir)
  named = {run.config, run.checkpoints, run.metrics, run.tensorboard, run.loss_plot, run.tokenizer}
  present = {os.path.join(os.path.abspath(workdir), name) for name in os.listdir(workdir)}
  present.discard(os.path.abspath(run.run_log()))
  assert present == {os.path.abspath(p) for p in named} - {os.path.abspath(run.tokenizer)}


def test_learning_rate_follows_warmup_then_cosine(reference_run):
  config, workdir, _, _ = reference_run
  t = config.train
  lrs = {
    r['step']: r['learning_rate']
    for r in read_metrics(os.path.join(workdir, 'metrics.jsonl'))
    if r['split'] == 'train'
  }
  for step, lr in lrs.items():  # the update of step s (1-based) uses the rate at s
    if step <= t.warmup_steps:
      expected = t.learning_rate * step / t.warmup_steps
    else:
      frac = (step - t.warmup_steps) / (t.steps - t.warmup_steps)
      floor = t.learning_rate * t.min_lr_ratio
      expected = floor + (t.learning_rate - floor) * 0.5 * (1 + math.cos(math.pi * frac))
    assert lr == pytest.approx(expected, rel=1e-4), step


def test_resume_after_a_stop_is_bitwise_exact(reference_run, corpus, tmp_path):
  config, ref_dir, _, _cache = reference_run
  workdir = str(tmp_path / 'resumed')
  first = train(config, workdir, stop_after=STEPS // 2 - 3, progress=False)
  assert first['step'] == STEPS // 2 - 3
  second = train(config, workdir, progress=False)
  assert second['step'] == STEPS
  assert_bitwise_equal(load_state(config, workdir), load_state(config, ref_dir))
  assert second['eval']['loss'] == pytest.approx(load_metric_eval(ref_dir), rel=1e-5)

  # A damaged newest checkpoint: eval passes over it (and leaves it where it is).
  for root, _, files in os.walk(os.path.join(workdir, 'checkpoints', str(STEPS), 'state')):
    for name in files:
      with open(os.path.join(root, name), 'wb') as f:
        f.write(b'garbage')
  result = evaluate(config, workdir)
  assert result['step'] == STEPS // 2 - 3
  assert os.path.isdir(os.path.join(workdir, 'checkpoints', str(STEPS)))


def load_metric_eval(workdir):
  return [r for r in read_metrics(os.path.join(workdir, 'metrics.jsonl')) if r['split'] == 'eval'][
    -1
  ]['loss']


def test_a_finished_run_started_again_says_nothing_is_left(reference_run, tmp_path, capsys):
  """Resumed at its last step, a run trains nothing and reports the losses it ended with (it
  printed 'train loss nan' before)."""
  import shutil

  config, workdir, summary, _ = reference_run
  again = str(tmp_path / 'again')
  shutil.copytree(workdir, again)
  capsys.readouterr()
  repeat = train(config, again, progress=True)
  assert repeat['step'] == summary['step'] == STEPS
  # Its train loss is read back from metrics.jsonl, which keeps 6 significant digits (1e-6
  # relative failed where rounding moved it more: 3.0368233 became 3.03682); eval runs again.
  assert repeat['train_loss'] == float(f'{summary["train_loss"]:.6g}')
  assert repeat['eval']['loss'] == pytest.approx(summary['eval']['loss'], rel=1e-6)
  captured = capsys.readouterr()
  out = captured.out + captured.err
  assert f'nothing left to train: the run is at step {STEPS} already' in out
  assert 'nan' not in out


def test_sigterm_saves_exits_cleanly_and_resumes_exactly(reference_run, corpus, tmp_path):
  _config, _ref_dir, _, cache = reference_run
  workdir = str(tmp_path / 'killed')
  flags = [f'--config.{k}={v}' for k, v in run_overrides(corpus, cache).items()]
  flags += ['--config.train.steps=400']  # long enough to be killed mid-way; checked below
  # The schedule depends on train.steps, so the killed run trains its own 400-step schedule and
  # is compared against a planned stop of the same config below. The killed run uses this
  # process's backend: its steps and the resumed ones must be the planned run's, bit for bit.
  env = dict(os.environ)
  if jax.default_backend() == 'cpu':
    env['JAX_PLATFORMS'] = 'cpu'
  proc = subprocess.Popen(
    [sys.executable, 'launch.py', LAUNCH_CONFIG, f'--workdir={workdir}', *flags],
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  metrics = os.path.join(workdir, 'metrics.jsonl')
  deadline = time.time() + 240
  while time.time() < deadline and proc.poll() is None:
    if os.path.exists(metrics) and len(read_metrics(metrics)) >= 3:
      break
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err
  assert 'SIGTERM: saved step' in out, out
  ckpt = Checkpointer(workdir, max_to_keep=3, async_save=False)
  killed_at = ckpt.latest_step()
  ckpt.close()
  assert 3 <= killed_at < 400
  long_config = make_config(corpus, cache, train__steps=400)
  resumed = train(long_config, workdir, stop_after=killed_at + 5, progress=False)
  assert resumed['step'] == killed_at + 5
  planned = str(tmp_path / 'planned')
  train(long_config, planned, stop_after=killed_at + 5, progress=False)
  assert_bitwise_equal(load_state(long_config, workdir), load_state(long_config, planned))


def test_a_second_signal_stops_at_once_in_one_line(corpus, tmp_path):
  """SIGTERM asks for a save; a second one, while it is pending, stops at once: exit 130 and one
  line (or 0, if the save won the race), never a traceback or an interpreter crash."""
  flags = [f'--config.{k}={v}' for k, v in run_overrides(corpus, str(tmp_path / 'cache')).items()]
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  proc = subprocess.Popen(
    [
      sys.executable,
      'launch.py',
      LAUNCH_CONFIG,
      f'--workdir={tmp_path / "w"}',
      *flags,
      '--config.train.steps=100000',
    ],
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  metrics = tmp_path / 'w' / 'metrics.jsonl'
  deadline = time.time() + 240
  while time.time() < deadline and not (metrics.exists() and metrics.stat().st_size):
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  time.sleep(0.01)
  if proc.poll() is None:
    proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=120)
  assert 'Traceback' not in out + err and 'Fatal Python error' not in err, (out, err)
  assert proc.returncode in (0, 130), (proc.returncode, err)
  if proc.returncode == 130:
    lines = err.strip().splitlines()  # tqdm's tokenizing bar may come first
    assert (
      lines[-1] == 'error: interrupted; the latest saved checkpoint is kept, run again to resume'
    )
    assert sum(line.startswith('error:') for line in lines) == 1


def test_eval_equals_a_direct_computation(reference_run):
  config, workdir, _, _ = reference_run
  from mllm.data import build_data

  result = evaluate(config, workdir)
  assert result['step'] == STEPS
  state = load_state(config, workdir)
  model, _ = setup(config, make_mesh(config.mesh))
  net = model.merge(state['params'])
  net.eval()
  data = build_data(config, workdir, verbose=False)
  nats = tokens = n_bytes = 0.0
  for batch in data.eval_batches(config.train.eval_batches):
    logits = np.asarray(
      net(batch['inputs'], positions=batch['positions'], segment_ids=batch['segment_ids']),
      np.float64,
    )
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, batch['targets'][..., None], -1)[..., 0]
    nats += (nll * batch['loss_mask']).sum()
    tokens += batch['loss_mask'].sum()
    # Byte tokenizer: every id below 256 is one byte, the specials none.
    n_bytes += ((batch['targets'] < 256) * batch['loss_mask']).sum()
  assert tokens > 0 and result['tokens'] == tokens
  assert result['loss'] == pytest.approx(nats / tokens, rel=1e-5)
  assert result['perplexity'] == pytest.approx(math.exp(nats / tokens), rel=1e-5)
  assert result['bits_per_byte'] == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)


def _diverge(corpus, tmp_path, checkpoint_every: int):
  """Train at a rate of 1e30 until the loss is not finite: (the config, its workdir, the
  TrainingDiverged it raised, the latest checkpoint step or None)."""
  config = make_config(
    corpus,
    str(tmp_path / 'cache'),
    train__learning_rate=1e30,
    train__warmup_steps=0,
    train__grad_clip=0.0,
    train__checkpoint_every=checkpoint_every,
    train__schedule='constant',
    model__dropout=0.0,
  )
  workdir = str(tmp_path / 'nan')
  with pytest.raises(TrainingDiverged, match=r'at step (\d+)') as info:
    train(config, workdir, progress=False)
  ckpt = Checkpointer(workdir, max_to_keep=3, async_save=False)
  latest = ckpt.latest_step()
  ckpt.close()
  return config, workdir, info.value, latest


def test_non_finite_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(corpus, tmp_path):
  config, workdir, error, latest = _diverge(corpus, tmp_path, checkpoint_every=1)
  message = str(error)
  bad_step = int(message.split('at step ')[1].split(';')[0])
  assert latest == bad_step - 1
  state = load_state(config, workdir)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state['params']))


def test_bare_step_directory_is_skipped_and_moved_aside_by_training(
  reference_run, tmp_path, capsys
):
  config, ref_dir, _, _ = reference_run
  import shutil

  workdir = str(tmp_path / 'copy')
  shutil.copytree(ref_dir, workdir)
  bogus = os.path.join(workdir, 'checkpoints', str(STEPS + 10))
  os.makedirs(os.path.join(bogus, 'state'))  # what a half-finished copy leaves behind
  assert evaluate(config, workdir)['step'] == STEPS  # eval passes over it, touching nothing
  assert os.path.isdir(bogus)
  assert train(config, workdir, progress=False)['step'] == STEPS  # nothing left to train
  out = capsys.readouterr().out
  assert f'checkpoint step {STEPS + 10} in ' in out and 'no commit marker' in out
  assert not os.path.exists(bogus)
  assert [n for n in os.listdir(os.path.dirname(bogus)) if '.incomplete-' in n]


def test_eval_without_checkpoint_is_an_input_error(corpus, tmp_path):
  config = make_config(corpus, str(tmp_path / 'cache'))
  with pytest.raises(InputError, match=r"^--workdir='.*/nope': no such folder"):
    evaluate(config, str(tmp_path / 'nope'))
  with pytest.raises(InputError, match='has no checkpoint') as info:
    evaluate(config, str(tmp_path))
  assert not isinstance(info.value, ConfigError)  # a flag's problem, not a config key's
  os.makedirs(tmp_path / 'checkpoints')
  with pytest.raises(InputError, match='has no checkpoint') as info:
    evaluate(config, str(tmp_path))
  assert not isinstance(info.value, ConfigError)  # a flag's problem, not a config key's


def test_gradient_accumulation_equals_the_full_batch(corpus, tmp_path):
  from mllm.train.sharding import global_batch
  from mllm.train.step import make_train_step, synthetic_batch

  losses, states = [], []
  for accum in (1, 2):
    config = make_config(corpus, 'x', train__grad_accum_steps=accum, model__dropout=0.0)
    mesh = make_mesh(config.mesh)
    model, init = setup(config, mesh)
    step, state = make_train_step(model), init()
    batch = synthetic_batch(config, np.random.default_rng(1))
    batch['loss_mask'][:, -5:] = 0  # uneven token counts per micro-batch are weighted correctly
    batch['loss_mask'][1, :] = 0
    for _ in range(2):
      state, metrics = step(state, global_batch(batch, mesh))
      losses.append(float(metrics['loss']))
    states.append(jax.device_get(state['params']))
  np.testing.assert_allclose(losses[:2], losses[2:], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1])):
    # Adam divides by √v: where a gradient is ~0, float32 reassociation moves the update by a
    # small fraction of the learning rate (3e-3).
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


def test_tensorboard_logging_does_not_import_torch(tmp_path):
  """tensorboardX imports torch whenever it is installed (3.8-4.1 s of a run's start-up on a GPU
  image, 2026-11-27); the metrics writer takes it without, and its scalars still land. A fake
  torch package on the path records whether anything imported it; a later import still works."""
  fake = tmp_path / 'site' / 'torch'
  fake.mkdir(parents=True)
  marker = tmp_path / 'torch_was_imported'
  (fake / '__init__.py').write_text(f'open({str(marker)!r}, "w").close()\nTensor = object\n')
  program = f"""
import sys
from mllm.train.metrics import MetricsWriter
writer = MetricsWriter({str(tmp_path / 'run')!r}, tensorboard=True)
writer.write(1, 'train', {{'loss': 2.5}})
writer.close()
assert 'torch' not in sys.modules, 'torch stayed loaded'
import torch  # the user's own import is untouched
print('ok')
"""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / 'site'), CHILD_PYTHONPATH]))
  done = subprocess.run(
    [sys.executable, '-c', program], env=env, capture_output=True, text=True, timeout=120
  )
  assert done.returncode == 0 and done.stdout.strip() == 'ok', done.stderr
  assert marker.exists()  # imported once: by the program's own `import torch`, at the end
  scalars = read_tensorboard_scalars(str(tmp_path / 'run' / 'tensorboard'))
  assert scalars['train/loss'] == [(1, 2.5)]


def test_the_first_step_line_splits_the_start_up(reference_run, tmp_path, capsys):
  """The first step's line says where start-up went: opening the run (the devices, the data),
  the state, building the steps, compiling; the parts fit inside their totals (each rounded to
  0.1 s)."""
  import re

  config, _, _, _ = reference_run
  capsys.readouterr()
  train(config, str(tmp_path / 'w'), progress=True, stop_after=2)
  captured = capsys.readouterr()
  line = re.search(
    r'first step after ([\d.]+) s from the start of train\(\) \(open ([\d.]+) s with devices '
    r'([\d.]+) s and data ([\d.]+) s, init ([\d.]+) s, then ([\d.]+) s to the first step, '
    r'compile \+ step ([\d.]+) s',
    captured.out + captured.err,
  )
  assert line, captured.out + captured.err
  total, opened, devices, data, init, then, compiled = map(float, line.groups())
  assert devices + data <= opened + 0.15
  assert opened + init + then + compiled <= total + 0.25


def test_a_steps_metrics_are_read_while_the_next_runs_and_a_save_waits_for_it(
  corpus, tmp_path, monkeypatch
):
  """On one device the loop reads step k's metrics (and runs its hooks) once step k + 1 is
  dispatched; a step whose hooks read the state (a checkpoint, an evaluation) is finished before
  the next starts, and its hooks see the state. A hook given to train() runs after the built-in
  ones, at its own interval."""
  import mllm.train.loop as loop
  from mllm.train.hooks import Hook

  events = []
  make_step = loop.make_train_step

  def recording(setup_):
    step = make_step(setup_)

    def dispatch(state, batch):
      out = step(state, batch)
      events.append('D')
      return out

    return dispatch

  monkeypatch.setattr(loop, 'make_train_step', recording)
  config = make_config(
    corpus, str(tmp_path / 'cache'), train__steps=6, train__checkpoint_every=3, train__eval_every=0
  )
  seen = Hook('record', lambda info: events.append((info.step, info.state is not None)))
  train(config, str(tmp_path / 'run'), progress=False, hooks=(seen,))
  assert events == ['D', 'D', (1, False), 'D', (2, False), (3, True)] + [
    'D',
    'D',
    (4, False),
    'D',
    (5, False),
    (6, True),
  ]
  # Its own interval: every 2nd step (and the last).
  events.clear()
  every2 = Hook('record', lambda info: events.append(info.step), every=2)
  train(
    config.copy_and_resolve_references(), str(tmp_path / 'run2'), progress=False, hooks=(every2,)
  )
  assert [e for e in events if e != 'D'] == [2, 4, 6]


def test_a_divergence_read_a_step_late_saves_nothing_of_it(corpus, tmp_path):
  """With the metrics read a step late, a non-finite step still stops the run naming that step,
  before any save of it or after it (saves wait for their step's metrics)."""
  _, _, error, latest = _diverge(corpus, tmp_path, checkpoint_every=4)
  assert error.step <= 4
  assert latest is None or latest < error.step


def test_the_profiler_hook_traces_the_steps_it_names(corpus, tmp_path):
  """`launch.py --profile=2:3`'s hook: a jax.profiler trace (xplane) of those steps in its folder;
  a first step of 1 (the compile) is refused."""
  from mllm.train.hooks import profiler

  config = make_config(
    corpus, str(tmp_path / 'cache'), train__steps=5, train__warmup_steps=1, train__eval_every=0
  )
  out = tmp_path / 'profile'
  train(config, str(tmp_path / 'run'), progress=False, hooks=(profiler(str(out), 2, 3),))
  traces = list(out.glob('plugins/profile/*/*.xplane.pb'))
  assert len(traces) == 1 and traces[0].stat().st_size > 0
  with pytest.raises(ValueError, match='allowed: 2 <= first <= last'):
    profiler(str(out), 1, 3)
