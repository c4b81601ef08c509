"""mllm entry point.

    python launch.py --config=configs/rope_swiglu.py                  # train (resumes its workdir)
    python launch.py --config=configs/rope_swiglu.py --mode=eval      # evaluate its latest checkpoint
    python launch.py --config=configs/rope_swiglu.py --mode=summary   # tables, counts, one forward
    python launch.py --mode=generate --workdir=runs/rope_swiglu --prompt="def fib(n):"
    python launch.py --config=configs/base.py:pos=alibi,ffn=geglu --config.model.n_layers=2
    python launch.py --mode=import --hf=PATH --workdir=runs/llama  # a Hugging Face checkpoint
    python launch.py --workdir=runs/llama --config.model.position.rope.scaling.kind=yarn  # train on
    python launch.py --mode=export --workdir=runs/llama --hf=OUT    # back to Hugging Face

Without --config, a --workdir that holds a run's config.json runs with that config.

Bad configs, overrides, flags, paths and data print one line naming the key or path, the value and
what is allowed, and exit with status 2: what only the run can check (paths, data, a resume)
raises an InputError (a ConfigError for a config key), caught here, so no traceback.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging

from mllm import malloc, supervisor
from mllm.checks import ConfigError, InputError, RunFault
from mllm.config import load_config, read_config
from mllm.config_keys import field_info, get_path, parse_value
from mllm.config_schema import set_key
from mllm.paths import RunDir
from mllm.validation import init_source

DEFAULT_CONFIG = 'configs/rope_swiglu.py'
BASE_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configs', 'base.py')
MODE_NAMES = ('train', 'eval', 'summary', 'generate', 'import', 'export')

_CONFIG = flags.DEFINE_string(
  'config',
  None,
  f'Config file, optionally with :choices (default {DEFAULT_CONFIG}, or the config.json of an '
  'existing --workdir). Override any key with --config.KEY=VALUE.',
)
_MODE = flags.DEFINE_string('mode', 'train', 'What to do: ' + ', '.join(MODE_NAMES) + '.')
_WORKDIR = flags.DEFINE_string(
  'workdir',
  None,
  'Run directory: checkpoints, metrics, config; default runs/<config name>. '
  'An existing one is resumed.',
)
_STOP_AFTER = flags.DEFINE_integer(
  'stop_after',
  None,
  'Train up to this step, save and exit (for chunked jobs); the schedule still ends at '
  'train.steps.',
  lower_bound=1,
)
_PROFILE = flags.DEFINE_string(
  'profile',
  None,
  'Train: trace steps FIRST:LAST with jax.profiler into <workdir>/profile (TensorBoard, Perfetto).',
)
_HF = flags.DEFINE_string(
  'hf', None, '--mode=import: the Hugging Face folder to read; --mode=export: the folder to write.'
)
_PROMPT = flags.DEFINE_string('prompt', None, '--mode=generate: the text to continue.')
_PROMPT_FILE = flags.DEFINE_string(
  'prompt_file', None, '--mode=generate: a file of prompts, one per line (a batch).'
)
_MAX_NEW_TOKENS = flags.DEFINE_integer(
  'max_new_tokens', 100, '--mode=generate: tokens to add per prompt (fewer if it ends with EOS).'
)
_TEMPERATURE = flags.DEFINE_float(
  'temperature', 0.0, '--mode=generate: 0 is greedy.', lower_bound=0.0
)
_TOP_K = flags.DEFINE_integer(
  'top_k', 0, '--mode=generate: sample from the k likeliest tokens (0: all).', lower_bound=0
)
_TOP_P = flags.DEFINE_float(
  'top_p',
  1.0,
  '--mode=generate: nucleus sampling mass (1: all).',
  lower_bound=0.0,
  upper_bound=1.0,
)
_REPETITION_PENALTY = flags.DEFINE_float(
  'repetition_penalty', 1.0, '--mode=generate: CTRL repetition penalty (1: off).'
)
_SEED = flags.DEFINE_integer('seed', 0, '--mode=generate: sampling seed.')


def _summary(config) -> None:
  from mllm.summary import summarize

  base = read_config(BASE_CONFIG) if os.path.isfile(BASE_CONFIG) else None
  summarize(config, base, spec=_config_spec())


def _train(config) -> None:
  from mllm.train import TrainingDiverged, train
  from mllm.train.peers import is_lost_peer, report_lost_peer

  try:
    train(config, _workdir(), stop_after=_STOP_AFTER.value, hooks=_profile_hooks())
  except TrainingDiverged as err:
    print(f'error: {err}', file=sys.stderr)
    sys.exit(1)
  except Exception as err:
    if is_lost_peer(err):  # another process of the job died (one line, exit 1)
      report_lost_peer(err)
    raise


def _profile_hooks() -> tuple:
  """--profile=FIRST:LAST as a hook of the loop (mllm/train/hooks.py); none without it."""
  if _PROFILE.value is None:
    return ()
  from mllm.train.hooks import profiler

  first, _, last = _PROFILE.value.partition(':')
  try:
    return (profiler(os.path.join(_workdir(), 'profile'), int(first), int(last or first)),)
  except ValueError:
    raise InputError(
      '--profile', _PROFILE.value, 'allowed: FIRST:LAST steps with 2 <= FIRST <= LAST, e.g. 10:12'
    ) from None


def _eval(config) -> None:
  from mllm.train import evaluate

  workdir = _workdir()
  result = evaluate(config, workdir)
  import jax  # initialized by evaluate (several processes: each computes the same numbers)

  if jax.process_index() == 0:
    print(
      f"step {result['step']} of {workdir}: val loss {result['loss']:.4f}  "
      f"perplexity {result['perplexity']:.2f}  bits/byte {result['bits_per_byte']:.4f}  "
      f"({result['tokens']:,.0f} tokens)"
    )


def _workdir() -> str:
  """--workdir, else runs/<config name>[-<choices>]."""
  if _WORKDIR.value:
    return _WORKDIR.value
  path, _, arg = _config_spec().partition(':')
  name = os.path.splitext(os.path.basename(path))[0]
  if arg:
    name += '-' + ''.join(c if c.isalnum() or c in '._=-' else '_' for c in arg.replace(',', '-'))
  return os.path.join('runs', name)


def _generate(config) -> None:
  from mllm.generation import generate, load_run
  from mllm.supervisor import several_processes

  if several_processes(os.environ):
    raise InputError(
      '--mode',
      'generate',
      'decodes in one process (a checkpoint written by '
      'several processes restores in one); allowed: start it once, without the '
      'cluster variables (JAX_COORDINATOR_ADDRESS, SLURM_NTASKS > 1, ...)',
    )
  workdir = _workdir()
  prompts = _prompts()
  model, tokenizer, step, _ = load_run(workdir, config)
  timings = {}
  streaming = len(prompts) == 1  # one prompt: print its text as it is produced
  if streaming:
    print(prompts[0], end='', flush=True)
  texts = generate(
    model,
    tokenizer,
    prompts,
    max_new_tokens=_MAX_NEW_TOKENS.value,
    temperature=_TEMPERATURE.value,
    top_k=_TOP_K.value,
    top_p=_TOP_P.value,
    repetition_penalty=_REPETITION_PENALTY.value,
    seed=_SEED.value,
    on_text=(lambda piece: print(piece, end='', flush=True)) if streaming else None,
    timings=timings,
  )
  if streaming:
    print(flush=True)
  else:
    for prompt, text in zip(prompts, texts):
      print(f'{prompt}{text}', flush=True)
      print('─' * 40)
  prefill_s, decode_s = timings['prefill_s'], timings['decode_s']
  print(
    f"{workdir} step {step}: prefill {timings['prompt_tokens']:,} tokens in "
    f"{prefill_s:.3f} s ({timings['prompt_tokens'] / prefill_s:,.0f} tok/s), decode "
    f"{timings['new_tokens']:,} tokens in {decode_s:.3f} s "
    f"({timings['new_tokens'] / decode_s:,.0f} tok/s); compile {timings['compile_s']:.1f} s",
    file=sys.stderr,
  )


def _prompts() -> list[str]:
  """--prompt, then --prompt_file's lines (blank ones skipped); an InputError if there are none."""
  prompts = [_PROMPT.value] if _PROMPT.value is not None else []
  if _PROMPT_FILE.value:
    try:
      with open(_PROMPT_FILE.value, encoding='utf-8') as f:
        prompts += [line.rstrip('\n') for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as err:
      raise InputError(
        '--prompt_file',
        _PROMPT_FILE.value,
        f'cannot be read ({err}); allowed: a UTF-8 text file with one prompt per line',
      ) from None
  if not prompts:
    raise InputError(
      '--prompt',
      None,
      'no prompt given; allowed: --prompt=TEXT or --prompt_file=FILE with one prompt per line',
    )
  return prompts


def _import(config) -> None:
  """A normal workdir from a Hugging Face folder: its config (the model, the tokenizer; the rest
  from --config), tokenizer.json and the weights as checkpoint step 0, for train/eval/generate."""
  from mllm.train.loop import save_initial_state

  workdir = _hf_workdir()
  checkpoints = RunDir(workdir).checkpoints
  if os.path.isdir(checkpoints) and os.listdir(checkpoints):
    raise InputError('--workdir', workdir, 'already holds checkpoints; allowed: a new workdir')
  save_initial_state(config, workdir)
  print(
    f'imported {_HF.value} into {workdir} (step 0). Next: python launch.py --workdir={workdir} '
    '[--mode=eval|generate]'
  )


def _export(config) -> None:
  from mllm.data.tokenizers import BPETokenizer
  from mllm.generation import load_run
  from mllm.interop.hf import HFExportError, to_hf

  workdir = _hf_workdir()
  model, tokenizer, step, config = load_run(workdir, config)
  try:
    family = to_hf(
      config, model, _HF.value, tokenizer=tokenizer if isinstance(tokenizer, BPETokenizer) else None
    )
  except HFExportError as err:
    _fail(str(err))
  print(
    f'exported {workdir} step {step} to {_HF.value} as {family} '
    '(transformers: AutoModelForCausalLM.from_pretrained)'
  )


def _hf_workdir() -> str:
  if not _HF.value:
    _fail(f'--hf: --mode={_MODE.value} needs the Hugging Face folder; allowed: --hf=PATH')
  if not _WORKDIR.value:
    _fail(f'--workdir: --mode={_MODE.value} needs the mllm workdir; allowed: --workdir=DIR')
  return _WORKDIR.value


MODES = {
  'train': _train,
  'eval': _eval,
  'summary': _summary,
  'generate': _generate,
  'import': _import,
  'export': _export,
}
assert tuple(MODES) == MODE_NAMES


def _fail(message: str) -> None:
  print(f'error: {message}', file=sys.stderr)
  sys.exit(2)


def _config_spec() -> str:
  return DEFAULT_CONFIG if _CONFIG.value is None else _CONFIG.value


def _read_config():
  """--config's file; without --config, the config.json of --workdir if it holds one."""
  workdir = _WORKDIR.value
  if _CONFIG.value is None and workdir and os.path.isfile(RunDir(workdir).config):
    from mllm.train.resume import run_config

    return run_config(workdir, read_config(BASE_CONFIG)), True
  return read_config(_config_spec()), False


def build_config(overrides: list[str]):
  """The run's config: --config's file (or the workdir's), the `--config.KEY=VALUE` overrides
  parsed by the config's schema, then validated once and frozen (`load_config`); a problem raises
  one InputError line.

  With --mode=import or train.init_from='hf:PATH' (and a config not read from the workdir), the
  model and tokenizer settings come from the Hugging Face folder; the overrides still win.
  """
  config, from_workdir = _read_config()
  explicit = {}
  for arg in overrides:
    key, sep, value = arg[len('--config.') :].partition('=')
    if not sep:
      raise InputError(f'--config.{key}', None, 'expected --config.key=value')
    set_key(config, key, parse_value(value, *field_info(config, key)))
    explicit[key] = get_path(config, key)
  if _MODE.value == 'import' and _HF.value:
    config.train.init_from = 'hf:' + os.path.abspath(_HF.value)
  kind, path = init_source(config.train.init_from)
  if kind == 'hf' and not from_workdir:
    config = _from_hf(config, path, explicit)
  return load_config(config)


def _from_hf(config, path: str, explicit: dict):
  from mllm.interop.hf import HFImportError, run_config
  from mllm.train.init_from import check_hf_folder

  check_hf_folder(config, path)
  if not os.path.isfile(os.path.join(path, 'tokenizer.json')):
    raise ConfigError(
      'train.init_from',
      config.train.init_from,
      f'{path} has no tokenizer.json '
      '(a tokenizer made here would give the ids other meanings); allowed: a '
      'folder with the tokenizer.json its model was trained with',
    )
  try:
    return run_config(config, path, explicit)
  except HFImportError as err:
    raise ConfigError('train.init_from', config.train.init_from, str(err)) from None


def parse_argv(argv: list[str]) -> list[str]:
  """app.run's flags parser, the one reader of the command line: absl parses the flags declared
  above (a bad one is one line); the `--config.KEY=VALUE` overrides go on to main as its arguments.

  absl cannot declare override flags before the config is read, so mllm's config schema parses
  them (`build_config`). ml_collections' `config_flags` would type each override from its default
  value (`--config.data.path=none` would be the string 'none'), demand --config before its
  overrides and report a bad config file as a traceback.
  """
  overrides = [arg for arg in argv[1:] if _is_override(arg)]
  try:
    rest = flags.FLAGS([argv[0], *(arg for arg in argv[1:] if not _is_override(arg))])
  except flags.Error as err:
    _fail(str(err).splitlines()[0])
  return rest + overrides


def _is_override(arg: str) -> bool:
  return arg.startswith('--config.')


def main(argv: list[str]) -> None:
  malloc.keep_freed_memory()  # before JAX's threads start: a step's buffers stay mapped
  unexpected = [arg for arg in argv[1:] if not _is_override(arg)]
  if unexpected:
    _fail(f'unexpected arguments {unexpected!r}; flags look like --config=... --mode=...')
  if _MODE.value not in MODES:
    _fail(f"--mode={_MODE.value!r}: unknown mode; allowed: {', '.join(MODES)}")
  logging.set_verbosity(logging.WARNING)  # keep JAX's backend probing out of the output
  try:
    config = build_config(argv[1:])
    from mllm import compile_cache

    compile_cache.enable()  # a relaunch of the same shapes reads XLA's output from disk
    MODES[_MODE.value](config)
  except InputError as err:  # a bad config, flag or path; or what only the run can check
    _fail(str(err))
  except RunFault as err:  # the machine's: a full disk, a lost peer (what was kept, what to do)
    print(f'error: {err}', file=sys.stderr, flush=True)
    sys.stdout.flush()
    # At once, as below: Orbax's and asyncio's threads would print their own failures during the
    # interpreter's teardown (their tracebacks are in the run log already).
    os._exit(2 if err.fixable else 1)
  except OSError as err:  # a path the checks could not foresee (a disk filling up, a lost mount)
    where = f'{err.filename}: ' if err.filename else ''
    _fail(f'{where}{err.strerror or err}')
  except KeyboardInterrupt:  # a second Ctrl-C / SIGTERM: stop at once, without a traceback
    print(
      'error: interrupted; the latest saved checkpoint is kept, run again to resume',
      file=sys.stderr,
      flush=True,
    )
    sys.stdout.flush()
    # At once: the interrupt may have landed inside JAX or Orbax with their threads mid-work, and
    # the interpreter's teardown then crashes (seen: a segfault). Committed checkpoints are safe.
    os._exit(130)


if __name__ == '__main__':
  if supervisor.wanted(os.environ):  # a process of a multi-process job: trains as a child
    sys.exit(supervisor.supervise(sys.argv))
  supervisor.report_signals()
  app.run(main, flags_parser=parse_argv)
