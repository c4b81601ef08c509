"""Training as several processes, as on several hosts: `python -m mllm.multiprocess -n 2` starts
launch.py twice on localhost (JAX's multi-controller runtime, CPU collectives over gloo), 2 CPU
devices each, and the job must train what one process over the same 4-device mesh trains.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import LAUNCH_CONFIG, ROOT, cpu_devices_env, load_state, write_corpus

from mllm.train.metrics import read_metrics

pytestmark = pytest.mark.xdist_group('multiprocess')

STEPS = 6


def flags(corpus: str, cache: str, **overrides) -> list[str]:
  values = {
    'model.d_model': 32,
    'model.n_layers': 2,
    'model.n_heads': 2,
    'model.n_kv_heads': 2,
    'model.max_seq_len': 32,
    'model.dropout': 0.1,
    'data.seq_len': 32,
    'data.batch_size': 8,
    'train.steps': STEPS,
    'train.warmup_steps': 1,
    'train.eval_every': 0,
    'train.eval_batches': 2,
    'train.log_every': 1,
    'train.tensorboard': True,
    'data.source': 'text',
    'data.path': corpus,
    'data.tokenizer': 'bpe',
    'model.vocab_size': 300,
    'data.val_fraction': 0.3,
    'data.cache_dir': cache,
    'mesh.data': 2,
    'mesh.fsdp': 2,
    **overrides,
  }
  return [LAUNCH_CONFIG, *(f'--config.{k}={v}' for k, v in values.items())]


def launch(args: list[str], processes: int, devices: int) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  if processes > 1:
    command = [
      sys.executable,
      '-m',
      'mllm.multiprocess',
      '-n',
      str(processes),
      f'--devices={devices}',
      '--',
      'launch.py',
      *args,
    ]
  else:
    env = cpu_devices_env(devices)
    command = [sys.executable, 'launch.py', *args]
  proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc


def train_losses(workdir: str) -> list[tuple[int, float]]:
  return [
    (r['step'], r['loss'])
    for r in read_metrics(os.path.join(workdir, 'metrics.jsonl'))
    if r['split'] == 'train'
  ]


def saved_params(workdir: str):
  """The run's final parameters, restored in this process on one device (re-sharded from the
  4 devices of the 2 processes that wrote them)."""
  import mllm
  from mllm.train.resume import as_config, read_config_json

  saved = read_config_json(workdir)
  assert (saved['mesh']['data'], saved['mesh']['fsdp']) == (2, 2)
  config = mllm.load_config(
    as_config(saved, mllm.load_config('configs/base.py')), {'mesh.data': 1, 'mesh.fsdp': 1}
  )
  return load_state(config, workdir)['params']


# Session scope (with a corpus of its own): pytest-xdist may run other modules' tests between this
# module's on the same worker, and a module fixture would then be built again (a minute each).
@pytest.fixture(scope='session')
def runs(tmp_path_factory):
  """The same config trained by 1 process x 4 devices and by 2 processes x 2 devices."""
  corpus = write_corpus(tmp_path_factory.mktemp('corpus'))
  cache = str(tmp_path_factory.mktemp('cache'))
  dirs = {name: str(tmp_path_factory.mktemp(name)) for name in ('one', 'two')}
  launch(flags(corpus, cache) + [f'--workdir={dirs["one"]}'], processes=1, devices=4)
  two = launch(flags(corpus, cache) + [f'--workdir={dirs["two"]}'], processes=2, devices=2)
  return corpus, cache, dirs, two.stdout


@pytest.fixture(scope='session')
def resumed(runs, tmp_path_factory):
  """The workdir of `runs`' 2-process config stopped at step 3 (--stop_after) and started again."""
  corpus, cache, _, _ = runs
  workdir = str(tmp_path_factory.mktemp('resumed'))
  launch(flags(corpus, cache) + [f'--workdir={workdir}', '--stop_after=3'], processes=2, devices=2)
  launch(flags(corpus, cache) + [f'--workdir={workdir}'], processes=2, devices=2)
  return workdir


