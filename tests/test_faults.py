"""Faults of the machine end in one line, as bad inputs do: a full disk during a save (a real small
filesystem: a tmpfs, mounted as root or in a user namespace) and an unreadable newest checkpoint
(its array files overwritten). Each asserts the line, the exit status, no traceback on stderr, and
that a relaunch resumes from the last good step."""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import subprocess
import sys

import launch_server
import pytest
from conftest import LAUNCH_CONFIG, ROOT, run_overrides

from mllm.paths import committed_steps

STEPS, EVERY = 100, 20


def launch_args(corpus: str, cache: str, workdir: str, steps: int) -> list[str]:
  """launch.py's arguments for a run of `steps` steps that saves every EVERY."""
  overrides = run_overrides(corpus, cache, train__steps=steps, train__checkpoint_every=EVERY)
  flags = [f'--config.{k}={v}' for k, v in overrides.items()]
  return [LAUNCH_CONFIG, f'--workdir={workdir}', *flags]


def launch_command(corpus: str, cache: str, workdir: str, steps: int) -> list[str]:
  return [sys.executable, 'launch.py', *launch_args(corpus, cache, workdir, steps)]


def messages(stderr: str) -> list[str]:
  """stderr's lines without progress bars ('tokenizing: 100%|███| 133k/133k [...]')."""
  lines = re.split(r'[\r\n]', stderr)
  return [line for line in lines if line.strip() and not re.search(r'\d+%\|', line)]


def cpu_env() -> dict:
  return dict(os.environ, JAX_PLATFORMS='cpu')


def in_a_small_filesystem(script: str) -> list[str]:
  """`sh -c script` where `mount` works: as root here, else in a user namespace (unshare -rm)."""
  if os.geteuid() == 0:
    return ['sh', '-c', script]
  if shutil.which('unshare') and subprocess.run(['unshare', '-rm', 'true']).returncode == 0:
    return ['unshare', '-rm', 'sh', '-c', script]
  pytest.skip('no way to mount a small filesystem here (not root, no user namespaces)')


def test_a_full_disk_ends_in_one_line_and_the_run_resumes_from_the_last_good_step(corpus, tmp_path):
  disk, cache = tmp_path / 'disk', tmp_path / 'cache'
  disk.mkdir()
  workdir = str(disk / 'run')
  run = shlex.join(launch_command(corpus, str(cache), workdir, STEPS))
  out = {n: tmp_path / n for n in ('out1', 'err1', 'out2', 'err2')}
  # Two checkpoints of the tiny model (~470 KB each) fit in 1.2 MB, the third does not; then the
  # disk grows and the same command resumes.
  script = (
    f'mount -t tmpfs -o size=1200k tmpfs {disk} || exit 90; '
    f'{run} > {out["out1"]} 2> {out["err1"]}; echo $? > {tmp_path}/rc1; '
    f'ls -a {workdir}/checkpoints > {tmp_path}/left; '
    f'cp {workdir}/run.log {tmp_path}/run.log 2> /dev/null; '
    f'mount -o remount,size=20m {disk}; '
    f'{run} > {out["out2"]} 2> {out["err2"]}; echo $? > {tmp_path}/rc2; '
    f'ls {workdir}/checkpoints > {tmp_path}/after; umount {disk}'
  )
  done = subprocess.run(in_a_small_filesystem(script), cwd=ROOT, env=cpu_env(), timeout=600)
  assert done.returncode != 90, 'could not mount the small filesystem'
  text = {name: path.read_text() for name, path in out.items()}

  assert (tmp_path / 'rc1').read_text().strip() == '2', text['err1']  # a fault the user can fix
  lines = messages(text['err1'])
  assert len(lines) == 1 and 'Traceback' not in text['err1'], text['err1']
  found = re.fullmatch(
    r'error: checkpoint step (\d+) could not be written in (\S+) \(No space left on device\); '
    r'its partial folder was removed; the last good checkpoint is step (\d+); free space there '
    r'or fix its permissions, then run again to resume',
    lines[0],
  )
  assert found, lines[0]
  failed, last_good = int(found[1]), int(found[3])
  assert found[2] == os.path.join(workdir, 'checkpoints')
  assert last_good == failed - EVERY
  left = (tmp_path / 'left').read_text().split()
  assert str(last_good) in left and not [n for n in left if 'tmp' in n], left  # nothing partial

  assert (tmp_path / 'rc2').read_text().strip() == '0', text['err2']
  assert f'resuming from step {last_good} in {workdir}' in text['out2']
  assert f'done at step {STEPS}' in text['out2']
  assert 'Traceback' not in text['err2']


