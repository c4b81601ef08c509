"""The config's schema versions (mllm/config_versions.py): a saved config of version 1 reads as the
same config in version 2, and every run a committed suite table lists is still found under the
identity the runner computes now (its version 1 hash, by which the committed ledgers name it)."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest

import mllm
from experiments.run import config_hash, older_hashes, resolve, v1_hash
from experiments.suite import available, load_suite
from mllm.config import read_config
from mllm.config_versions import VERSION, VERSION_KEY, as_v1, upgrade, v1_to_v2, written_in
from mllm.train.resume import as_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, 'experiments', 'results')
BASE = os.path.join(ROOT, 'configs', 'base.py')


def _suite_configs():
  """One config of every variant of every suite, under its cpu preset (seed 0)."""
  for name in available():
    suite = load_suite(name)
    for variant in getattr(suite, 'variants', ()):
      if 'cpu' in suite.presets:
        yield f'{name}/{variant.name}', resolve(suite, variant, 'cpu', 0)


def _keys(tree: dict, prefix: str = '') -> set[str]:
  return {
    path
    for key, value in tree.items()
    for path in (_keys(value, f'{prefix}{key}.') if isinstance(value, dict) else {prefix + key})
  }


def test_version_1_written_back_and_upgraded_is_the_same_config():
  """as_v1 then v1_to_v2 (what reading an old config.json does) gives back every suite config
  that version 1 could say (the rest keep a later version's key when written back: Muon, µP, a
  soft cap), key for key; and the version 1 rendering has the old flat keys and none of the new
  sections."""
  base = read_config(BASE)
  v1_keys = _keys(as_v1(mllm.load_config(BASE + ':lr_base_d_model=none').to_dict()))
  seen, later, rows = set(), 0, 0
  for name, config in _suite_configs():
    rows += 1
    old = as_v1(config.to_dict())
    if _keys(old) != v1_keys:  # a choice of a later version: its keys on top of version 1's
      assert _keys(old) > v1_keys, name
      later += 1
      continue
    position = old['model']['position']
    assert 'rope' not in position and 't5' not in position, name
    assert position['rope_scaling'] == config.model.position.rope.scaling.kind, name
    again = as_config(upgrade(old), base)
    assert again.to_dict() == config.to_dict(), name
    seen.add((config.model.position.kind, config.model.position.rope.scaling.kind))
  # The 2024-26 suites' rows only (optimizers, mup_transfer, unseen_width, stability,
  # attention_2024, positions_2024 and their diagnosis suites): 42 of 234 today.
  assert later < rows / 4
  # The suites cover the schemes and scalings whose keys moved.
  assert {('t5', 'none'), ('shaw', 'none'), ('rope', 'yarn'), ('rope', 'linear')} <= seen


def test_an_old_saved_config_upgrades_key_by_key():
  """A version 1 config.json (no config_version) as mllm wrote it before version 2."""
  old = {
    'model': {
      'position': {
        'kind': 'rope',
        'rope_theta': 5e5,
        'rope_layout': 'interleaved',
        'rope_scaling': 'yarn',
        'rope_scaling_factor': 4.0,
        'rope_original_max_len': 128,
        'yarn_beta_fast': 16.0,
        'yarn_beta_slow': 2.0,
        'llama3_low_freq_factor': 1.0,
        'llama3_high_freq_factor': 4.0,
        't5_num_buckets': 32,
        't5_max_distance': 128,
        'shaw_max_distance': 16,
      },
      'norm': {'kind': 'rmsnorm', 'partial_p': 0.0625},
    }
  }
  config = mllm.load_config(as_config(upgrade(old), read_config(BASE)))
  rope = config.model.position.rope
  assert (rope.theta, rope.layout, rope.original_max_len) == (5e5, 'interleaved', 128)
  assert rope.scaling.kind == 'yarn'
  assert (rope.scaling.yarn.factor, rope.scaling.yarn.beta_fast, rope.scaling.yarn.beta_slow) == (
    4.0,
    16.0,
    2.0,
  )
  assert rope.scaling.linear.factor == 1.0  # the factor went to the chosen scaling only
  # Written back, version 2 says it is version 2, and reads unchanged.
  saved = {VERSION_KEY: VERSION, **config.to_dict()}
  assert upgrade(saved) == config.to_dict()
  assert v1_to_v2(as_v1(config.to_dict()))['model']['position']['rope'] == {
    'theta': 5e5,
    'layout': 'interleaved',
    'original_max_len': 128,
    'scaling': {
      'kind': 'yarn',
      'yarn': {'factor': 4.0, 'beta_fast': 16.0, 'beta_slow': 2.0},
      'llama3': {'low_freq_factor': 1.0, 'high_freq_factor': 4.0},  # version 1 had its keys
    },
  }


def test_a_config_of_a_version_this_code_does_not_know_is_refused():
  newer = VERSION + 1
  with pytest.raises(ValueError, match=f'config_version={newer}; allowed: 1 to {VERSION}'):
    upgrade({VERSION_KEY: newer, 'model': {}})


@pytest.mark.parametrize('version', [1, 2])
def test_an_old_moe_config_upgrades_into_the_ffns_section(version):
  """Versions 1 and 2 kept MoE's keys in `model.moe` with `expert_kind`; version 3 in the FFN's
  section, the experts' FFN a choice of its own."""
  old = {
    'model': {
      'ffn': {'kind': 'moe', 'd_ff': None},
      'moe': {'num_experts': 4, 'top_k': 1, 'expert_kind': 'geglu', 'every': 2},
    },
    **({VERSION_KEY: version} if version > 1 else {}),
  }
  config = mllm.load_config(as_config(upgrade(old), read_config(BASE)))
  moe = config.model.ffn.moe
  assert (moe.num_experts, moe.top_k, moe.expert.kind, moe.every) == (4, 1, 'geglu', 2)
  assert 'moe' not in config.model
  back = written_in(config.to_dict(), version)['model']
  assert back['moe']['expert_kind'] == 'geglu' and 'moe' not in back['ffn']


