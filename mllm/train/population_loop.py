"""A population's training loop: K members (mllm/train/population.py) stepped as one program,
each an ordinary run in its own workdir.

    from mllm.train.population_loop import train_population
    summaries = train_population(config, [Member(0, 3e-3), Member(1, 6e-3)], ['runs/a', 'runs/b'])

Each member's workdir holds what a solo run's holds: its config (its seed and rate), its data
position and train state in checkpoints (`launch.py --workdir` resumes or evaluates it alone),
metrics.jsonl with its train and eval records, its loss plot. The population resumes at the latest
step every living member has saved. A member whose loss or parameters stop being finite is frozen
(its state no longer changes, nothing of it is saved again) and recorded as diverged (diverged.json
in its workdir, read again on resume) while the others go on.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time

import jax
import numpy as np

from mllm.paths import RunDir
from mllm.train.cluster import StopRequest
from mllm.train.evaluation import run_eval
from mllm.train.loop import metrics_writer
from mllm.train.metrics import Progress, plot_losses
from mllm.train.opening import open_run
from mllm.train.population import Member, Population, stack, unstack
from mllm.train.step import make_eval_step

DIVERGED = 'diverged.json'  # in a member's workdir: the step and what diverged


def train_population(
  config,
  members: list[Member],
  workdirs: list[str],
  *,
  stop_after: int | None = None,
  progress: bool = True,
) -> list[dict]:
  """Train `members` of `config` in `workdirs` (one each), resuming where they were saved;
  returns each member's summary ({step, train_loss, eval, diverged, interrupted, median_step_s,
  tokens_per_s, workdir}: `train`'s keys; tokens/s a member's share, its tokens over the
  population's step time)."""
  if len(members) != len(workdirs):
    raise ValueError(f'{len(members)} members need as many workdirs, got {len(workdirs)}')
  t = config.train
  with contextlib.ExitStack() as closing:
    runs = [closing.enter_context(open_run(m.config(config), w)) for m, w in zip(members, workdirs)]
    # The first member's run opened the shape's setup already.
    population = Population(config, members, runs[0].mesh, (runs[0].setup, runs[0].init))
    diverged = [_read_diverged(w) for w in workdirs]
    start, states = _starting_states(runs, population, [d is None for d in diverged])
    end = t.steps if stop_after is None else min(t.steps, stop_after)
    writers = [metrics_writer(w, t, start) for w in workdirs]
    for writer in writers:
      closing.callback(writer.close)
    eval_step = make_eval_step(runs[0].setup, runs[0].data.tokenizer.token_bytes)
    bar = Progress(end, start, log_every=t.log_every, enabled=progress)
    tokens = config.data.batch_size * config.data.seq_len
    losses = [float('nan')] * len(runs)
    step, interrupted, times = start, None, []
    with StopRequest() as stop:
      try:
        while step < end:
          alive = np.array([d is None for d in diverged])
          t0 = time.perf_counter()
          batches = stack([next(run.iterator) for run in runs])
          states, metrics = population.step(states, batches, alive)
          step += 1
          metrics = jax.device_get(metrics)
          seconds = time.perf_counter() - t0
          if step > start + 1:  # the first call compiles
            times.append(seconds)
          for k, run in enumerate(runs):
            if not alive[k]:
              continue
            losses[k] = float(metrics['loss'][k])
            if not math.isfinite(losses[k]) or not bool(metrics['params_finite'][k]):
              diverged[k] = _record_diverged(run.workdir, step, losses[k])
              bar.print(f'member {k} ({run.workdir}) diverged at step {step}; frozen')
              continue
            if step % t.log_every == 0 or step == end:
              writers[k].write(step, 'train', _train_record(metrics, k, step, tokens, seconds))
          if t.eval_every and step % t.eval_every == 0 and step < t.steps:
            _evaluate(runs, states, diverged, writers, eval_step, step)
          if step % t.checkpoint_every == 0 or step == end:
            _save(runs, states, diverged, step)
          living = sum(d is None for d in diverged)
          bar.update(step, f'{living}/{len(runs)} alive, {living * tokens / seconds:,.0f} tok/s')
          interrupted = stop.agreed()
          if interrupted:
            if step % t.checkpoint_every and step != end:
              _save(runs, states, diverged, step)
            bar.print(f'{interrupted}: saved step {step}; run again to resume')
            break
      finally:
        bar.close()
    for run in runs:
      run.ckpt.wait()
    evals = [None] * len(runs)
    if step == t.steps and not interrupted:
      evals = _evaluate(runs, states, diverged, writers, eval_step, step)
    median = float(np.median(times)) if times else float('nan')
    summaries = []
    for k, run in enumerate(runs):
      writers[k].close()
      if jax.process_index() == 0 and os.path.exists(writers[k].path):
        plot_losses(writers[k].path, RunDir(run.workdir).loss_plot)
      summaries.append(
        {
          'step': step,
          'train_loss': losses[k],
          'eval': evals[k],
          'diverged': diverged[k],
          'interrupted': interrupted,
          'median_step_s': median,
          'tokens_per_s': tokens / median if times else None,
          'workdir': run.workdir,
        }
      )
    return summaries