def test_an_unreadable_newest_checkpoint_is_set_aside_in_one_line(corpus, tmp_path):
  workdir, cache = str(tmp_path / 'run'), str(tmp_path / 'cache')
  # Forked from a warm process (tests/launch_server.py): what `python launch.py` gives, less its
  # imports; the full-disk test above runs fresh processes.
  server = launch_server.shared()
  first = server.run(launch_args(corpus, cache, workdir, 60))
  assert first.returncode == 0, first.stderr
  assert committed_steps(workdir)[-1] == 60
  arrays = glob.glob(
    os.path.join(workdir, 'checkpoints', '60', 'state', 'ocdbt.process_0', 'd', '*')
  )
  assert arrays
  for path in arrays:  # overwritten in place: same names and sizes, other bytes
    size = os.path.getsize(path)
    with open(path, 'wb') as f:
      f.write(os.urandom(size))

  again = server.run(launch_args(corpus, cache, workdir, STEPS))
  assert again.returncode == 0, again.stderr
  assert 'Traceback' not in again.stderr and not messages(again.stderr), again.stderr
  warnings = [line for line in again.stdout.splitlines() if line.startswith('warning:')]
  assert len(warnings) == 1, again.stdout
  assert re.fullmatch(
    r'warning: checkpoint step 60 could not be read \(reading [\w.]+/[\d.]+: [^<>]+\); used step '
    r'40 instead; moved it to 60\.unreadable-\d+',
    warnings[0],
  ), warnings[0]
  assert f'resuming from step 40 in {workdir}' in again.stdout
  assert f'done at step {STEPS}' in again.stdout
  assert glob.glob(os.path.join(workdir, 'checkpoints', '60.unreadable-*'))


def test_an_exception_python_can_only_ignore_goes_to_the_run_log_even_after_the_run(tmp_path):
  """Orbax leaves coroutines behind a failed read, and Python finalizes them when their last
  reference goes, often after train() returned: their tracebacks go to the run log, not stderr
  (a resumed run printed one at exit; CI once saw asyncio's 'Task exception was never retrieved'
  for an Orbax read task on stderr after a run). Other asyncio reports still reach stderr."""
  code = f"""
import asyncio, gc, os, sys
import orbax.checkpoint
from mllm.train.logs import route_library_output
undo = route_library_output({str(tmp_path)!r})
# An Orbax read task that failed, its exception never retrieved (a sibling of a failed read):
# a coroutine function whose code lives in Orbax's package, as Orbax's own do.
orbax_file = os.path.join(os.path.dirname(orbax.checkpoint.__file__), 'reads.py')
space = {{}}
exec(compile('async def read():\\n  raise ValueError("a chunk failed")', orbax_file, 'exec'), space)
async def mine():
  raise ValueError('not orbax')
loop = asyncio.new_event_loop()
tasks = [loop.create_task(space['read']()), loop.create_task(mine())]
loop.run_until_complete(asyncio.wait(tasks))
loop.close()
undo()  # the run is over
class Leftover:
  def __del__(self):
    raise RuntimeError('finalized after the run')
leftover = Leftover()
del leftover
del tasks
gc.collect()
print('done', file=sys.stderr)
"""
  proc = subprocess.run(
    [sys.executable, '-c', code], capture_output=True, text=True, cwd=ROOT, env=cpu_env()
  )
  assert proc.returncode == 0 and proc.stderr.endswith('done\n'), proc.stderr
  assert 'a chunk failed' not in proc.stderr and 'finalized after the run' not in proc.stderr
  assert proc.stderr.count('Task exception was never retrieved') == 1  # the one of mine()
  assert "ValueError: not orbax" in proc.stderr
  log = (tmp_path / 'run.log').read_text()
  assert 'RuntimeError: finalized after the run' in log
  assert 'Task exception was never retrieved' in log and 'ValueError: a chunk failed' in log
  assert 'not orbax' not in log
