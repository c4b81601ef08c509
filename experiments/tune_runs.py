"""A suite's learning-rate tuning runs: each tuned variant on its grid around a centre, on the
tuning seeds (not the table's), widened past an edge where the best sits, then refined on a
half-step grid where a suite asks (experiments/tuning.py holds the grid and the choice)."""

from __future__ import annotations

import os

from experiments.run import Job, config_hash, older_hashes, resolve, run_folder
from experiments.scheduler import run_plan
from experiments.suite import Suite, Variant
from experiments.tuning import LrGrid, choose, refine, tuning_seeds


def tuning_jobs(
  suite: Suite, v: Variant, lr: float, seeds: list[int], key, *, preset: str, extra: dict, out: str
) -> list[Job]:
  """The runs of `v` at rate `lr` on `seeds`, keyed (variant, seed, key)."""
  jobs = []
  for seed in seeds:
    config = resolve(suite, v, preset, seed, {**extra, 'train.learning_rate': lr})
    digest, older = config_hash(config), older_hashes(config)
    runs = os.path.join(out, suite.name, 'runs')
    workdir = run_folder(runs, f'{v.name}-lr{lr:.3g}-s{seed}', digest, older)
    jobs.append(Job((v.name, seed, key), v, seed, config, workdir, digest, older=older))
  return jobs


def tune(
  suite: Suite,
  *,
  preset: str,
  extra: dict,
  tune_seeds: int,
  out: str,
  refine_lr: tuple[str, ...] = (),
  refine_seeds: int = 2,
  centers: dict | None = None,
  grid: LrGrid | None = None,
  table=None,
  table_size: int = 0,
  **execute,
) -> tuple[dict, dict]:
  """Tune each tuned variant's learning rate on the tuning seeds, widening the grid past an edge
  where the best rate sits, then refine the `refine_lr` variants' best (experiments/tuning.py):
  ({variant: {'center', 'points', 'best_lr', 'edge', 'complete'[, 'refined']}}, {key: record}
  of the table runs queued here that failed, each after its retry). `centers`
  {variant: rate}: tune only these variants, each around its given rate (default: every tuned
  variant around its configured rate); `grid`: instead of the suite's. table(rates, waiting):
  the table's runs that can start once the variants of `rates` {variant: lr} have settled and
  while those `waiting` still tune; queued as each settles (training), so the slots that one
  variant's last tuning runs leave free train another's table; `table_size`: how many runs the
  table has in all (the progress bar counts them from the start)."""
  grid = grid or suite.lr_grid
  tuned = [v for v in suite.variants if v.tune and not v.starts_from]
  if centers is None:
    centers = {v.name: resolve(suite, v, preset, 0, extra).train.learning_rate for v in tuned}
  tuned = [v for v in tuned if v.name in centers]
  steps = {v.name: grid.steps() for v in tuned}
  seeds = tuning_seeds(tune_seeds)
  training = execute['run'] is not None

  def point(v: Variant, k: int) -> list[Job]:
    lr = grid.lr(centers[v.name], k)
    return tuning_jobs(suite, v, lr, seeds, k, preset=preset, extra=extra, out=out)

  def widens(v: Variant, k: int) -> bool:
    """Training: always; a report of what finished (run=None): where that point finished."""
    return training or not run_plan(point(v, k), out=out, desc='', **execute)[2]

  def measured(v: Variant, finished: dict, failed: dict):
    """(v's choice, None until each of its points has ended; its points as results.json has
    them; whether each has ended)."""
    losses, points, complete = {}, [], True
    for k in sorted(steps[v.name]):
      done = [finished[v.name, s, k] for s in seeds if (v.name, s, k) in finished]
      complete &= all((v.name, s, k) in finished or (v.name, s, k) in failed for s in seeds)
      if done:
        losses[k] = [r['eval_loss'] for r in done]
      failures = sum((v.name, s, k) in failed for s in seeds)
      points.append(grid_point(grid.lr(centers[v.name], k), done, failures))
    return (choose(losses, grid) if complete else None), points, complete

  queued, asked = set(), None  # the table's jobs queued; the rates it was last asked with
  table_failed = {}

  def more(finished: dict, failed: dict) -> tuple[list[Job], list[Job]]:
    """run_plan's `more`: a variant's next point once its points have ended (first), the table
    runs of each variant whose rate has settled (last; a refined rate settles later)."""
    nonlocal asked
    first, rates = [], {}
    for v in tuned:
      choice, _, _ = measured(v, finished, failed)
      if choice is None:
        continue
      if choice.widen is not None and choice.widen not in steps[v.name]:
        steps[v.name] = steps[v.name] + [choice.widen]
        first += point(v, choice.widen)
      elif choice.widen is None and choice.best is not None and v.name not in refine_lr:
        rates[v.name] = grid.lr(centers[v.name], choice.best)
    last = []
    if table is not None and rates != asked:  # a variant settles once: its points stop there
      asked = rates
      jobs = table(rates, {v.name for v in tuned} - set(rates))
      last = [job for job in jobs if job.key not in queued]
      queued.update(job.key for job in last)
    return first, last

  while True:
    plan = [job for v in tuned for k in steps[v.name] for job in point(v, k)]
    finished, failed, _ = run_plan(
      plan,
      out=out,
      desc=f'suite {suite.name}: lr tuning' + (', then the table' if table and training else ''),
      **execute,
      more=more if training else None,
      expected_more=max(0, table_size - len(queued)),
    )
    table_failed.update({key: record for key, record in failed.items() if key in queued})
    summary, grew = {}, False
    for v in tuned:
      choice, points, complete = measured(v, finished, failed)
      if (
        choice is not None
        and choice.widen is not None
        and choice.widen not in steps[v.name]
        and widens(v, choice.widen)
      ):
        steps[v.name] = steps[v.name] + [choice.widen]
        grew = True
      summary[v.name] = {
        'center': centers[v.name],
        'points': points,
        'complete': complete,
        'best_lr': None
        if choice is None or choice.best is None
        else grid.lr(centers[v.name], choice.best),
        'edge': None if choice is None else choice.edge,
      }
    if not grew:
      break
  for v in tuned:
    if v.name in refine_lr and summary[v.name]['best_lr'] is not None:
      summary[v.name]['refined'] = refine_rate(
        suite,
        v,
        summary[v.name]['best_lr'],
        tuning_seeds(refine_seeds),
        preset,
        extra,
        out,
        execute,
      )
      if summary[v.name]['refined']['best_lr'] is not None:
        summary[v.name]['best_lr'] = summary[v.name]['refined']['best_lr']
  return summary, table_failed


