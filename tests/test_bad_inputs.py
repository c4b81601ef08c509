"""Every bad input to launch.py ends in one `error:` line naming the key or path, exit 2, and no
traceback anywhere in the output.

A case is one line: an id, the arguments (leading NAME=value words set environment variables;
{placeholders} name the files the `paths` fixture makes), and the text the error line must hold.
Each runs on top of BASE_ARGS: a tiny model on a tiny local corpus, in its own workdir.
"""

from __future__ import annotations

import os
import shlex
import shutil
import string

import launch_server
import numpy as np
import pytest
from launch_server import run_fresh

TINY = (
  '--config.model.n_layers=1 --config.model.d_model=32 --config.model.n_heads=2 '
  '--config.model.n_kv_heads=1 --config.model.vocab_size=258 --config.model.max_seq_len=32 '
  '--config.data.seq_len=16 --config.data.batch_size=2'
)
BASE_ARGS = (
  TINY + ' --config.data.source=text --config.data.path={corpus} '
  '--config.data.tokenizer=byte --config.data.val_fraction=0.3 '
  '--config.data.cache_dir={cache} --config.train.steps=4 --config.train.warmup_steps=1 '
  '--config.train.eval_every=0 --config.train.tensorboard=False --workdir={workdir}'
)

CASES = [
  # --- numeric keys: NaN, ±inf (from a flag, a choice string or a file) and ranges ---
  ('init_std-nan', '--config.model.init_std=nan', 'model.init_std=nan: must be a finite'),
  ('init_std-zero', '--config.model.init_std=0.0', 'model.init_std=0.0: must be a positive'),
  (
    'embed_scale-negative',
    '--config.model.embed_scale=-1.0',
    'model.embed_scale=-1.0: must be a positive',
  ),
  ('dropout-nan', '--config.model.dropout=nan', 'model.dropout=nan'),
  ('dropout-one', '--config.model.dropout=1.0', 'model.dropout=1.0: a dropout rate'),
  ('embed_dropout-inf', '--config.model.embed_dropout=inf', 'model.embed_dropout=inf'),
  ('embed_dropout-neg', '--config.model.embed_dropout=-0.1', 'model.embed_dropout=-0.1'),
  ('softmax_scale-inf', '--config.model.attention.softmax_scale=inf', 'softmax_scale=inf'),
  ('softmax_scale-neg', '--config.model.attention.softmax_scale=-1.0', 'softmax_scale=-1.0'),
  ('attn_dropout-nan', '--config.model.attention.dropout=nan', 'model.attention.dropout=nan'),
  ('attn_dropout-big', '--config.model.attention.dropout=2.0', 'model.attention.dropout=2.0'),
  ('rope_theta-nan', '--config.model.position.rope.theta=nan', 'model.position.rope.theta=nan'),
  ('rope_theta-inf-choice', '--config=configs/base.py:theta=inf', 'model.position.rope.theta=inf'),
  (
    'rope_theta-neg',
    '--config.model.position.rope.theta=-10000.0',
    'model.position.rope.theta=-10000.0',
  ),
  (
    'scaling_factor-nan',
    '--config.model.position.rope.scaling.linear.factor=nan',
    'model.position.rope.scaling.linear.factor=nan',
  ),
  (
    'scaling_factor-small',
    '--config=configs/base.py:rope_scaling=linear,linear.factor=0.5',
    'model.position.rope.scaling.linear.factor=0.5: the context extension factor must be >= 1',
  ),
  (
    'beta_fast-inf',
    '--config.model.position.rope.scaling.yarn.beta_fast=inf',
    'model.position.rope.scaling.yarn.beta_fast=inf',
  ),
  (
    'beta_slow-nan',
    '--config.model.position.rope.scaling.yarn.beta_slow=nan',
    'model.position.rope.scaling.yarn.beta_slow=nan',
  ),
  (
    'beta_order',
    '--config=configs/base.py:rope_scaling=yarn,yarn.factor=2.0,beta_slow=64.0',
    'model.position.rope.scaling.yarn.beta_slow=64.0',
  ),
  (
    'llama3_low-nan',
    '--config.model.position.rope.scaling.llama3.low_freq_factor=nan',
    'model.position.rope.scaling.llama3.low_freq_factor=nan',
  ),
  (
    'llama3_high-inf',
    '--config.model.position.rope.scaling.llama3.high_freq_factor=-inf',
    'model.position.rope.scaling.llama3.high_freq_factor=-inf',
  ),
  (
    'llama3_order',
    '--config=configs/base.py:rope_scaling=llama3,llama3.factor=2.0,low_freq_factor=8.0',
    'model.position.rope.scaling.llama3.low_freq_factor=8.0',
  ),
  ('norm_eps-nan', '--config.model.norm.eps=nan', 'model.norm.eps=nan'),
  ('norm_eps-zero', '--config.model.norm.eps=0.0', 'model.norm.eps=0.0'),
  (
    'partial_p-inf',
    '--config.model.norm.partial_rmsnorm.p=inf',
    'model.norm.partial_rmsnorm.p=inf',
  ),
  (
    'partial_p-big',
    '--config=configs/base.py:norm=partial_rmsnorm,partial_rmsnorm.p=1.5',
    'model.norm.partial_rmsnorm.p=1.5',
  ),
  ('val_fraction-nan', '--config.data.val_fraction=nan', 'data.val_fraction=nan'),
  ('val_fraction-big', '--config.data.val_fraction=0.9', 'data.val_fraction=0.9'),
  ('lr-nan', '--config.train.learning_rate=nan', 'train.learning_rate=nan'),
  ('lr-inf', '--config.train.learning_rate=inf', 'train.learning_rate=inf'),
  ('lr-neg-choice', '--config=configs/base.py:learning_rate=-0.001', 'train.learning_rate=-0.001'),
  ('lr-zero', '--config.train.learning_rate=0.0', 'train.learning_rate=0.0'),
  ('min_lr-nan', '--config.train.min_lr_ratio=nan', 'train.min_lr_ratio=nan'),
  ('min_lr-big', '--config.train.min_lr_ratio=2.0', 'train.min_lr_ratio=2.0'),
  ('b1-nan', '--config.train.b1=nan', 'train.b1=nan'),
  ('b1-one', '--config.train.b1=1.0', 'train.b1=1.0'),
  ('b2-inf', '--config.train.b2=inf', 'train.b2=inf'),
  ('b2-neg', '--config.train.b2=-0.5', 'train.b2=-0.5'),
  ('eps-nan', '--config.train.eps=nan', 'train.eps=nan'),
  ('eps-zero', '--config.train.eps=0.0', 'train.eps=0.0'),
  ('weight_decay-inf', '--config.train.weight_decay=inf', 'train.weight_decay=inf'),
  ('weight_decay-neg', '--config.train.weight_decay=-0.1', 'train.weight_decay=-0.1'),
  ('grad_clip-inf', '--config.train.grad_clip=inf', 'train.grad_clip=inf'),
  ('grad_clip-nan', '--config.train.grad_clip=nan', 'train.grad_clip=nan'),
  ('grad_clip-neg', '--config.train.grad_clip=-1.0', 'train.grad_clip=-1.0'),
  ('peak_flops-inf', '--config.train.peak_flops=inf', 'train.peak_flops=inf'),
  ('peak_flops-neg', '--config.train.peak_flops=-1.0', 'train.peak_flops=-1.0'),
  ('float-in-file', '--config={nan_config}', 'train.learning_rate=nan'),
  # --- integer keys ---
  ('seed-neg', '--config.seed=-1', 'seed=-1'),
  ('vocab-zero', '--config.model.vocab_size=0', 'model.vocab_size=0'),
  ('d_model-neg', '--config.model.d_model=-32', 'model.d_model=-32'),
  ('n_layers-zero', '--config.model.n_layers=0', 'model.n_layers=0'),
  ('n_heads-zero', '--config.model.n_heads=0', 'model.n_heads=0'),
  ('kv_heads-3', '--config.model.n_heads=4 --config.model.n_kv_heads=3', 'model.n_kv_heads=3'),
  ('max_seq_len-zero', '--config.model.max_seq_len=0', 'model.max_seq_len=0'),
  ('head_dim-zero', '--config.model.head_dim=0', 'model.head_dim=0'),
  ('d_ff-neg', '--config.model.ffn.d_ff=-8', 'model.ffn.d_ff=-8'),
  ('multiple_of-zero', '--config.model.ffn.multiple_of=0', 'model.ffn.multiple_of=0'),
  ('window-zero', '--config=configs/base.py:window=0', 'model.attention.sliding_window=0'),
  ('block_q-zero', '--config.model.attention.block_q=0', 'model.attention.block_q=0'),
  (
    't5_buckets',
    '--config=configs/base.py:pos=t5,t5.num_buckets=1',
    'model.position.t5.num_buckets=1',
  ),
  (
    'shaw_distance',
    '--config=configs/base.py:pos=shaw,shaw.max_distance=-1',
    'model.position.shaw.max_distance=-1',
  ),
  ('seq_len-zero', '--config.data.seq_len=0', 'data.seq_len=0'),
  ('batch-zero', '--config.data.batch_size=0', 'data.batch_size=0'),
  ('tok_bytes-zero', '--config.data.tokenizer_train_bytes=0', 'data.tokenizer_train_bytes=0'),
  ('steps-zero', '--config.train.steps=0', 'train.steps=0'),
  ('warmup-neg', '--config.train.warmup_steps=-1', 'train.warmup_steps=-1'),
  ('warmup-too-long', '--config.train.warmup_steps=4', 'train.warmup_steps=4'),
  ('accum-3', '--config.train.grad_accum_steps=3', 'train.grad_accum_steps=3'),
  ('log_every-zero', '--config.train.log_every=0', 'train.log_every=0'),
  ('eval_every-neg', '--config.train.eval_every=-1', 'train.eval_every=-1'),
  ('ckpt_every-zero', '--config.train.checkpoint_every=0', 'train.checkpoint_every=0'),
  ('max_to_keep-zero', '--config.train.max_to_keep=0', 'train.max_to_keep=0'),
  ('mesh-zero', '--config.mesh.tensor=0', 'mesh.tensor=0'),
  ('mesh-devices', '--config.mesh.data=3', 'mesh'),
  ('moe-top_k', '--config=configs/base.py:ffn=moe,top_k=9', 'model.ffn.moe.top_k=9: each token'),
  (
    'moe-capacity',
    '--config=configs/base.py:ffn=moe --config.model.ffn.moe.capacity_factor=0.0',
    'model.ffn.moe.capacity_factor=0.0: must be a positive',
  ),
  ('moe-router', '--config=configs/base.py:ffn=moe,router=relu', "model.ffn.moe.router='relu'"),
  (
    'moe-expert-axis',
    '--config=configs/base.py:ffn=moe --config.mesh.expert=3',
    'mesh.expert=3: must divide model.ffn.moe.num_experts=8',
  ),
  # --- registries ---
  ('pos', '--config=configs/base.py:pos=rotary', "model.position.kind='rotary'"),
  ('ffn', '--config=configs/base.py:ffn=swiglu2', "model.ffn.kind='swiglu2'"),
  ('norm', '--config=configs/base.py:norm=batchnorm', "model.norm.kind='batchnorm'"),
  ('placement', '--config=configs/base.py:placement=middle', "model.norm.placement='middle'"),
  ('impl', '--config=configs/base.py:attn=flash', "model.attention.impl='flash'"),
  (
    'cudnn-on-cpu',
    '--config=configs/base.py:attn=cudnn --config.model.dtype=bfloat16',
    "model.attention.impl='cudnn'",
  ),
  (
    'rope_scaling',
    '--config=configs/base.py:rope_scaling=dynamic',
    "model.position.rope.scaling.kind='dynamic'",
  ),
  (
    'rope_layout',
    '--config.model.position.rope.layout=sideways',
    "model.position.rope.layout='sideways'",
  ),
  ('dtype', '--config.model.dtype=float16', "model.dtype='float16'"),
  ('param_dtype', '--config.model.param_dtype=int8', "model.param_dtype='int8'"),
  ('remat', '--config.model.remat=some', "model.remat='some'"),
  ('source', '--config.data.source=csv', "data.source='csv'"),
  ('tokenizer', '--config.data.tokenizer=wordpiece', "data.tokenizer='wordpiece'"),
  ('schedule', '--config.train.schedule=cosin', "train.schedule='cosin'"),
  ('init_from-kind', '--config.train.init_from=hub:gpt2', "train.init_from='hub:gpt2'"),
  # --- keys, types and choice syntax ---
  ('unknown-key', '--config.model.n_layerz=3', 'model.n_layerz=3: no such key'),
  ('wrong-type', '--config.model.n_layers=three', "model.n_layers='three': wrong type"),
  ('float-for-int', '--config.model.n_layers=2.5', 'model.n_layers=2.5: wrong type'),
  ('bool-word', '--config.model.tie_embeddings=maybe', "tie_embeddings='maybe'"),
  ('section-value', '--config.model.attention=3', 'model.attention=3: is a section'),
  ('unknown-choice', '--config=configs/base.py:bogus=1', 'bogus=1: unknown choice key'),
  ('ambiguous-choice', '--config=configs/base.py:factor=2.0', 'factor=2.0: ambiguous choice key'),
  (
    'unchosen-variant-key',
    '--config=configs/base.py:t5.num_buckets=64',
    "model.position.t5.num_buckets=64: read only by model.position.kind='t5' (it is 'rope')",
  ),
  (
    'unchosen-scaling-key',
    '--config.model.position.rope.scaling.yarn.beta_fast=8.0',
    "model.position.rope.scaling.yarn.beta_fast=8.0: read only by "
    "model.position.rope.scaling.kind='yarn' (it is 'none')",
  ),
  ('choice-syntax', '--config=configs/base.py:pos', "'pos': expected key=value"),
  ('override-syntax', '--config.model.n_layers', '--config.model.n_layers'),
  ('empty-data-path', '--config.data.path=', 'data.path'),
  # --- config files ---
  ('config-missing', '--config=configs/nope.py', "config='configs/nope.py': no such config file"),
  ('config-folder', '--config=configs', "config='configs': is a folder"),
  ('config-not-python', '--config=README.md', "config='README.md': is not a Python file"),
  ('config-syntax', '--config={syntax_config}', 'syntax error at line 2'),
  ('config-import', '--config={import_config}', 'importing it raised ModuleNotFoundError'),
  ('config-raises', '--config={raising_config}', 'get_config raised RuntimeError: no config'),
  ('config-no-get', '--config={empty_config}', 'defines no get_config'),
  ('config-returns-dict', '--config={dict_config}', 'get_config returned a dict'),
  # --- flags ---
  ('mode', '--mode=trian', "--mode='trian': unknown mode"),
  ('unknown-flag', '--no_such_flag=1', "Unknown command line flag 'no_such_flag'"),
  ('stop_after-zero', '--stop_after=0', '--stop_after=0'),
  ('stop_after-neg', '--stop_after=-5', '--stop_after=-5'),
  ('stop_after-word', '--stop_after=ten', '--stop_after=ten'),
  ('profile-first-step', '--profile=1:3', "--profile='1:3': allowed: FIRST:LAST steps"),
  ('profile-word', '--profile=a:b', "--profile='a:b': allowed: FIRST:LAST steps"),
  ('stray-argument', 'extra', "unexpected arguments ['extra']"),
  # --- output and input paths ---
  ('workdir-is-file', '--workdir={a_file}', "--workdir='{a_file}': is a file"),
  ('workdir-under-file', '--workdir={a_file}/run', 'lies under {a_file}, which is a file'),
  ('workdir-unwritable', '--workdir=/sys/mllm-bad-input/run', 'cannot be written'),
  ('cache-is-file', '--config.data.cache_dir={a_file}', "data.cache_dir='{a_file}': is a file"),
  ('cache-under-file', '--config.data.cache_dir={a_file}/c', 'data.cache_dir='),
  ('cache-unwritable', '--config.data.cache_dir=/sys/mllm-bad-input', 'cannot be written'),
  (
    'cache-env-is-file',
    'MLLM_CACHE_DIR={a_file} --config.data.cache_dir=none',
    "$MLLM_CACHE_DIR='{a_file}': is a file",
  ),
  ('eval-workdir-missing', '--mode=eval --workdir={a_dir}/nope', "--workdir='{a_dir}/nope'"),
  ('eval-workdir-file', '--mode=eval --workdir={a_file}', "--workdir='{a_file}': is a file"),
  ('eval-no-checkpoint', '--mode=eval --workdir={a_dir}', 'has no checkpoint to evaluate'),
  ('data-missing', '--config.data.path={a_dir}/nope', "data.path='{a_dir}/nope'"),
  ('data-empty-folder', '--config.data.path={a_dir}', 'no .txt files in this folder'),
  ('text-is-binary', '--config.data.path={binary}', "data.path='{binary}': is not UTF-8 text"),
  ('text-is-utf16', '--config.data.path={utf16}', "data.path='{utf16}': is not UTF-8 text"),
  ('text-is-parquet', '--config.data.path={parquet}', "data.path='{parquet}': is not UTF-8 text"),
  (
    'parquet-is-text',
    '--config.data.source=parquet --config.data.path={text}',
    "data.path='{text}': is not a Parquet file",
  ),
  (
    'parquet-is-jsonl',
    '--config.data.source=parquet --config.data.path={jsonl}',
    'is not a Parquet file',
  ),
  (
    'parquet-no-field',
    '--config.data.source=parquet --config.data.path={parquet} --config.data.text_field=body',
    "data.text_field='body': no such field",
  ),
  (
    'jsonl-is-binary',
    '--config.data.source=jsonl --config.data.path={binary}',
    "data.path='{binary}': is not UTF-8 text",
  ),
  ('jsonl-is-text', '--config.data.source=jsonl --config.data.path={text}', 'is not JSON'),
  (
    'jsonl-no-field',
    '--config.data.source=jsonl --config.data.path={jsonl} --config.data.text_field=body',
    "data.text_field='body'",
  ),
  ('hf-is-text', '--config.data.source=hf --config.data.path={text}', 'data.path='),
  # --- workdirs holding a run ---
  ('damaged-config-json', '--workdir={run_bad_json}', 'its config.json is not valid JSON'),
  (
    'optimizer-changed',
    '--workdir={run} --config.train.grad_clip=0.0',
    'train.grad_clip=0.0 (saved: 1.0): changes the optimizer state',
  ),
  (
    'model-changed',
    '--workdir={run} --config.model.d_model=48',
    'model.d_model=48 (saved: 32): changes the parameters',
  ),
  (
    'eval-model-changed',
    '--mode=eval --workdir={run} --config.model.n_layers=2',
    'model.n_layers=2 (saved: 1)',
  ),
  ('init_from-missing', '--config.train.init_from=workdir:{a_dir}/nope', 'train.init_from='),
  (
    'init_from-other-shape',
    '--config.train.init_from=workdir:{run} --config.model.d_model=64',
    'model.d_model=64 (saved: 32)',
  ),
]

