"""One run of a suite in a process of its own: `python -m experiments.worker WORKDIR`.

`run_suite(suite, SuiteRun(..., jobs=N))` writes WORKDIR/job.pkl (the resolved config, the measure's name, the
parent run of a starts_from variant) and starts this; it writes WORKDIR/result.json as run_one does.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys


def main(workdir: str) -> int:
  cpus = os.environ.get('MLLM_WORKER_CPUS')
  if cpus:  # the runner's share of the cores for this worker, set before JAX sizes its pool
    os.sched_setaffinity(0, {int(c) for c in cpus.split(',')})
  from mllm import malloc

  malloc.keep_freed_memory()  # before JAX's threads start: a step's buffers stay mapped
  from experiments.measures import MEASURES
  from mllm import compile_cache

  compile_cache.enable()  # every seed of a variant compiles the same shapes
  from experiments.run import run_one
  from experiments.run_files import JOB

  with open(os.path.join(workdir, JOB), 'rb') as f:
    job = pickle.load(f)
  measure = MEASURES[job['measure']] if job['measure'] else None
  # Which attempt this is, for whoever reads worker.log after a retry (a node lost, a kill).
  from mllm.paths import committed_steps

  saved = committed_steps(workdir)
  print(
    f'worker pid {os.getpid()} on {socket.gethostname()}: '
    + (f'resuming from step {saved[-1]}' if saved else 'starting'),
    flush=True,
  )
  run_one(job['config'], workdir, progress=False, measure=measure, parent=job.get('parent'))
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1]))