def test_two_processes_train_what_one_process_trains(runs):
  """Every step's loss agrees (float32, 1e-5 relative: the batch's rows sit on other devices, so
  sums reassociate) and so do the final parameters, on a (data 2, fsdp 2) mesh whose data axis
  spans the two processes; dropout on."""
  _, _, dirs, _ = runs
  one, two = train_losses(dirs['one']), train_losses(dirs['two'])
  assert [s for s, _ in one] == [s for s, _ in two] == list(range(1, STEPS + 1))
  np.testing.assert_allclose([loss for _, loss in two], [loss for _, loss in one], rtol=1e-5)
  import jax

  for a, b in zip(
    jax.tree.leaves(saved_params(dirs['two'])), jax.tree.leaves(saved_params(dirs['one']))
  ):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_process_zero_alone_writes_the_run_files(runs):
  """metrics.jsonl has each step once, TensorBoard one event file, the log one summary line
  (process 0's); both processes started, each on its 2 devices of the 4."""
  _, _, dirs, stdout = runs
  records = read_metrics(os.path.join(dirs['two'], 'metrics.jsonl'))
  steps = [(r['step'], r['split']) for r in records]
  assert len(steps) == len(set(steps))
  events = [
    f
    for _, _, files in os.walk(os.path.join(dirs['two'], 'tensorboard'))
    for f in files
    if f.startswith('events.')
  ]
  assert len(events) == 1
  assert stdout.count('done at step') == 1 and '[0] done at step' in stdout
  assert '4 × cpu' in stdout


