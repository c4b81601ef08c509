"""A resume never discards a checkpoint: config mismatches are refused naming the keys, damaged
steps are passed over only once an older one restores, interrupted cleanups are finished."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import jax
import numpy as np
import pytest
from conftest import STEPS, load_state, make_config

from mllm.checks import InputError
from mllm.config import ConfigError
from mllm.paths import DELETING
from mllm.train import evaluate, train
from mllm.train.checkpoint import Checkpointer
from mllm.train.init_from import adopt_tokenizer, init_params
from mllm.train.metrics import read_metrics, truncate_metrics
from mllm.train.sharding import make_mesh
from mllm.train.state import setup

pytestmark = pytest.mark.xdist_group('resume')
KEPT = (20, 30, 40)  # checkpoint_every=10, max_to_keep=3


@pytest.fixture(scope='module')
def run(corpus, tmp_path_factory):
  """A finished run whose workdir holds steps 20, 30 and 40."""
  cache = str(tmp_path_factory.mktemp('cache'))
  workdir = str(tmp_path_factory.mktemp('run') / 'w')
  config = make_config(corpus, cache, train__checkpoint_every=10, train__max_to_keep=3)
  train(config, workdir, progress=False)
  assert sorted(
    int(n) for n in os.listdir(os.path.join(workdir, 'checkpoints')) if n.isdigit()
  ) == list(KEPT)
  return config, workdir, corpus, cache


def copy_of(run, tmp_path) -> str:
  workdir = str(tmp_path / 'w')
  shutil.copytree(run[1], workdir)
  return workdir


def fingerprint(folder: str) -> dict[str, str]:
  """Every file under `folder` with a hash of its bytes: equal means nothing moved or changed."""
  out = {}
  for root, _, files in os.walk(folder):
    for name in files:
      path = os.path.join(root, name)
      with open(path, 'rb') as f:
        out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
  return out


def assert_trees_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_optimizer_change_is_refused_naming_the_key_and_nothing_moves(run, tmp_path):
  _config, _, corpus, cache = run
  workdir = copy_of(run, tmp_path)
  before = fingerprint(workdir)
  no_clip = make_config(corpus, cache, train__grad_clip=0.0, train__steps=80)
  with pytest.raises(ConfigError) as info:
    train(no_clip, workdir, progress=False)
  message = str(info.value)
  assert '\n' not in message
  assert message.startswith(
    'train.grad_clip=0.0 (saved: 1.0): changes the optimizer state of '
    f'the run in {workdir} (checkpoint step 40)'
  ), message
  assert f'train.init_from=workdir:{workdir}' in message
  assert fingerprint(workdir) == before
  # Evaluation reads only the parameters, so the optimizer change does not matter to it.
  assert evaluate(no_clip, workdir)['step'] == 40
  assert fingerprint(workdir) == before


def test_switching_the_optimizer_is_refused_naming_its_kind(run, tmp_path):
  _config, _, corpus, cache = run
  workdir = copy_of(run, tmp_path)
  before = fingerprint(workdir)
  muon = make_config(corpus, cache, train__optimizer__kind='muon', train__steps=80)
  with pytest.raises(ConfigError) as info:
    train(muon, workdir, progress=False)
  assert str(info.value).startswith(
    "train.optimizer.kind='muon' (saved: 'adamw'): changes the optimizer state of "
    f'the run in {workdir} (checkpoint step 40)'
  ), str(info.value)
  assert fingerprint(workdir) == before


def test_model_change_is_refused_naming_the_key(run, tmp_path):
  _, _, corpus, cache = run
  workdir = copy_of(run, tmp_path)
  before = fingerprint(workdir)
  wider = make_config(corpus, cache, model__d_model=48, model__dropout=0.3, train__steps=99)
  with pytest.raises(
    ConfigError,
    match=r'^model\.d_model=48 \(saved: 32\): changes the '
    r'parameters .*; allowed: the saved value to resume, or a new --workdir$',
  ):
    train(wider, workdir, progress=False)
  with pytest.raises(ConfigError, match=r'^model\.d_model=48 \(saved: 32\)'):
    evaluate(wider, workdir)
  assert fingerprint(workdir) == before


def test_changes_that_keep_the_state_resume(run, tmp_path):
  _, _, corpus, cache = run
  workdir = copy_of(run, tmp_path)
  longer = make_config(
    corpus,
    cache,
    model__dropout=0.3,
    train__steps=STEPS + 2,
    train__schedule='constant',
    train__checkpoint_every=10,
    train__max_to_keep=3,
  )
  assert train(longer, workdir, progress=False)['step'] == STEPS + 2
  with open(os.path.join(workdir, 'config.json')) as f:
    assert json.load(f)['train']['steps'] == STEPS + 2


def test_damaged_config_json_is_one_line_and_nothing_moves(run, tmp_path):
  config, *_ = run
  workdir = copy_of(run, tmp_path)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write('{"model": {"d_model": 3')  # cut short
  before = fingerprint(workdir)
  for action in (lambda: train(config, workdir, progress=False), lambda: evaluate(config, workdir)):
    with pytest.raises(
      InputError,
      match=r"^--workdir='.*': its config\.json is not valid JSON "
      r'\(.*\); allowed: .* delete it',
    ) as info:
      action()
    assert '\n' not in str(info.value)
  assert fingerprint(workdir) == before


def test_missing_config_json_is_taken_from_the_checkpoint(run, tmp_path, capsys):
  _, _, corpus, cache = run
  workdir = copy_of(run, tmp_path)
  os.remove(os.path.join(workdir, 'config.json'))
  no_clip = make_config(corpus, cache, train__grad_clip=0.0)
  with pytest.raises(ConfigError, match=r'^train\.grad_clip=0\.0 \(saved: 1\.0\)'):
    train(no_clip, workdir, progress=False)
  assert (
    'has no config.json; using the config saved in checkpoint step 40' in capsys.readouterr().out
  )
  # A compatible config resumes, and config.json is written again.
  longer = make_config(corpus, cache, train__steps=STEPS + 1)
  assert train(longer, workdir, progress=False)['step'] == STEPS + 1
  assert os.path.isfile(os.path.join(workdir, 'config.json'))


def test_without_any_saved_config_the_state_entries_are_named(run, tmp_path):
  """Checkpoints written before they carried their config, and no config.json: the structure
  from Orbax's metadata still tells a config change from damage."""
  _, _, corpus, cache = run
  workdir = copy_of(run, tmp_path)
  os.remove(os.path.join(workdir, 'config.json'))
  for step in KEPT:
    shutil.rmtree(os.path.join(workdir, 'checkpoints', str(step), 'config'))
  before = fingerprint(workdir)
  no_clip = make_config(corpus, cache, train__grad_clip=0.0)
  with pytest.raises(
    InputError,
    match=r"^--workdir='.*': the run in .* \(checkpoint step 40\) "
    r'holds optimizer state this config does not build \(.*opt_state/1.*\); '
    r'nothing was moved',
  ):
    train(no_clip, workdir, progress=False)
  assert fingerprint(workdir) == before