def test_the_identity_is_the_whole_config_with_its_version(monkeypatch):
  """Version 2 hashes every key with the schema's version: another version, or any key changed,
  is another run; version 1's hash of the same config differs (the runner keeps both)."""
  import experiments.run

  suite = load_suite('ffn')
  config = resolve(suite, suite.variants[0], 'tiny', 0)
  digest = config_hash(config)
  assert digest != v1_hash(config)
  assert digest != config_hash(
    resolve(suite, suite.variants[0], 'tiny', 0, {'model.init': 'fixed'})
  )
  monkeypatch.setattr(experiments.run, 'VERSION', VERSION + 1)
  assert config_hash(config) != digest


def _table_runs():
  for path in sorted(glob.glob(os.path.join(RESULTS, '*', 'results.json'))):
    name = os.path.basename(os.path.dirname(path))
    if name not in available():
      continue
    with open(path) as f:
      results = json.load(f)
    suite = load_suite(name)
    if not hasattr(suite, 'variants') or not results.get('runs'):
      continue
    yield name, suite, results


@pytest.mark.parametrize('name', [name for name, _, _ in _table_runs()])
def test_every_committed_table_run_is_found_under_the_identity_computed_now(name):
  """Each run a committed results.json lists resolves, under this code, to the hash it was
  recorded with, under the config version it was recorded in (its parent's hash of that version in
  a starts_from run's). So the committed ledgers still pair with the suites."""
  suite, results = next((s, r) for n, s, r in _table_runs() if n == name)
  variants = {v.name: v for v in suite.variants}
  recorded = {(r['variant'], r['seed']): r for r in results['runs']}
  for run in results['runs']:
    variant = root = variants[run['variant']]
    while root.starts_from:  # a child trains at its root's tuned rate (its own derives from it)
      root = variants[root.starts_from]
    rate = recorded[root.name, run['seed']]['learning_rate']
    extra = {'train.learning_rate': rate} if root.tune else {}
    config = resolve(suite, variant, results['preset'], run['seed'], extra)
    parent = recorded[variant.starts_from, run['seed']]['hash'] if variant.starts_from else ''
    # The run and its parent were recorded in one version: the parent's hash is of that version.
    older = older_hashes(config, dict.fromkeys(range(1, VERSION), parent)).values()
    found = {config_hash(config, parent), *older}
    assert run['hash'] in found, (name, run['variant'], run['seed'])


