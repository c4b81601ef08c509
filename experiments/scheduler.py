"""Run a plan of jobs: finished runs read back, identical ones copied, the rest run here or on an
engine (experiments/engines.py) as their parents allow, a failed run retried once; each finished
run recorded in its suite's ledger (experiments/ledger.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import traceback

from tqdm import tqdm

from experiments import ledger, provenance
from experiments.measures import MEASURES
from experiments.run import (
  Job,
  adopt,
  as_json,
  read_result,
  run_one,
  same_run_elsewhere,
  same_run_in_progress,
  write_result,
)
from experiments.run_files import ERRORS_LOG, RESULT, WORKER_LOG
from mllm.config import load_config
from mllm.config_versions import VERSION, VERSION_KEY
from mllm.paths import RunDir
from mllm.train.population import AUTO, device_budget, fit_population
from mllm.train.sharding import make_mesh

# An unfinished run whose folder changed within FRESH_S seconds is being trained by another
# process; a process waiting only for such runs looks again every POLL_S seconds.
FRESH_S = 300.0
POLL_S = 10.0


@contextlib.contextmanager
def _sigterm_as_interrupt():
  """SIGTERM (a scheduler's preemption, `kill`) stops the suite as Ctrl-C does: the workers get
  SIGTERM in turn and save a checkpoint, and none is left running unsupervised (where a relaunch
  would start a second process on the same workdir)."""
  if threading.current_thread() is not threading.main_thread():  # only it may set handlers
    yield
    return

  def interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)

  previous = signal.signal(signal.SIGTERM, interrupt)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, previous)


def _last_error(workdir: str) -> str:
  try:
    with open(os.path.join(workdir, WORKER_LOG)) as f:
      lines = [line.strip() for line in f if line.strip()]
  except OSError:
    return 'the worker left no log'
  errors = [
    line
    for line in lines
    if 'Error' in line.split(':')[0] or line.split(':')[0].endswith('Exception')
  ]
  return (errors or lines or ['the worker exited without output'])[-1]


def run_plan(
  plan: list[Job],
  *,
  out: str,
  run,
  engine,
  progress: bool,
  remeasure: bool,
  desc: str,
  finished: dict | None = None,
  reuse_other_code: bool = False,
  more=None,
  failed: dict | None = None,
  population: int | str = 1,
  expected_more: int = 0,
) -> tuple[dict, dict, list]:
  """Run what has not finished of `plan`: (finished {key: record + result}, failed {key: record +
  errors}, pending [records] (run=None)). Finished runs are read back (remeasured if asked); an
  identical finished run elsewhere under `out` is copied; a failed run is retried once; a
  starts_from run waits for its parent, whose record `finished` may already hold. engine: where
  the runs execute (experiments/engines.py); None: one at a time in this process.
  reuse_other_code: keep this plan's own finished runs whose provenance differs from this
  process's (without it they raise ValueError); another suite's such run is never copied.
  more(finished, failed) -> (first, last): jobs the plan needs given what has ended, to run
  before and after the rest (a variant's next tuning point, the table runs of a settled rate);
  asked at the start and whenever a job ends, until it has none. Each job it names is new.
  failed: {key: record + errors} of jobs of `plan` that failed (twice) earlier in this process,
  e.g. table runs queued by an earlier call's `more`: reported failed, not tried again.
  population: up to this many startable runs that differ only in seed and learning rate train as
  one population (mllm/train/population_loop.py), in this process (no engine), each recorded
  as an ordinary run; 'auto': as many as fit in the device's memory, per shape (one on a CPU:
  mllm/train/population.py's fit_population and device_budget).
  expected_more: how many jobs `more` will add last (a table's runs, queued as rates settle):
  the progress bar counts them from the start, so its total and time left cover them."""
  finished = dict(finished or {})
  expected_more = expected_more if more else 0
  accept = _acceptable(run, engine, reuse_other_code)
  # Another suite's run stands in only where it is this code's, --reuse_other_code or not.
  elsewhere = _acceptable(run, engine, reuse_other_code=False)
  pending = []

  def admit(jobs: list[Job]) -> list[Job]:
    """Read back the finished jobs of `jobs` (restored from a ledger, if one has them); the
    others: those to run (none where nothing runs: pending)."""
    ledger.restore(jobs, out, elsewhere)
    todo, waiting = _read_back(jobs, finished, run, remeasure)
    _refuse_other_code(jobs, finished, accept)
    pending.extend(waiting)
    return todo

  failed_before = {job.key: failed[job.key] for job in plan if job.key in (failed or {})}
  todo = [job for job in admit(plan) if job.key not in failed_before]
  bar = tqdm(
    total=len(plan) + expected_more,
    initial=len(plan) - len(todo),
    desc=desc,
    unit='run',
    disable=not progress or not (todo or more),
    position=0,
  )
  runs = _Runs(
    out=out, run=run, engine=engine, progress=progress, finished=finished, bar=bar, accept=elsewhere
  )
  runs.more, runs.admit = more, admit
  runs.expected_more = expected_more
  runs.population = population if engine is None and run is not None else 1
  if runs.population == AUTO:  # sized per shape from the device's budget; one without a budget
    # (a CPU) and for a stand-in `run` (tests), which is called run by run
    runs.budget = device_budget() if run is run_one else None
    runs.population = 1 if runs.budget is None else AUTO
  runs.failed.update(failed_before)
  try:
    with _sigterm_as_interrupt():
      runs.work_through(todo)
  except BaseException:  # Ctrl-C, SIGTERM, or a refused run among `more`'s
    if runs.running:  # the runs save a checkpoint: the next call resumes them
      engine.stop()
    raise
  finally:
    bar.close()
  return finished, runs.failed, pending


def _acceptable(run, engine, reuse_other_code: bool):
  """result -> whether it may stand for a run of this process's code. Reports (run=None) read
  every run; an engine on other machines (Ray) may run on another device kind than this one."""
  if run is None or reuse_other_code:
    return lambda result: True
  here = provenance.current()
  keys = provenance.COMPARED
  if engine is not None and getattr(engine, 'remote', False):
    keys = tuple(k for k in keys if k != 'device')
  return lambda result: provenance.same_computation(result.get('provenance'), here, keys)


def _refuse_other_code(plan: list[Job], finished: dict, accept) -> None:
  """ValueError when a finished run of `plan` came from other code, packages or device."""
  other = [job for job in plan if job.key in finished and not accept(finished[job.key])]
  if not other:
    return
  job = other[0]
  raise ValueError(
    f'{len(other)} finished runs here came from other code, packages or device than this '
    f'checkout (e.g. {job.variant.name} seed {job.seed}: '
    f"{provenance.label(finished[job.key].get('provenance'))}; here: "
    f'{provenance.label(provenance.current())}); allowed: --reuse_other_code to keep them '
    '(results.md lists the runs of each code), or --out=DIR to run them afresh'
  )


def _read_back(plan: list[Job], finished: dict, run, remeasure: bool) -> tuple[list, list]:
  """Add each finished job of `plan` to `finished` (measured again if asked); (the jobs to run,
  the records of those pending where nothing runs)."""
  todo, pending = [], []
  for job in plan:
    measure = MEASURES[job.measure] if job.measure else None
    if os.path.exists(os.path.join(job.workdir, RESULT)):
      result = read_result(job.workdir)
      if (
        remeasure
        and measure is not None
        and 'diverged_at_step' not in result
        and (os.path.isdir(RunDir(job.workdir).checkpoints) or not job.variant.trains)
      ):
        source = (
          finished[job.parent]['workdir']
          if (job.parent and not job.variant.trains)
          else job.workdir
        )
        result.update(measure(job.config, source))
        write_result(job.workdir, result)
      finished[job.key] = {**job.record(), **result}
    elif run is None:
      pending.append(job.record())
    else:
      todo.append(job)
  return todo, pending


class _Runs:
  """The runs of one `run_plan` call: those finished, failed and running, and the steps that
  start and end them."""

  def __init__(self, *, out: str, run, engine, progress: bool, finished: dict, bar, accept):
    self.out, self.run, self.engine, self.progress = out, run, engine, progress
    self.accept = accept
    self.finished, self.failed, self.bar = finished, {}, bar
    self.running = {}  # the engine's handle -> (job, payload, attempt)
    self.waiting = set()  # keys of jobs found training in another process
    self.planned = set()  # this plan's run folders: never "another process"
    self.more, self.admit = None, None  # run_plan's `more`, and its reading back of new jobs
    self.expected_more = 0  # `more`'s last jobs still to come that the bar's total counts already
    self.population = 1  # the most runs of one shape trained together, or 'auto'
    self.budget = None  # with 'auto': the device's bytes for a population's step
    self.fitted = {}  # with 'auto': each shape's size, found once

  def work_through(self, todo: list[Job]) -> None:
    """Start each job of `todo` once its parent has finished, as slots allow, until all ended; a
    job another process is training now waits for it (and is then copied), others go first."""
    self.planned = {os.path.abspath(job.workdir) for job in todo}
    while True:
      self.take_more(todo)
      if not todo and not self.running:
        break
      for job in [job for job in todo if self.ready(job) is None]:
        todo.remove(job)
        self.done(
          job,
          errors=[f'its starts_from run {job.variant.starts_from} seed {job.seed} did not finish'],
        )
      startable = [job for job in todo if self.ready(job)]
      slot = self.engine is None or len(self.running) < self.engine.slots
      # Looked for only when a run could start: each look lists the other suites' folders.
      job = next((j for j in startable if not self.training_elsewhere(j)), None) if slot else None
      if job is not None:
        todo.remove(job)
        members = self.members_with(job, startable, todo)
        if members:
          self.launch_population([job, *members])
        else:
          self.launch(job)
        continue
      if self.running:
        self.collect()
      elif startable:  # each one is training in another process: wait for the first to end
        time.sleep(POLL_S)
      else:
        break

  def members_with(self, job: Job, startable: list[Job], todo: list[Job]) -> list[Job]:
    """Up to population − 1 more fresh runs of `job`'s shape (taken out of `todo`) to train
    with it; none for a run that resumes, has a parent, or is alone of its shape. A run that is
    another's twin (its seed and rate too) waits, to be copied from it once it has finished."""
    if self.population == 1 or not _fresh(job):
      return []
    shape, members = _shape(job), []
    size = self.population_of(job, shape)
    taken = {_seed_and_rate(job)}
    for other in startable:
      if len(members) >= size - 1:
        break
      if other is job or other not in todo or not _fresh(other) or _shape(other) != shape:
        continue
      if _seed_and_rate(other) not in taken:
        taken.add(_seed_and_rate(other))
        members.append(other)
    for other in members:
      todo.remove(other)
    return members

  def population_of(self, job: Job, shape: str) -> int:
    """The most runs of `job`'s shape to train together: `population`, or with 'auto' as many as
    fit in the device's budget (found once per shape)."""
    if self.population != AUTO:
      return self.population
    if shape not in self.fitted:
      try:
        size, used = fit_population(job.config, make_mesh(job.config.mesh), self.budget)
        self.bar.write(
          f'populations of up to {size} runs of {job.variant.name}\'s shape '
          f'({used / 2**30:.1f} of {self.budget / 2**30:.1f} GiB a step)'
        )
      except ValueError as err:  # not even one fits: the run goes alone (and says why it fails)
        self.bar.write(f'no population for {job.variant.name}: {err}')
        size = 1
      self.fitted[shape] = size
    return self.fitted[shape]

  def launch_population(self, jobs: list[Job]) -> None:
    """Train `jobs` as one population (those not copied from an identical finished run); each
    is recorded as a run; a population that fails is run again run by run."""
    from experiments.run import run_population

    for job in jobs:
      self.prepare(job)
    jobs = [job for job in jobs if not self.adopted(job)]
    if len(jobs) < 2:
      for job in jobs:
        _run_here(job, self.run, {}, self.progress, self.done)
      return
    measure = MEASURES[jobs[0].measure] if jobs[0].measure else None
    try:
      results = run_population(
        [job.config for job in jobs],
        [job.workdir for job in jobs],
        progress=self.progress,
        measure=measure,
      )
    except KeyboardInterrupt:
      raise
    except Exception as err:  # reported; its runs go on one by one
      self.bar.write(f'a population of {len(jobs)} runs failed ({type(err).__name__}: {err})')
      for job in jobs:
        _run_here(job, self.run, {}, self.progress, self.done)
      return
    for job, result in zip(jobs, results):
      self.done(job, result)

  def take_more(self, todo: list[Job]) -> None:
    """Add what `more` needs now to `todo` (its first jobs at the front), until it needs none."""
    while self.more is not None:
      first, last = self.more(self.finished, self.failed)
      if not first and not last:
        return
      asked = len(first) + len(last)
      counted = min(len(last), self.expected_more)  # in the bar's total from the start
      self.expected_more -= counted
      first, last = self.admit(first), self.admit(last)  # those still to run
      self.planned |= {os.path.abspath(job.workdir) for job in first + last}
      self.bar.total += asked - counted
      self.bar.update(asked - len(first) - len(last))  # those read back: finished already
      todo[:0] = first
      todo.extend(last)

  def training_elsewhere(self, job: Job) -> bool:
    """Another process trains this exact run now (said once per job)."""
    if job.parent is not None or os.path.isdir(RunDir(job.workdir).checkpoints):
      return False  # as in adopted(): such a run is never copied
    other = same_run_in_progress(
      self.out, job.seed, job.identities().values(), self.planned, FRESH_S
    )
    if other is not None and job.key not in self.waiting:
      self.waiting.add(job.key)
      self.bar.write(
        f'run {job.variant.name} seed {job.seed}: the same config and seed is training in '
        f'{other}; the other runs go first, then it is copied from there when it finishes'
      )
    return other is not None

  def ready(self, job: Job) -> bool | None:
    """True: it can start; None: it never can (its parent failed); False: not yet."""
    if job.parent is None:
      return True
    if job.parent in self.failed or 'diverged_at_step' in self.finished.get(job.parent, {}):
      return None
    return job.parent in self.finished

  def launch(self, job: Job) -> None:
    """Copy `job` from an identical finished run, or run it here, or submit it to the engine."""
    kwargs = self.prepare(job)
    if self.adopted(job):
      return
    if self.engine is None:
      _run_here(job, self.run, kwargs, self.progress, self.done)
    else:
      self.start(job, {'config': job.config, 'measure': job.measure, **kwargs}, 1)

  def prepare(self, job: Job) -> dict:
    """Write the job's run_config.json; the parent's record for a starts_from run."""
    kwargs = {}
    if job.parent is not None:
      kwargs['parent'] = self.finished[job.parent]
      if job.variant.trains:
        # After the hash: where the parent lies is this machine's, not the run's identity.
        parent = f"workdir:{kwargs['parent']['workdir']}"
        job.config = load_config(job.config, {'train.init_from': parent})
    os.makedirs(job.workdir, exist_ok=True)
    with open(os.path.join(job.workdir, 'run_config.json'), 'w') as f:
      json.dump({VERSION_KEY: VERSION, **as_json(job.config)}, f, sort_keys=True, indent=1)
    return kwargs

  def adopted(self, job: Job) -> bool:
    """An identical finished run elsewhere under `out` is copied, not trained again."""
    if job.parent is not None or os.path.isdir(RunDir(job.workdir).checkpoints):
      return False  # a child depends on its parent's path; a started run resumes instead
    source = same_run_elsewhere(self.out, job.seed, job.identities().values(), job.workdir)
    if source is None or not self.accept(read_result(source)):
      return False
    self.bar.write(
      f'run {job.variant.name} seed {job.seed}: the same config and seed finished in '
      f'{source}; copied, not trained again'
    )
    self.done(
      job, adopt(source, job.config, job.workdir, MEASURES[job.measure] if job.measure else None)
    )
    return True

  def start(self, job: Job, payload: dict, attempt: int) -> None:
    """Submit `job` to the engine (attempt 2: the retry, which resumes it)."""
    self.running[self.engine.submit(payload, job.workdir)] = (job, payload, attempt)

  def collect(self) -> None:
    """Record the engine's runs that ended in the next second; retry a failed one once."""
    for handle, ok in self.engine.wait(1.0):
      job, payload, attempt = self.running.pop(handle)
      if ok and os.path.exists(os.path.join(job.workdir, RESULT)):
        self.done(job, read_result(job.workdir))
      elif attempt == 1:  # a failed (or killed) run is retried once: it resumes
        self.start(job, payload, 2)
      else:
        self.done(job, errors=[_last_error(job.workdir)])

  def done(self, job: Job, result=None, errors=None) -> None:
    """Record `job` as finished (in its suite's ledger too) or as failed with its errors."""
    if result is not None:
      self.finished[job.key] = {**job.record(), **result}
      ledger.append(job, result)
    else:
      self.failed[job.key] = {**job.record(), 'errors': errors}
      self.bar.write(f'run {job.variant.name} seed {job.seed} failed: {errors[-1]}')
    self.bar.update(1)


def _fresh(job: Job) -> bool:
  """A run that starts from nothing: no parent, no checkpoint of an earlier attempt."""
  return job.parent is None and not os.path.isdir(RunDir(job.workdir).checkpoints)


def _shape(job: Job) -> str:
  """What a population's runs share: the config without its seed and learning rate, and the
  measure."""
  config = as_json(job.config)
  config.pop('seed', None)
  config.get('train', {}).pop('learning_rate', None)
  return json.dumps([config, job.measure], sort_keys=True)


def _seed_and_rate(job: Job) -> tuple:
  return job.config.seed, job.config.train.learning_rate


def _run_here(job: Job, run, kwargs, progress, done) -> None:
  """One run in this process, retried once on an exception (e.g. a transient I/O error)."""
  measure = MEASURES[job.measure] if job.measure else None
  errors = []
  for _ in range(2):
    try:
      result = run(job.config, job.workdir, progress=progress, measure=measure, **kwargs)
      done(job, result)
      return
    except KeyboardInterrupt:
      raise
    except Exception as err:  # reported, the suite goes on
      errors.append(f'{type(err).__name__}: {err}')
      with open(os.path.join(job.workdir, ERRORS_LOG), 'a') as f:
        f.write(traceback.format_exc() + '\n')
  done(job, errors=errors)