def test_a_stale_config_json_is_not_trusted_to_name_keys(run, tmp_path):
  """A config.json that does not describe its checkpoint (edited by hand) would blame the wrong
  key: the state entries are named instead."""
  _, _, corpus, cache = run
  workdir = copy_of(run, tmp_path)
  path = os.path.join(workdir, 'config.json')
  with open(path) as f:
    saved = json.load(f)
  saved['model']['d_model'] = 48
  with open(path, 'w') as f:
    json.dump(saved, f)
  no_clip = make_config(corpus, cache, train__grad_clip=0.0)
  with pytest.raises(
    InputError,
    match=r"^--workdir='.*': the run in .* holds optimizer state "
    r'this config does not build \(.*opt_state',
  ):
    train(no_clip, workdir, progress=False)


def test_init_from_starts_a_new_run_from_the_parameters_only(run, tmp_path, capsys):
  config, source, corpus, cache = run
  no_clip = dict(train__grad_clip=0.0, train__warmup_steps=0, train__schedule='constant')
  abstract = setup(config, make_mesh(config.mesh))[0].abstract_state['params']
  # The latest step, or a named step folder.
  for value, step in (
    (f'workdir:{source}', 40),
    (f'workdir:{os.path.join(source, "checkpoints", "30")}', 30),
  ):
    cfg = make_config(corpus, cache, train__init_from=value, **no_clip)
    assert_trees_equal(
      jax.device_get(init_params(cfg, abstract)), load_state(config, source, step)['params']
    )
  # Training from them: one step at a tiny rate stays within 1e-6 of the source parameters
  # (a fresh initialization differs by ~0.02), from step 0 with a fresh optimizer.
  workdir = str(tmp_path / 'fine-tune')
  cfg = make_config(
    corpus,
    cache,
    train__init_from=f'workdir:{source}',
    train__learning_rate=1e-9,
    train__steps=1,
    **no_clip,
  )
  assert train(cfg, workdir, progress=False)['step'] == 1
  assert 'initialized the parameters from' in capsys.readouterr().out
  for a, b in zip(
    jax.tree.leaves(load_state(cfg, workdir, 1)['params']),
    jax.tree.leaves(load_state(config, source, 40)['params']),
    strict=True,
  ):
    np.testing.assert_allclose(a, b, atol=1e-6)
  # Other shapes, or a step that does not exist: one line naming train.init_from.
  wider = make_config(corpus, cache, model__d_model=48, train__init_from=f'workdir:{source}')
  abstract_wide = setup(wider, make_mesh(wider.mesh))[0].abstract_state['params']
  with pytest.raises(
    ConfigError, match=r'^model\.d_model=48 \(saved: 32\): changes the parameters'
  ):
    init_params(wider, abstract_wide)
  missing = make_config(corpus, cache, train__init_from=f'workdir:{source}/checkpoints/7')
  with pytest.raises(
    ConfigError,
    match=r"^train\.init_from='workdir:.*/7': no such checkpoint; "
    r'allowed: a step of 20, 30, 40$',
  ):
    init_params(missing, abstract)
  nowhere = make_config(corpus, cache, train__init_from=f'workdir:{tmp_path / "nope"}')
  with pytest.raises(ConfigError, match=r'^train\.init_from=.*holds no checkpoints/ folder'):
    init_params(nowhere, abstract)


