"""Each suite's ledger, finished.jsonl: one line per finished run (its config hash, seed, folder
and result), committed with the suite's results, so a clone without the run folders restores
their results (and a changed folder or ledger is noticed) instead of training them again."""

from __future__ import annotations

import glob
import json
import os
import time

from experiments import provenance
from experiments.run import Job, read_result, write_result
from experiments.run_files import RESULT
from mllm.config_versions import VERSION, VERSION_KEY

LEDGER = 'finished.jsonl'


def append(job: Job, result: dict) -> None:
  suite_folder = os.path.dirname(os.path.dirname(job.workdir))
  with open(os.path.join(suite_folder, LEDGER), 'a') as f:
    f.write(
      json.dumps(
        {
          'hash': job.hash,
          VERSION_KEY: VERSION,
          'seed': job.seed,
          'run': os.path.basename(job.workdir),
          'result': result,
        }
      )
      + '\n'
    )


def read_all(out: str) -> dict:
  """{hash: [entry, ...]} of every suite's ledger under `out`, each with its suite folder."""
  entries = {}
  for path in sorted(glob.glob(os.path.join(out, '*', LEDGER))):
    with open(path) as f:
      for line in f:
        if line.strip():
          entry = json.loads(line)
          entries.setdefault(entry['hash'], []).append(
            {**entry, 'suite_folder': os.path.dirname(path)}
          )
  return entries


def entries_of(job: Job, ledger: dict) -> list[dict]:
  """The ledger's lines that record `job`: by its hash under the config version each line was
  written in (a line without one: version 1, mllm/config_versions.py)."""
  out = []
  for version, digest in job.identities().items():
    out += [e for e in ledger.get(digest, []) if e.get(VERSION_KEY, 1) == version]
  return out


def _copied_before(suite_folder: str) -> dict:
  """{run hash (any version's): the folder it was copied from} of the suite's results.json."""
  path = os.path.join(suite_folder, 'results.json')
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    runs = json.load(f).get('runs', [])
  out = {}
  for run in runs:
    if run.get('copied_from'):
      for digest in (run['hash'], *run.get('older', {}).values()):
        out[digest] = run['copied_from']
  return out


def _stale(job: Job, entries: list[dict]) -> bool:
  """Whether `job`'s folder holds a result its own suite's ledger does not record: it matches none
  of the ledger's entries for that run (loss and provenance) and is older than the ledger, which
  changed since (another checkout's runs merged in after this folder's run was dropped from it).
  A result newer than the ledger is a run that finished and is about to be recorded."""
  mine = [
    e['result'] for e in entries if os.path.abspath(_folder(e)) == os.path.abspath(job.workdir)
  ]
  path = os.path.join(job.workdir, RESULT)
  if not mine or not os.path.exists(path):
    return False
  ledger = os.path.join(os.path.dirname(os.path.dirname(job.workdir)), LEDGER)
  if os.path.getmtime(path) >= os.path.getmtime(ledger):
    return False
  local = read_result(job.workdir)
  return not any(_same_record(local, r) for r in mine)


def _same_record(a: dict, b: dict) -> bool:
  """The same eval loss (NaN equals NaN) and, where both recorded one, the same computation (a
  ledger line may carry only the commit that added it where the folder's result has nothing)."""
  ours, theirs = a.get('provenance') or {}, b.get('provenance') or {}
  return json.dumps(a.get('eval_loss')) == json.dumps(b.get('eval_loss')) and (
    not ours.get('code') or not theirs.get('code') or provenance.key(ours) == provenance.key(theirs)
  )


def _folder(entry: dict) -> str:
  return os.path.join(entry['suite_folder'], 'runs', entry['run'])


def restore(plan: list[Job], out: str, accept) -> None:
  """Give every unfinished job of `plan` that a ledger records its result.json back (without
  checkpoints), unless a child of it still has to run and needs its parameters. Its own suite's
  record wins (its latest); another suite's stands in only for a job without a measure, since
  that suite did not measure it (such a run is copied with its checkpoint and measured, or
  trained again), and only where `accept` takes its result (the same code)."""
  ledger = read_all(out)
  copied = {}  # {suite folder: {run hash: the folder its results.json says the run was copied from}}

  def record(job) -> dict | None:
    entries = entries_of(job, ledger)
    own = os.path.abspath(os.path.dirname(os.path.dirname(job.workdir)))
    mine = [e for e in entries if os.path.abspath(e['suite_folder']) == own]
    if mine:
      return mine[-1]
    others = [e for e in entries if accept(e['result'])]
    if not others or job.measure is not None:
      return None
    # The run the table copied before (a clone has no folders to copy): the same record again.
    if own not in copied:  # read each suite's results.json once
      copied[own] = _copied_before(own)
    before_by_hash = copied[own]
    before = next((before_by_hash[h] for h in job.identities().values() if h in before_by_hash), '')
    same = [e for e in others if before and os.path.abspath(_folder(e)) == os.path.abspath(before)]
    return (same or others)[-1]

  for job in plan:  # a stale folder is set aside; its ledger record stands in, as in a clone
    if _stale(job, entries_of(job, ledger)):
      os.rename(job.workdir, f'{job.workdir}.stale-{int(time.time())}')
  found = {
    job.key: record(job) for job in plan if not os.path.exists(os.path.join(job.workdir, RESULT))
  }
  restorable = {key for key, entry in found.items() if entry is not None}
  for job in plan:
    if job.parent in restorable and job.key not in restorable and job.key in found:
      restorable.discard(job.parent)
  for job in plan:
    if job.key not in restorable:
      continue
    entry = found[job.key]
    result = dict(entry['result'])
    if os.path.abspath(entry['suite_folder']) != os.path.abspath(
      os.path.dirname(os.path.dirname(job.workdir))
    ):
      result['copied_from'] = _folder(entry)
    os.makedirs(job.workdir, exist_ok=True)
    write_result(job.workdir, result)