SLOW_CASES = (
  'damaged-config-json',
  'optimizer-changed',
  'model-changed',
  'eval-model-changed',
  'init_from-other-shape',
)


def _write_configs(root) -> dict[str, str]:
  texts = {
    'syntax_config': 'def get_config():\n  return (\n',
    'import_config': 'import mllm_no_such_module\n',
    'raising_config': 'def get_config():\n  raise RuntimeError("no config here")\n',
    'empty_config': 'X = 1\n',
    'dict_config': 'def get_config():\n  return {"model": {}}\n',
    'nan_config': (
      'from configs import base\n\ndef get_config(arg=None):\n'
      '  config = base.get_config(arg)\n'
      '  config.train.learning_rate = float("nan")\n  return config\n'
    ),
  }
  out = {}
  for name, text in texts.items():
    path = os.path.join(root, f'{name}.py')
    with open(path, 'w') as f:
      f.write(text)
    out[name] = path
  return out


@pytest.fixture(scope='module')
def paths(tmp_path_factory):
  """The files the cases name: a small corpus, files of the wrong kind, bad configs."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  root = tmp_path_factory.mktemp('inputs')
  corpus = root / 'corpus'
  corpus.mkdir()
  stdlib = os.path.dirname(os.__file__)
  for name in ('abc.py', 'bisect.py', 'colorsys.py', 'fnmatch.py', 'glob.py', 'keyword.py'):
    shutil.copy(os.path.join(stdlib, name), corpus / f'{name}.txt')
  text = (corpus / 'abc.py.txt').read_text()
  (root / 'binary.bin').write_bytes(np.random.default_rng(0).bytes(4096))
  (root / 'utf16.txt').write_bytes(text.encode('utf-16'))
  (root / 'a.txt').write_text(text)
  (root / 'a.jsonl').write_text('{"text": "hello"}\n{"text": "world"}\n')
  pq.write_table(
    pa.table({'text': [text[i : i + 200] for i in range(0, 2000, 200)]}), root / 'a.parquet'
  )
  (root / 'empty').mkdir()
  files = {
    'corpus': str(corpus),
    'binary': str(root / 'binary.bin'),
    'utf16': str(root / 'utf16.txt'),
    'text': str(root / 'a.txt'),
    'jsonl': str(root / 'a.jsonl'),
    'parquet': str(root / 'a.parquet'),
    'a_file': str(root / 'a.txt'),
    'a_dir': str(root / 'empty'),
    'cache': str(root / 'cache'),
  }
  files.update(_write_configs(root))
  return files


@pytest.fixture(scope='module')
def server():
  """launch.py runs forked from one warm process (tests/launch_server.py): ~0.2 s a case, not 1.6;
  the worker's shared one, which other modules' launches use too (a server starts in ~4 s)."""
  return launch_server.shared()


@pytest.fixture(scope='module')
def trained_run(paths, server, tmp_path_factory):
  """A workdir holding a finished 4-step run of BASE_ARGS (made once per worker)."""
  workdir = str(tmp_path_factory.mktemp('trained') / 'run')
  result = server.run(shlex.split(BASE_ARGS.format(**paths, workdir=workdir)))
  assert result.returncode == 0, result.stderr
  return workdir


def _prepare(name: str, paths, request, tmp_path) -> str:
  """The value of placeholder `name`: a file of `paths`, or a fresh copy of the trained run."""
  if name in paths:
    return paths[name]
  source = request.getfixturevalue('trained_run')
  target = str(tmp_path / name)
  shutil.copytree(source, target)
  if name == 'run_bad_json':
    with open(os.path.join(target, 'config.json'), 'w') as f:
      f.write('{"model": ')
  return target


@pytest.mark.parametrize(
  'case_id,args,expected',
  [
    pytest.param(
      *case,
      id=case[0],
      marks=[pytest.mark.xdist_group('bad-inputs-run')] if case[0] in SLOW_CASES else [],
    )
    for case in CASES
  ],
)
def test_bad_input_is_one_error_line_exit_2_no_traceback(
  case_id, args, expected, paths, server, request, tmp_path
):
  words = shlex.split(args)
  env = {}
  while (
    words and '=' in words[0] and not words[0].startswith('-') and words[0].split('=')[0].isupper()
  ):
    key, _, value = words.pop(0).partition('=')
    env[key] = value
  text = ' '.join(shlex.quote(w) for w in words) + ' ' + expected
  values = {
    name: _prepare(name, paths, request, tmp_path)
    for _, name, _, _ in string.Formatter().parse(text + ' '.join(env.values()))
    if name
  }
  env = {k: v.format(**values) for k, v in env.items()}
  base = BASE_ARGS.format(**paths, workdir=str(tmp_path / 'workdir'))
  argv = shlex.split(base + ' ' + ' '.join(shlex.quote(w) for w in words).format(**values))
  result = server.run(argv, env)
  output = result.stdout + result.stderr
  assert 'Traceback' not in output, output
  assert result.returncode == 2, output
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  errors = [line for line in lines if line.startswith('error:')]
  assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
  assert expected.format(**values) in errors[0], errors[0]


def test_the_table_is_large_and_unique():
  assert len(CASES) >= 80
  assert len({case[0] for case in CASES}) == len(CASES)


def test_the_launch_server_gives_what_a_fresh_process_gives(server, tmp_path):
  """The forked runs above stand for `python launch.py` (and `python -m experiments`): the same exit
  status, stdout and stderr, also for a process that writes and dies mid-run (a config that calls
  os._exit)."""
  import subprocess

  dying = tmp_path / 'dying.py'
  dying.write_text('import os, sys\nprint("out")\nsys.stderr.write("err\\n")\nos._exit(3)\n')
  cases = [
    ['--config=configs/base.py', '--config.model.d_model=-1'],
    ['--config=configs/base.py', '--no_such_flag=1'],
    [f'--config={dying}'],
  ]
  for args in cases:
    fresh = run_fresh(args, dict(os.environ, JAX_PLATFORMS='cpu'), timeout=120)
    forked = server.run(args)
    assert (forked.returncode, forked.stdout, forked.stderr) == (
      fresh.returncode,
      fresh.stdout,
      fresh.stderr,
    ), args
  assert forked.returncode == 3 and forked.stdout == 'out\n'
  # `python -m experiments` as well: argparse's usage line names the program from sys.argv[0].
  args = ['noise', '--no_such_flag']
  fresh = run_fresh(args, dict(os.environ, JAX_PLATFORMS='cpu'), 120, module='experiments')
  forked = server.run(args, module='experiments')
  assert (forked.returncode, forked.stdout, forked.stderr) == (
    fresh.returncode,
    fresh.stdout,
    fresh.stderr,
  )
  assert forked.returncode == 2 and forked.stderr.startswith('usage: '), forked.stderr
  # Past its timeout a child is killed, and the server goes on serving.
  sleeping = tmp_path / 'sleeping.py'
  sleeping.write_text('import time\ntime.sleep(60)\n')
  with pytest.raises(subprocess.TimeoutExpired):
    server.run([f'--config={sleeping}'], timeout=1)
  assert server.run(cases[0]).returncode == 2
