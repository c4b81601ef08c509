"""Generation from a trained workdir: the Python API and `launch.py --mode=generate`, good and bad
requests (each bad one a single `error:` line, exit 2)."""

from __future__ import annotations

import os

import launch_server
import pytest
from conftest import make_config

from mllm.checks import InputError
from mllm.generation import generate, generate_tokens, load_run
from mllm.train import train


# Its tests carry xdist_group('generate'): one worker trains it.
@pytest.fixture(scope='module')
def run(corpus, tmp_path_factory):
  """A tiny byte-level model with learned positions (a 32-token table), trained 40 steps."""
  workdir = str(tmp_path_factory.mktemp('gen'))
  config = make_config(
    corpus,
    str(tmp_path_factory.mktemp('cache')),
    model__dropout=0.0,
    model__position__kind='learned',
  )
  train(config, workdir, progress=False)
  return config, workdir


@pytest.mark.xdist_group('generate')
def test_text_api_equals_token_generation(run):
  config, workdir = run
  model, tokenizer, step, saved = load_run(workdir, config)
  assert step == config.train.steps and saved.model.position.kind == 'learned'
  prompts = ['def ', 'import os\n']
  texts = generate(model, tokenizer, prompts, max_new_tokens=12)
  ids = generate_tokens(
    model, [tokenizer.encode(p) for p in prompts], max_new_tokens=12, eos_id=tokenizer.eos_id
  )
  assert texts == [tokenizer.decode([t for t in seq if t != tokenizer.eos_id]) for seq in ids]
  assert all(len(seq) == 12 or seq[-1] == tokenizer.eos_id for seq in ids)
  with pytest.raises(
    InputError,
    match=r'^--max_new_tokens=30: learned positions end at '
    r'model.max_seq_len=32 .* allowed: <= 28$',
  ):
    generate(model, tokenizer, ['def '], max_new_tokens=30)
  with pytest.raises(InputError, match=r'^--prompt=.*prompt 2 is empty'):
    generate(model, tokenizer, ['def ', ''], max_new_tokens=3)


def launch(*args) -> launch_server.Result:
  """`python launch.py --mode=generate ARGS` (forked from a warm process: tests/launch_server.py)."""
  return launch_server.shared().run(['--mode=generate', *args])


@pytest.mark.xdist_group('generate')
def test_launch_generate_prints_the_continuation_and_speeds(run, tmp_path):
  _, workdir = run
  prompts = tmp_path / 'prompts.txt'
  prompts.write_text('def f(x):\nclass A:\n', encoding='utf-8')
  proc = launch(
    f'--workdir={workdir}',
    f'--prompt_file={prompts}',
    '--max_new_tokens=8',
    '--temperature=0.8',
    '--top_k=20',
    '--seed=3',
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.startswith('def f(x):') and '\nclass A:' in proc.stdout
  assert 'prefill ' in proc.stderr and 'tok/s' in proc.stderr and 'Traceback' not in proc.stderr
  again = launch(
    f'--workdir={workdir}',
    f'--prompt_file={prompts}',
    '--max_new_tokens=8',
    '--temperature=0.8',
    '--top_k=20',
    '--seed=3',
  )
  assert again.stdout == proc.stdout  # seeded


@pytest.mark.xdist_group('generate')
def test_launch_streams_one_prompt_as_the_api_generates_it(run):
  config, workdir = run
  model, tokenizer, _, _ = load_run(workdir, config)
  want = generate(model, tokenizer, ['def '], max_new_tokens=10, repetition_penalty=1.3)[0]
  proc = launch(
    f'--workdir={workdir}', '--prompt=def ', '--max_new_tokens=10', '--repetition_penalty=1.3'
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout == f'def {want}\n'
  assert 'compile' in proc.stderr and 'Traceback' not in proc.stderr


@pytest.mark.xdist_group('generate')
@pytest.mark.parametrize(
  'args, expected',
  [
    (['--prompt=def ', '--repetition_penalty=0'], '--repetition_penalty=0.0: must be > 0'),
    (['--prompt='], "--prompt='': prompt 1 is empty"),
    (['--prompt=def ', '--max_new_tokens=0'], '--max_new_tokens=0: must be a positive integer'),
    (['--prompt=def ', '--max_new_tokens=40'], '--max_new_tokens=40: learned positions end'),
    (['--prompt_file=/nonexistent/prompts.txt'], '--prompt_file='),
    ([], '--prompt=None: no prompt given'),
  ],
)
def test_launch_generate_bad_requests_are_one_line(run, args, expected):
  _, workdir = run
  proc = launch(f'--workdir={workdir}', *args)
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2 and lines[-1].startswith(f'error: {expected}'), proc.stderr[-2000:]
  assert 'Traceback' not in proc.stderr


def test_launch_generate_without_a_checkpoint(tmp_path):
  os.makedirs(tmp_path / 'empty')
  proc = launch(f'--workdir={tmp_path / "empty"}', '--prompt=x')
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1].startswith('error: --workdir=')
  assert 'has no checkpoint to generate from' in proc.stderr


@pytest.mark.xdist_group('generate')
def test_restoring_parameters_builds_no_optimizer(run, monkeypatch):
  """Evaluation and generation restore parameters through the model's structure alone."""
  import math

  from mllm.train import evaluate, optimizer, state

  def refuse(*args, **kwargs):
    raise AssertionError('an optimizer was built to restore parameters')

  monkeypatch.setattr(optimizer, 'make_optimizer', refuse)
  monkeypatch.setattr(state, 'make_optimizer', refuse)
  config, workdir = run
  model, _, step, _ = load_run(workdir, config)
  assert step == config.train.steps and model is not None
  assert math.isfinite(evaluate(config, workdir)['loss'])
