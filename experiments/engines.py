"""Where a suite's runs execute: `LocalPool` (`--jobs=N` processes on this machine, no
dependency) or `RayEngine` (`--engine=ray`: every run a Ray task, on a local Ray or a cluster).

Both run the same `experiments.worker` code on a run directory that holds the job (job.pkl) and
receives the result (result.json) and the run's output (worker.log), so the runner's behaviour is
the engine's business nowhere else: run directories by config hash, finished runs skipped, a
failed or killed run retried once, resuming from its checkpoint.

An engine has `slots` (how many runs it takes at once; the runner submits no more), `submit(job,
workdir) -> handle`, `wait(timeout_s) -> [(handle, ok)]` (the runs that ended) and `stop()`
(interrupt every run, which saves a checkpoint, and wait for them); the runner calls the last two
only while runs are in flight.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
import traceback
import warnings

from experiments.run_files import JOB, WORKER_LOG

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pythonpath(first: str = ROOT) -> str:
  """PYTHONPATH with a checkout (this one by default) first, so a child process imports it; the
  rest kept (packages installed with --target reach the child too)."""
  return os.pathsep.join(
    [first] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]
  )


def write_job(job: dict, workdir: str) -> None:
  with open(os.path.join(workdir, JOB), 'wb') as f:
    pickle.dump(job, f)


def _cores() -> list[int]:
  return (
    sorted(os.sched_getaffinity(0))
    if hasattr(os, 'sched_getaffinity')
    else list(range(os.cpu_count() or 1))
  )


def cpu_slots(jobs: int) -> list[frozenset | None]:
  """The CPUs each of `jobs` concurrent workers is pinned to: the machine's cores split evenly,
  or no pinning where there are fewer cores than jobs (or no affinity API). On 2 cores, two
  unpinned runs each sized XLA's thread pool to both cores and ran slower together (6,500
  tokens/s) than one alone (6,850); pinned to a core each: 8,700 (2-core EPYC, 2026-11-25)."""
  if not hasattr(os, 'sched_getaffinity'):
    return [None] * jobs
  cpus = _cores()
  if jobs < 2 or len(cpus) < jobs:
    return [None] * jobs
  share = len(cpus) // jobs
  return [frozenset(cpus[i * share : (i + 1) * share]) for i in range(jobs)]


class LocalPool:
  """`jobs` worker processes at once (`python -m experiments.worker WORKDIR`), each pinned to its
  share of this machine's cores with XLA's thread pool sized to them."""

  def __init__(self, jobs: int):
    self.slots = jobs
    self._cpus = cpu_slots(jobs)
    self._running = {}  # Popen -> slot index

  def submit(self, job: dict, workdir: str) -> subprocess.Popen:
    write_job(job, workdir)
    slot = min(set(range(self.slots)) - set(self._running.values()))
    log = open(os.path.join(workdir, WORKER_LOG), 'a')  # noqa: SIM115 (the worker's, closed on exit)
    env = {**os.environ, 'PYTHONPATH': pythonpath()}
    cpus = self._cpus[slot]
    if cpus:  # the worker pins itself before JAX starts (a preexec_fn is unsafe in threaded code)
      env['MLLM_WORKER_CPUS'] = ','.join(map(str, sorted(cpus)))
      env['NPROC'] = str(len(cpus))  # XLA sizes its CPU thread pool by $NPROC
    proc = subprocess.Popen(
      [sys.executable, '-m', 'experiments.worker', workdir],
      stdout=log,
      stderr=subprocess.STDOUT,
      env=env,
      cwd=os.getcwd(),
    )
    self._running[proc] = slot
    return proc

  def wait(self, timeout_s: float) -> list[tuple[subprocess.Popen, bool]]:
    time.sleep(timeout_s)
    ended = [proc for proc in self._running if proc.poll() is not None]
    for proc in ended:
      del self._running[proc]
    return [(proc, proc.returncode == 0) for proc in ended]

  def stop(self) -> None:
    """SIGTERM to every worker: train() saves a checkpoint, and the next call resumes it."""
    for proc in self._running:
      proc.terminate()
    for proc in self._running:
      proc.wait()
    self._running.clear()


# --- Ray -------------------------------------------------------------------------------------


def parse_resources(text: str | None, jobs: int) -> dict:
  """A Ray task's resources from `--resources` (JSON, e.g. '{"GPU": 1}'); by default this
  machine's cores over --jobs, so --jobs=N runs N at once on a local Ray as the pool does."""
  if not text:
    return {'CPU': max(1, len(_cores()) // jobs)}
  try:
    resources = json.loads(text)
  except json.JSONDecodeError:
    resources = None
  if (
    not isinstance(resources, dict)
    or not resources
    or not all(
      isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
      for k, v in resources.items()
    )
  ):
    raise ValueError(
      f'--resources={text!r}; allowed: a JSON object of Ray resources per run, '
      'e.g. \'{"CPU": 4}\' or \'{"GPU": 1}\''
    )
  return resources


def check_out_for_ray(out: str) -> None:
  """Ray workers read job.pkl from and write results to `out` themselves: a path every node
  mounts (NFS, Lustre, a FUSE-mounted bucket), not a bucket URL."""
  if '://' in out:
    raise ValueError(
      f'--out={out!r}; allowed with --engine=ray: a directory every Ray node '
      'mounts at the same path (a shared filesystem, or a bucket mounted with '
      'gcsfuse / s3fs / blobfuse); URLs are not supported'
    )


def run_task(workdir: str) -> None:
  """One run inside a Ray worker process (a fresh process per task: JAX starts once per run):
  the worker's output goes to workdir/worker.log, as in the local pool."""
  if not os.path.exists(os.path.join(workdir, JOB)):
    import socket

    raise FileNotFoundError(
      f'{workdir}/job.pkl is not visible on Ray node {socket.gethostname()}: --out must be '
      'a filesystem every node mounts at the same path'
    )
  import ray

  cpus = ray.get_runtime_context().get_assigned_resources().get('CPU')
  if cpus:  # XLA sizes its CPU thread pool by $NPROC when JAX starts: the task's share
    os.environ['NPROC'] = str(max(1, int(cpus)))
  log = os.open(os.path.join(workdir, WORKER_LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
  sys.stdout.flush()
  sys.stderr.flush()
  os.dup2(log, 1)
  os.dup2(log, 2)
  from experiments import worker

  try:
    worker.main(workdir)
  except BaseException:  # into worker.log, where the runner reads a failed run's last error
    traceback.print_exc()
    raise
  finally:
    sys.stdout.flush()
    sys.stderr.flush()


def init_ray(address: str | None = None) -> None:
  """Connect to the Ray cluster at `address`, or start a local one with this machine's cores.
  Workers find the project through PYTHONPATH (on a cluster: `pip install -e .` on every node,
  or this checkout on a shared filesystem)."""
  import ray

  # Tasks pass a path and return None: a local object store of 128 MiB (Ray's default takes 30%
  # of memory in /dev/shm) is plenty.
  kwargs = (
    dict(address=address)
    if address
    else dict(num_cpus=len(_cores()), include_dashboard=False, object_store_memory=128 * 2**20)
  )
  if not address:  # Ray starts its workers at nice 15: beside any other load (a second suite,
    # a test run) they starved, and 2 tiny runs took 105 s instead of 7 s (2-core CPU)
    os.environ.setdefault('RAY_worker_niceness', '0')
  with warnings.catch_warnings():  # JAX warns of any fork; Ray's is a fork-exec
    warnings.filterwarnings('ignore', message='os.fork', category=RuntimeWarning)
    ray.init(**kwargs, log_to_driver=False, runtime_env={'env_vars': {'PYTHONPATH': pythonpath()}})


class RayEngine:
  """Every run a Ray task with `resources`, on the cluster at `address` ('auto', 'HOST:PORT',
  'ray://HOST:10001') or, without one, on a local Ray this process starts (and stops) with this
  machine's cores. The runner retries a failed task once, as it does a local worker: Ray's own
  retries stay off, so a run is never tried three times."""

  STOP_GRACE_S = 120  # how long a cancelled run may take to save its checkpoint
  remote = True  # runs may land on other machines (another device kind than the driver's)

  def __init__(self, resources: dict, address: str | None = None):
    try:
      import ray
    except ImportError:
      raise ValueError("--engine=ray needs Ray: pip install -e '.[cluster]'") from None
    self._ray = ray
    self._started = not ray.is_initialized()
    if self._started:
      init_ray(address)
    resources = dict(resources)
    self._task = ray.remote(max_calls=1, max_retries=0, retry_exceptions=False)(run_task).options(
      num_cpus=resources.pop('CPU', 0), num_gpus=resources.pop('GPU', 0), resources=resources
    )
    self.slots = 1_000_000  # Ray queues what the cluster cannot start yet
    self._running = set()

  def submit(self, job: dict, workdir: str):
    write_job(job, workdir)
    ref = self._task.remote(os.path.abspath(workdir))
    self._running.add(ref)
    return ref

  def wait(self, timeout_s: float) -> list[tuple[object, bool]]:
    ready, _ = self._ray.wait(
      list(self._running), num_returns=len(self._running), timeout=timeout_s
    )
    ended = []
    for ref in ready:
      self._running.discard(ref)
      try:
        self._ray.get(ref)
        ended.append((ref, True))
      except Exception:  # a failed or killed run: retried once
        ended.append((ref, False))
    return ended

  def stop(self) -> None:
    """Cancel every task: a running one gets KeyboardInterrupt (train() saves a checkpoint), a
    queued one never starts; those still running after STOP_GRACE_S are killed."""
    refs = list(self._running)
    for ref in refs:
      self._ray.cancel(ref)
    _, left = self._ray.wait(refs, num_returns=len(refs), timeout=self.STOP_GRACE_S)
    for ref in left:
      self._ray.cancel(ref, force=True)
    self._running.clear()

  def close(self) -> None:
    if self._started:
      self._ray.shutdown()