def _starting_states(runs, population: Population, alive: list[bool]):
  """(the step to start at, the stacked states): the latest step every living member saved,
  each member restored there (its data position too); a fresh population where there is none.
  A frozen member starts from its initial state (it is never stepped or saved again)."""
  saved = [set(run.ckpt.all_steps()) for run, a in zip(runs, alive) if a]
  common = set.intersection(*saved) if saved else set()
  fresh = population.init()
  if not common:
    return 0, fresh
  step = max(common)
  states = []
  for k, run in enumerate(runs):
    if alive[k]:
      states.append(run.ckpt.restore(step, run.setup.abstract_state, run.iterator))
    else:
      states.append(unstack(fresh, k))
  return step, population.stacked(states)


def _train_record(metrics, k: int, step: int, tokens: int, seconds: float) -> dict:
  record = {
    'loss': float(metrics['loss'][k]),
    'grad_norm': float(metrics['grad_norm'][k]),
    'learning_rate': float(metrics['learning_rate'][k]),
    'log_z': float(metrics['log_z'][k]),
    'tokens_per_s': tokens / seconds,  # each member's share is the population's step
    'step_time_s': seconds,
    'mfu': None,
    'tokens_seen': step * tokens,
  }
  if 'mtp_loss' in metrics:
    record['mtp_loss'] = float(metrics['mtp_loss'][k])
  return record


def _evaluate(runs, states, diverged, writers, eval_step, step: int) -> list:
  """Each living member's evaluation (its eval record written), None for a frozen one."""
  out = []
  for k, run in enumerate(runs):
    result = None
    if diverged[k] is None:
      params = unstack(states['params'], k)
      result = run_eval(eval_step, params, run.data, run.mesh, run.config.train.eval_batches)
      if result:
        writers[k].write(step, 'eval', result)
    out.append(result)
  return out


def _save(runs, states, diverged, step: int) -> None:
  for k, run in enumerate(runs):
    if diverged[k] is None:
      run.ckpt.save(step, unstack(states, k), run.iterator, run.saved_config)


def _record_diverged(workdir: str, step: int, loss: float) -> dict:
  record = {
    'step': step,
    'what': f'loss is {loss}' if not math.isfinite(loss) else 'the update overflowed',
  }
  with open(os.path.join(workdir, DIVERGED), 'w', encoding='utf-8') as f:
    json.dump(record, f)
  return record


def _read_diverged(workdir: str) -> dict | None:
  path = os.path.join(workdir, DIVERGED)
  if not os.path.isfile(path):
    return None
  with open(path, encoding='utf-8') as f:
    return json.load(f)
