"""The supervisor of a multi-process job's process (mllm/supervisor.py), with small Python children
standing in for launch.py: an abort becomes one line, exit codes pass through, a stop signal
reaches the child exactly once however it was sent, and the child dies with its supervisor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import CHILD_PYTHONPATH

from mllm import supervisor

pytestmark = pytest.mark.skipif(not sys.platform.startswith('linux'), reason='Linux signals')


def start(tmp_path, child_body: str, env_extra: dict | None = None) -> subprocess.Popen:
  """A supervisor (in its own session, so a group signal stays inside the test) of a child
  running `child_body` after `from mllm import supervisor`."""
  child = tmp_path / 'child.py'
  child.write_text('import os, signal, sys, time\nfrom mllm import supervisor\n' + child_body)
  code = (
    f'import sys\nfrom mllm import supervisor\nsys.exit(supervisor.supervise([{str(child)!r}]))'
  )
  env = dict(os.environ, PYTHONPATH=CHILD_PYTHONPATH, **(env_extra or {}))
  return subprocess.Popen(
    [sys.executable, '-c', code],
    cwd=tmp_path,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    start_new_session=True,
  )


def wait_for(path, timeout: float = 30.0) -> None:
  deadline = time.time() + timeout
  while not os.path.exists(path):
    assert time.time() < deadline, f'{path} never appeared'
    time.sleep(0.02)


def test_an_abort_after_a_dead_peer_ends_in_the_supervisors_one_line(tmp_path):
  """The child aborts as JAX's runtime does when its coordinator finds another task dead (its
  stack dump in the run log): the supervisor prints one line naming the process, the reason, the
  log, the last committed step and the command, exits 1; the dump is not on the terminal."""
  workdir, log = tmp_path / 'w', tmp_path / 'w' / 'run.1.log'
  body = f"""
os.makedirs({str(workdir)!r}, exist_ok=True)
supervisor.tell(process=1, count=2, workdir={str(workdir)!r}, log={str(log)!r})
supervisor.native_stderr_to({str(log)!r})
print('error-free line from Python', file=sys.stderr, flush=True)
os.write(2, b'F0000 coordination_service_agent.cc: another task died\\n*** stack dump ***\\n')
os.abort()
"""
  proc = start(tmp_path, textwrap.dedent(body))
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 1, err
  assert 'stack dump' not in err and 'another task died' in log.read_text()
  assert 'error-free line from Python' in err  # Python's stderr still reaches the terminal
  lines = [line for line in err.splitlines() if line.startswith('error:')]
  assert lines == [
    "error: process 1 of 2 lost the job (JAX's runtime aborted it: its coordinator found "
    f'another process of the job dead; details in {log}); no checkpoint is committed yet; run '
    'the same command in every process again to resume from it'
  ]


def test_exit_codes_pass_through_and_an_unexplained_signal_is_named(tmp_path):
  assert start(tmp_path, 'sys.exit(3)\n').wait(timeout=60) == 3
  proc = start(tmp_path, 'os.kill(os.getpid(), signal.SIGSEGV)\n')
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 1
  assert err.strip() == (
    'error: this process lost the job (it was ended by SIGSEGV); no checkpoint is committed '
    'yet; run the same command in every process again to resume from it'
  )


CHILD_COUNTING_SIGTERMS = """
supervisor.report_signals()
count = []
signal.signal(signal.SIGTERM, lambda s, f: count.append(s))
open('ready', 'w').close()
deadline = time.time() + 20
while time.time() < deadline and not count:
  time.sleep(0.01)
time.sleep(1.0)  # a doubled signal would arrive within the supervisor's grace
open('count', 'w').write(str(len(count)))
"""


@pytest.mark.parametrize('to', ['supervisor', 'group'])
def test_a_stop_signal_reaches_the_child_exactly_once(tmp_path, to):
  """SIGTERM to the supervisor alone is forwarded; to the whole process group (a terminal's
  Ctrl-C, a scheduler signalling every process) the child gets it directly and the supervisor,
  seeing the child's report, does not forward it again."""
  proc = start(tmp_path, CHILD_COUNTING_SIGTERMS)
  wait_for(tmp_path / 'ready')
  if to == 'supervisor':
    proc.send_signal(signal.SIGTERM)
  else:
    os.killpg(proc.pid, signal.SIGTERM)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 0, err
  assert (tmp_path / 'count').read_text() == '1'


def test_a_child_stopped_by_the_signal_it_was_sent_exits_quietly(tmp_path):
  """SIGTERM before the child installs its handler kills it: asked for, so no line; 128 + 15."""
  proc = start(tmp_path, "open('ready', 'w').close()\ntime.sleep(30)\n")
  wait_for(tmp_path / 'ready')
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 128 + signal.SIGTERM and 'error:' not in err


def test_the_child_dies_with_its_supervisor(tmp_path):
  proc = start(tmp_path, "open('pid', 'w').write(str(os.getpid()))\ntime.sleep(60)\n")
  wait_for(tmp_path / 'pid')
  time.sleep(0.1)  # the file may be empty for a moment
  child = int((tmp_path / 'pid').read_text())
  proc.kill()
  proc.wait(timeout=30)
  deadline = time.time() + 10
  while time.time() < deadline:
    try:
      os.kill(child, 0)
    except ProcessLookupError:
      return
    time.sleep(0.05)
  raise AssertionError('the child outlived its supervisor')


def test_only_a_process_of_several_is_supervised():
  assert not supervisor.wanted({})
  assert supervisor.wanted({'JAX_COORDINATOR_ADDRESS': 'h:1'})
  assert supervisor.wanted({'SLURM_NTASKS': '4'})
  assert not supervisor.wanted({'SLURM_NTASKS': '4', supervisor.CHILD_FD: '5'})
  assert not supervisor.wanted({'SLURM_NTASKS': '4', 'MLLM_SUPERVISE': '0'})


def test_the_supervisor_imports_no_jax_and_nothing_of_mllm_train():
  """It stays a small process: importing it loads neither JAX nor Orbax nor mllm.train."""
  code = (
    'import sys, mllm.supervisor; '
    "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'orbax') "
    "or m.startswith('mllm.train')))"
  )
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == '[]'