def test_a_workdirs_old_config_json_is_read_in_this_version(tmp_path):
  """launch.py --workdir without --config, generation and resuming read config.json through
  run_config (read_config_json): a version 1 file reads in this version; a newer one is one
  line."""
  from mllm.checks import InputError
  from mllm.train.resume import read_config_json, run_config

  config = mllm.load_config(BASE + ':lr_base_d_model=none,pos=t5,t5.num_buckets=16')
  (tmp_path / 'config.json').write_text(json.dumps(as_v1(config.to_dict())))
  saved = read_config_json(str(tmp_path))
  assert saved['model']['position']['t5'] == {'num_buckets': 16, 'max_distance': 128}
  assert (
    mllm.load_config(run_config(str(tmp_path), read_config(BASE))).to_dict() == config.to_dict()
  )
  (tmp_path / 'config.json').write_text(json.dumps({VERSION_KEY: VERSION + 1, 'model': {}}))
  with pytest.raises(InputError, match=f'config_version={VERSION + 1}; allowed: 1 to {VERSION}'):
    read_config_json(str(tmp_path))


def _ledger_lines_since_version_2():
  """(suite, line) for each committed ledger line written in config version 2 or later, and every
  line of a suite whose table is not committed yet (a results.json's runs are checked above)."""
  for path in sorted(glob.glob(os.path.join(RESULTS, '*', 'finished.jsonl'))):
    folder = os.path.dirname(path)
    name = os.path.basename(folder)
    if name not in available():
      continue
    tabled = os.path.exists(os.path.join(folder, 'results.json'))
    with open(path) as f:
      for line in f:
        entry = json.loads(line)
        if entry.get(VERSION_KEY, 1) >= 2 or not tabled:
          yield name, entry


def _variant_of_run(suite, run: str):
  """The variant whose run folder `run` is: '{variant}-s{seed}-{hash}', or with '-lr{rate}'
  before the seed for a tuning run. The whole rest must match, so 'pre-4x-s0-...' is pre-4x's,
  not pre's."""
  return next(
    v
    for v in sorted(suite.variants, key=lambda v: -len(v.name))
    if run.startswith(f'{v.name}-')
    and re.fullmatch(r'(lr.+-)?s\d+-[0-9a-f]+', run[len(v.name) + 1 :])
  )


def test_every_ledger_line_of_a_later_version_is_found_under_the_identities_computed_now():
  """A line names its run by the hash of the config version it was written in: the config
  rebuilt from the line's variant, seed and rate has that hash among its identities now."""
  lines = list(_ledger_lines_since_version_2())
  assert len(lines) >= 25  # ffn_4m's tuning runs (versions 1 and 3) at least
  for name, entry in lines:
    suite = load_suite(name)
    variant = _variant_of_run(suite, entry['run'])
    identities = _identities(suite, variant, entry['seed'], entry['result']['learning_rate'])
    assert identities[entry.get(VERSION_KEY, 1)] == entry['hash'], (name, entry['run'])


def _identities(suite, variant, seed: int, rate: float) -> dict:
  """{version: hash} of the variant's run at `seed`: a starts_from run runs at its parent
  chain's first variant's tuned rate and its hash folds in its parent's, version by version."""
  by_name = {v.name: v for v in suite.variants}
  root = variant
  while root.starts_from:
    root = by_name[root.starts_from]
  config = resolve(suite, variant, 'cpu', seed, {'train.learning_rate': rate} if root.tune else {})
  if not variant.starts_from:
    return {VERSION: config_hash(config), **older_hashes(config)}
  parent = _identities(suite, by_name[variant.starts_from], seed, rate)
  return {VERSION: config_hash(config, parent[VERSION]), **older_hashes(config, parent)}