def test_init_from_adopts_the_source_runs_tokenizer(tmp_path, corpus):
  source = tmp_path / 'source'
  source.mkdir()
  (source / 'tokenizer.json').write_text('{"the": "source run\'s BPE"}')
  config = make_config(
    corpus, str(tmp_path / 'cache'), data__tokenizer='bpe', train__init_from=f'workdir:{source}'
  )
  adopt_tokenizer(config, str(tmp_path / 'new'))
  assert (tmp_path / 'new' / 'tokenizer.json').read_text() == (
    source / 'tokenizer.json'
  ).read_text()
  (tmp_path / 'own').mkdir()
  (tmp_path / 'own' / 'tokenizer.json').write_text('{}')  # a run that has its own keeps it
  adopt_tokenizer(config, str(tmp_path / 'own'))
  assert (tmp_path / 'own' / 'tokenizer.json').read_text() == '{}'


def damage(workdir: str, step: int) -> None:
  for root, _, files in os.walk(os.path.join(workdir, 'checkpoints', str(step), 'state')):
    for name in files:
      with open(os.path.join(root, name), 'wb') as f:
        f.write(b'garbage')


def test_unreadable_newest_is_moved_aside_only_after_an_older_one_restores(run, tmp_path, capsys):
  _, _, corpus, cache = run
  workdir = copy_of(run, tmp_path)
  damage(workdir, 40)
  longer = make_config(
    corpus, cache, train__steps=STEPS + 1, train__checkpoint_every=10, train__max_to_keep=3
  )
  assert train(longer, workdir, progress=False)['step'] == STEPS + 1
  out = capsys.readouterr().out
  assert 'warning: checkpoint step 40 could not be read (' in out
  assert 'used step 30 instead; moved it to 40.unreadable-' in out
  # Resumed at 30: the copied records after it were dropped and steps 31..41 logged once each.
  steps = [
    r['step'] for r in read_metrics(os.path.join(workdir, 'metrics.jsonl')) if r['split'] == 'train'
  ]
  assert steps == list(range(1, STEPS + 2))
  names = os.listdir(os.path.join(workdir, 'checkpoints'))
  assert any(n.startswith('40.unreadable-') for n in names) and '41' in names