# Slow (two more 2-process launches): resuming is tested bitwise in one process in the fast run
# (test_train.py, test_resume.py); here, across processes.
@pytest.mark.slow
def test_a_two_process_run_resumes_bitwise_in_two_processes(runs, resumed):
  _, _, dirs, _ = runs
  assert train_losses(resumed) == train_losses(dirs['two'])
  import jax

  for a, b in zip(
    jax.tree.leaves(saved_params(resumed)), jax.tree.leaves(saved_params(dirs['two']))
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_launcher_environment_and_bad_cluster_variables(monkeypatch):
  """Each process gets the coordinator, the count and its id, and on CPU its devices; a job
  named by JAX_COORDINATOR_ADDRESS without the other two is refused in one line."""
  from mllm.checks import InputError
  from mllm.multiprocess import process_env
  from mllm.train.cluster import explicit_cluster

  env = process_env(1, 2, 1234, devices=2, base={'XLA_FLAGS': '--xla_foo=1'})
  assert env['JAX_COORDINATOR_ADDRESS'] == '127.0.0.1:1234'
  assert (env['JAX_NUM_PROCESSES'], env['JAX_PROCESS_ID']) == ('2', '1')
  assert env['XLA_FLAGS'] == '--xla_foo=1 --xla_force_host_platform_device_count=2'
  assert explicit_cluster(env) == {
    'coordinator_address': '127.0.0.1:1234',
    'num_processes': 2,
    'process_id': 1,
  }
  assert explicit_cluster({}) == {}  # SLURM, Open MPI, TPU pods: JAX finds the job itself
  with pytest.raises(InputError, match=r"JAX_NUM_PROCESSES='\(unset\)': JAX_COORDINATOR"):
    explicit_cluster({'JAX_COORDINATOR_ADDRESS': 'h:1', 'JAX_PROCESS_ID': '0'})
  with pytest.raises(InputError, match=r'JAX_PROCESS_ID=2: allowed: 0 to JAX_NUM_PROCESSES'):
    explicit_cluster(
      {'JAX_COORDINATOR_ADDRESS': 'h:1', 'JAX_NUM_PROCESSES': '2', 'JAX_PROCESS_ID': '2'}
    )


def _start_job(args: list[str], processes: int, env_extra: dict | None = None):
  """The job's processes, started as mllm.multiprocess starts them, but held here so a test
  can signal one of them."""
  from mllm.multiprocess import free_port, process_env

  port = free_port()
  base = dict(os.environ, JAX_PLATFORMS='cpu', **(env_extra or {}))
  return [
    subprocess.Popen(
      [sys.executable, 'launch.py', *args],
      cwd=ROOT,
      env=process_env(i, processes, port, 2, base),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(processes)
  ]


def _wait_for_steps(workdir: str, steps: int, procs) -> None:
  import time

  metrics = os.path.join(workdir, 'metrics.jsonl')
  deadline = time.time() + 240
  while time.time() < deadline:
    if os.path.exists(metrics) and len(read_metrics(metrics)) >= steps:
      return
    assert all(p.poll() is None for p in procs), [p.communicate()[0][-2000:] for p in procs]
    time.sleep(0.1)
  raise AssertionError('the job made no progress')


# Slow (45 s): one process's SIGTERM is tested in the fast run (test_train.py); here, that the
# processes of a job agree on the step.
@pytest.mark.slow
def test_sigterm_to_one_process_stops_the_whole_job_at_one_step(corpus, tmp_path):
  """A scheduler's SIGTERM can reach the processes a step apart, or only one: they agree to
  stop, save the same step once and all exit 0; started again, the job resumes from it."""
  args = flags(corpus, str(tmp_path / 'cache'), **{'train.steps': 100_000}) + [
    f'--workdir={tmp_path / "w"}'
  ]
  procs = _start_job(args, 2)
  _wait_for_steps(str(tmp_path / 'w'), 3, procs)
  import signal

  procs[1].send_signal(signal.SIGTERM)
  outs = [p.communicate(timeout=120)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
  assert 'a signal to another process of the job: saved step' in outs[0]
  from mllm.train.checkpoint import Checkpointer

  ckpt = Checkpointer(str(tmp_path / 'w'), read_only=True)
  saved = ckpt.all_steps()
  ckpt.close()
  assert len(saved) == 1 and f'saved step {saved[0]} ' in outs[0]
  resumed = launch(args + [f'--stop_after={saved[0] + 2}'], processes=2, devices=2)
  assert f'resuming from step {saved[0]}' in resumed.stdout
  assert f'stopped at step {saved[0] + 2}' in resumed.stdout or (
    f'done at step {saved[0] + 2}' in resumed.stdout
  )


@pytest.mark.slow
def test_a_killed_process_ends_the_others_within_the_heartbeat_timeout(corpus, tmp_path):
  """SIGKILL to one process (a lost host): the other ends, no hang, in one line naming the last
  committed step, exit 1, no traceback, whichever way JAX's runtime noticed (mllm/train/peers.py):
  its failed collective caught in the process, or the coordinator's abort, which the process's
  supervisor reports (mllm/supervisor.py; the abort's stack dump goes to the run log). The same
  command resumes from the last committed step."""
  import signal
  import time

  from mllm.paths import committed_steps

  workdir = str(tmp_path / 'w')
  args = flags(corpus, str(tmp_path / 'cache'), **{'train.steps': 100_000}) + [
    f'--workdir={workdir}',
    '--config.train.checkpoint_every=10',
  ]
  procs = _start_job(args, 2, {'MLLM_HEARTBEAT_TIMEOUT_S': '10'})
  _wait_for_steps(workdir, 25, procs)
  killed_at = time.time()
  procs[1].send_signal(signal.SIGKILL)  # its supervisor: the training child dies with it
  out = procs[0].communicate(timeout=120)[0]
  procs[1].communicate()
  assert time.time() - killed_at < 60
  last = committed_steps(workdir)[-1]
  lines = [line for line in out.splitlines() if line.startswith('error:')]
  assert procs[0].returncode == 1 and len(lines) == 1 and 'Traceback' not in out, out[-3000:]
  print(lines[0])  # which way JAX noticed (visible with -s)
  assert lines[0].startswith('error: process 0 of 2 lost the job (')
  assert any(
    how in lines[0]
    for how in ('(a collective failed: ', "(JAX's runtime aborted it: its coordinator found")
  ), lines[0]
  assert 'stack' not in out.lower(), out[-3000:]
  assert lines[0].endswith(
    f'the last committed checkpoint in {workdir} is step {last}; run the same command in '
    'every process again to resume from it'
  )
  resumed = launch(args + [f'--stop_after={last + 2}'], processes=2, devices=2)
  assert f'resuming from step {last}' in resumed.stdout


def test_eval_runs_in_several_processes_and_generation_refuses(runs):
  """--mode=eval under 2 processes prints process 0's line once, the run's final val loss;
  --mode=generate refuses in one line (it decodes in one process)."""
  _, _, dirs, _ = runs
  args = flags(*runs[:2]) + [f'--workdir={dirs["two"]}']
  out = launch(args + ['--mode=eval'], processes=2, devices=2).stdout
  lines = [ln for ln in out.splitlines() if 'val loss' in ln]
  final = [
    r for r in read_metrics(os.path.join(dirs['two'], 'metrics.jsonl')) if r['split'] == 'eval'
  ][-1]
  assert len(lines) == 1 and lines[0].startswith('[0] ')
  assert f"val loss {final['loss']:.4f}" in lines[0]
  env = dict(
    os.environ,
    JAX_PLATFORMS='cpu',
    JAX_COORDINATOR_ADDRESS='127.0.0.1:1',
    JAX_NUM_PROCESSES='2',
    JAX_PROCESS_ID='0',
  )
  proc = subprocess.run(
    [sys.executable, 'launch.py', *args, '--mode=generate', '--prompt=def '],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines() == [
    "error: --mode='generate': decodes in one process (a checkpoint written by several "
    'processes restores in one); allowed: start it once, without the cluster variables '
    '(JAX_COORDINATOR_ADDRESS, SLURM_NTASKS > 1, ...)'
  ]


@pytest.mark.slow
def test_four_processes_with_experts_match_one_and_restore_a_two_process_run(runs, tmp_path):
  """4 processes x 1 device: an MoE model on (fsdp 2, expert 2), both axes across processes,
  trains the losses of 1 process x 4 devices; and the 2-process run's checkpoint, written on 2 x 2
  devices, resumes in 4 processes (each restores its own shards; the data position is the
  global batch count, which the 2 processes' files agree on) as it resumes in 2."""
  corpus, cache, dirs, _ = runs
  moe = {
    'model.ffn.kind': 'moe',
    'model.ffn.moe.num_experts': 4,
    'model.ffn.moe.top_k': 2,
    'mesh.data': 1,
    'mesh.fsdp': 2,
    'mesh.expert': 2,
  }
  one, four = str(tmp_path / 'one'), str(tmp_path / 'four')
  launch(flags(corpus, cache, **moe) + [f'--workdir={one}'], processes=1, devices=4)
  launch(flags(corpus, cache, **moe) + [f'--workdir={four}'], processes=4, devices=1)
  np.testing.assert_allclose(
    [loss for _, loss in train_losses(four)], [loss for _, loss in train_losses(one)], rtol=1e-5
  )
  import shutil

  longer = flags(corpus, cache, **{'train.steps': STEPS + 2})
  for name, processes, devices in (('in_two', 2, 2), ('in_four', 4, 1)):
    shutil.copytree(dirs['two'], str(tmp_path / name))
    more = launch(longer + [f'--workdir={tmp_path / name}'], processes=processes, devices=devices)
    assert f'resuming from step {STEPS}' in more.stdout and '4 × cpu' in more.stdout
  in_two, in_four = train_losses(str(tmp_path / 'in_two')), train_losses(str(tmp_path / 'in_four'))
  assert [s for s, _ in in_four] == list(range(1, STEPS + 3))
  np.testing.assert_allclose([loss for _, loss in in_four], [loss for _, loss in in_two], rtol=1e-5)


def test_a_data_position_saved_by_another_process_count(tmp_path):
  """One process resuming a 2-process checkpoint takes the data position the two files agree
  on; files that disagree are refused in one line naming the process counts."""
  from mllm.checks import InputError
  from mllm.train.checkpoint import Checkpointer

  ckpt = Checkpointer(str(tmp_path), read_only=True)
  folder = tmp_path / 'checkpoints' / '6' / 'data'
  folder.mkdir(parents=True)
  for i in range(2):
    (folder / f'process_{i}-of-2.json').write_text(json.dumps({'next_index': 6}))
  assert ckpt.data_state_of_another_job(6) == {'next_index': 6}
  (folder / 'process_1-of-2.json').write_text(json.dumps({'next_index': 7}))
  with pytest.raises(
    InputError,
    match=r'saved by 2 processes whose data positions differ .* '
    'cannot be resumed by 1; allowed: resume it with 2',
  ):
    ckpt.data_state_of_another_job(6)
  (folder / 'process_0-of-1.json').write_text(json.dumps({'next_index': 6}))
  assert ckpt.data_state_of_another_job(6) is None  # this job's own file: grain reads it
  ckpt.close()