def test_version_4_reads_an_older_config_as_adamw_and_writes_adamw_back_without_the_section():
  """Version 4 made the optimizer a choice: a version 3 config trained AdamW, even laid over a
  config that chooses Muon; written back in version 3, an AdamW config has no optimizer section
  (its identity then is the one version 3 gave it) and a Muon config keeps it (no version 3 run
  is it)."""
  muon = mllm.load_config(BASE + ':opt=muon,muon.ns_steps=3')
  old = {VERSION_KEY: 3, 'train': {'learning_rate': 0.01}}
  read = mllm.load_config(as_config(upgrade(old), muon))
  assert read.train.optimizer.kind == 'adamw' and read.train.learning_rate == 0.01
  assert read.train.optimizer.muon.ns_steps == 5  # its default, not the Muon config's 3
  adamw = mllm.load_config(BASE + ':lr_base_d_model=none')  # the rate as version 3 gave it
  assert 'optimizer' not in written_in(adamw.to_dict(), 3)['train']
  assert written_in(muon.to_dict(), 3)['train']['optimizer']['kind'] == 'muon'
  assert older_hashes(muon)[3] != older_hashes(adamw)[3]
  assert 'parametrization' not in written_in(adamw.to_dict(), 3)['model']
  mup = mllm.load_config(BASE + ':param=mup')
  assert written_in(mup.to_dict(), 3)['model']['parametrization']['kind'] == 'mup'
  assert older_hashes(mup)[3] != older_hashes(adamw)[3]


def test_version_5_reads_a_version_4_config_without_an_attention_soft_cap():
  """Version 5 added model.attention.logit_softcap: a version 4 config trained without it, and a
  config without it writes back to version 4 without the key (its version 4 identity); one with a
  cap keeps it (no version 4 run is it)."""
  capped = mllm.load_config(BASE, {'model.attention.logit_softcap': 50.0})
  old = {VERSION_KEY: 4, 'model': {'attention': {'qk_norm': True}}}
  read = mllm.load_config(as_config(upgrade(old), capped))
  assert read.model.attention.logit_softcap is None and read.model.attention.qk_norm
  plain = mllm.load_config(BASE)
  assert 'logit_softcap' not in written_in(plain.to_dict(), 4)['model']['attention']
  assert written_in(capped.to_dict(), 4)['model']['attention']['logit_softcap'] == 50.0
  assert older_hashes(capped)[4] != older_hashes(plain)[4]


def test_version_6_reads_an_older_config_at_the_rate_it_gave():
  """Version 6 scales the standard parametrization's rate by lr_base_d_model / d_model (256 by
  default): a version 5 config trained at its rate as given, so it reads with None; written back,
  None drops the section (its version 5 identity) and 256 keeps it (no version 5 run is it); under
  µP the section is not read and is dropped either way."""
  scaled = mllm.load_config(BASE, {'model.d_model': 128})
  old = {VERSION_KEY: 5, 'model': {'d_model': 128}}
  read = mllm.load_config(as_config(upgrade(old), scaled))
  assert read.model.parametrization.standard.lr_base_d_model is None
  as_given = mllm.load_config(BASE + ':lr_base_d_model=none', {'model.d_model': 128})
  assert 'standard' not in written_in(as_given.to_dict(), 5)['model']['parametrization']
  assert written_in(scaled.to_dict(), 5)['model']['parametrization']['standard'] == {
    'lr_base_d_model': 256
  }
  assert older_hashes(scaled)[5] != older_hashes(as_given)[5]
  mup = mllm.load_config(BASE + ':param=mup')
  assert 'standard' not in written_in(mup.to_dict(), 5)['model']['parametrization']
  mup_v5 = {VERSION_KEY: 5, 'model': {'parametrization': {'kind': 'mup'}}}
  assert (
    mllm.load_config(as_config(upgrade(mup_v5), read_config(BASE))).model.parametrization.kind
    == 'mup'
  )


def test_a_run_folder_names_its_variant_whole_where_one_name_begins_another():
  norms, attention = load_suite('norms_2024'), load_suite('attention_2024')
  assert _variant_of_run(norms, 'pre-4x-s0-97808bc9a41b').name == 'pre-4x'
  assert _variant_of_run(norms, 'pre-s0-a46a6bb3536b').name == 'pre'
  assert _variant_of_run(attention, 'mla-lr0.00075-s1000-96ccca57bc67').name == 'mla'