def test_when_no_step_reads_nothing_is_moved(run, tmp_path):
  config, *_ = run
  workdir = copy_of(run, tmp_path)
  for step in KEPT:
    damage(workdir, step)
  before = fingerprint(workdir)
  with pytest.raises(
    InputError,
    match=r"^--workdir='.*': no checkpoint in it can be read "
    r'\(step 40: .*; step 30: .*; step 20: .*\); nothing was moved',
  ):
    train(config, workdir, progress=False)
  assert fingerprint(workdir) == before


def test_interrupted_cleanups_are_finished_at_start(run, tmp_path, capsys):
  _config, *_ = run
  workdir = copy_of(run, tmp_path)
  checkpoints = os.path.join(workdir, 'checkpoints')
  # 1. A deletion killed half-way by an rmtree (as earlier versions deleted): step 20 has lost
  #    its commit markers and some files.
  for name in ('_CHECKPOINT_METADATA', 'commit_success.txt'):
    os.remove(os.path.join(checkpoints, '20', name))
  shutil.rmtree(os.path.join(checkpoints, '20', 'data'))
  # 2. A step dropped into .deleting/ whose purge was killed.
  shutil.copytree(os.path.join(checkpoints, '30'), os.path.join(checkpoints, DELETING, '10'))
  # 3. A save killed before its commit rename.
  shutil.copytree(
    os.path.join(checkpoints, '30'), os.path.join(checkpoints, '50.orbax-checkpoint-tmp-1234')
  )
  # 4. A bare folder newer than every committed step: not Orbax's, so kept (moved aside).
  os.makedirs(os.path.join(checkpoints, '60', 'state'))
  ckpt = Checkpointer(workdir, max_to_keep=3)
  ckpt.close()
  out = capsys.readouterr().out
  assert 'finished deleting checkpoint step 20' in out and 'newest step is 40' in out
  assert f'finished deleting 1 old checkpoint(s) in {checkpoints}/{DELETING}' in out
  assert 'removed 50.orbax-checkpoint-tmp-1234' in out
  assert 'checkpoint step 60 in' in out and 'no commit marker' in out
  names = sorted(os.listdir(checkpoints))
  assert [n for n in names if n.isdigit()] == ['30', '40']
  assert os.listdir(os.path.join(checkpoints, DELETING)) == []
  assert [n for n in names if n.startswith('60.incomplete-')]
  assert not [n for n in names if 'tmp' in n]


def test_old_steps_go_through_the_deleting_folder(run):
  """max_to_keep drops a step by renaming it into .deleting/ (atomic), then purges it."""
  _, workdir, *_ = run
  checkpoints = os.path.join(workdir, 'checkpoints')
  assert os.path.isdir(os.path.join(checkpoints, DELETING))
  assert os.listdir(os.path.join(checkpoints, DELETING)) == []  # purged when the run closed


def test_resume_drops_metrics_after_the_resumed_step_and_cut_lines(tmp_path):
  path = str(tmp_path / 'metrics.jsonl')
  records = [{'step': s, 'split': 'train', 'loss': 1.0 / s} for s in range(1, 8)]
  with open(path, 'w') as f:
    f.write(''.join(json.dumps(r) + '\n' for r in records) + '{"step": 8, "spl')  # killed mid-line
  truncate_metrics(path, lambda r: r['step'] <= 5)
  assert read_metrics(path) == records[:5]