def grid_point(lr: float, done: list[dict], failures: int) -> dict:
  """One tried rate as results.json records it, from the results of its finished runs."""
  return {
    'lr': lr,
    'seeds': [r['seed'] for r in done],
    'eval_loss': [r['eval_loss'] for r in done],
    'diverged_at_step': [r.get('diverged_at_step') for r in done],
    # Wortsman et al. 2023's instability measures (experiments/stability.py); None where a run
    # diverged or predates them.
    'max_attention_logit': [r.get('max_attention_logit') for r in done],
    'eval_log_z': [r.get('eval_log_z') for r in done],
    'wall_s': [r.get('wall_s') for r in done if not r.get('copied_from')],
    'failed': failures,
    'provenance': [r.get('provenance') for r in done],
  }


def refine_rate(
  suite: Suite, v: Variant, best: float, seeds: list[int], preset, extra, out, execute
) -> dict:
  """Rates best / √ratio, best, best · √ratio on `seeds`: {'coarse_best_lr', 'points',
  'best_lr' (None until every run finished), 'seeds'}."""
  grid = suite.lr_grid
  rates = [grid.lr(best, k) for k in (-0.5, 0, 0.5)]
  plan = [
    job
    for lr in rates
    for job in tuning_jobs(suite, v, lr, seeds, ('refine', lr), preset=preset, extra=extra, out=out)
  ]
  finished, failed, pending = run_plan(
    plan, out=out, desc=f'suite {suite.name}: refining {v.name}\'s rate', **execute
  )
  points, losses = [], {}
  for lr in rates:
    keys = [job.key for job in plan if job.key[2] == ('refine', lr)]
    done = [finished[k] for k in keys if k in finished]
    points.append(grid_point(lr, done, sum(k in failed for k in keys)))
    if len(done) == len(seeds):
      losses[lr] = [r['eval_loss'] for r in done]
  complete = len(losses) == len(rates)
  return {
    'coarse_best_lr': best,
    'seeds': seeds,
    'points': points,
    'best_lr': refine(losses) if complete else None,
    'pending': len(pending),
  }
