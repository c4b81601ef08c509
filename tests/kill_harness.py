"""Run launch.py, dying by SIGKILL half-way through the first deletion of a dropped checkpoint.

    python tests/kill_harness.py [launch.py flags]

Fault injection for tests/test_kill_loop.py: `shutil.rmtree` of anything under
`checkpoints/.deleting/` removes one file of it and then kills the process, which is what a kill
that lands during a deletion leaves behind. Not part of mllm.
"""

import os
import runpy
import shutil
import signal
import sys

_rmtree = shutil.rmtree


def rmtree_then_die(path, *args, **kwargs):
  if f'{os.sep}.deleting{os.sep}' in str(path):
    for root, _, files in os.walk(path):
      if files:
        os.remove(os.path.join(root, files[0]))
        break
    os.kill(os.getpid(), signal.SIGKILL)
  return _rmtree(path, *args, **kwargs)


if __name__ == '__main__':
  shutil.rmtree = rmtree_then_die
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  sys.path.insert(0, root)
  sys.argv = [os.path.join(root, 'launch.py')] + sys.argv[1:]
  runpy.run_path(sys.argv[0], run_name='__main__')
