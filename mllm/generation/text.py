"""Text in, text out: a trained workdir's model and tokenizer (`load_run`), a request's checks,
streamed text, and `generate` over `generate_tokens`."""

from __future__ import annotations

from mllm.checks import InputError
from mllm.config import load_config
from mllm.data.tokenizers import BPETokenizer, ByteTokenizer
from mllm.generation.decode import generate_tokens
from mllm.paths import existing_dir
from mllm.train.checkpoint import Checkpointer
from mllm.train.resume import run_config
from mllm.train.sharding import make_mesh
from mllm.train.state import model_setup
from mllm.train.state_signature import StateMismatch


def load_run(workdir: str, like):
  """(model in eval mode, tokenizer, checkpoint step, config) of the training run in `workdir`.

  The architecture comes from the run's own config (config.json, else the checkpoint's copy), so
  any --config works; `like` (a full config) supplies the keys an older run did not save.
  """
  existing_dir('--workdir', workdir, 'the workdir of a training run')
  ckpt = Checkpointer(workdir, read_only=True)
  try:
    step = ckpt.latest_step()
    if step is None:
      raise InputError(
        '--workdir',
        workdir,
        'has no checkpoint to generate from; allowed: the workdir of a training run',
      )
    saved = run_config(workdir, like, ckpt, step)
    config = load_config(saved) if saved is not None else like
    model_parts = model_setup(config, make_mesh(config.mesh))
    try:
      step, params = ckpt.restore_latest(
        model_parts.abstract_params, params_only=True, set_aside=False
      )
    except StateMismatch as err:
      raise InputError(
        '--workdir',
        workdir,
        f'its checkpoint step {err.step} does not match its '
        'config; allowed: a workdir whose config.json describes its checkpoints',
      ) from None
  finally:
    ckpt.close()
  if config.data.tokenizer == 'byte':
    tokenizer = ByteTokenizer()
  else:
    path = f'{workdir}/tokenizer.json'
    try:
      tokenizer = BPETokenizer.from_file(path, config.data.eos_token, config.data.pad_token)
    except Exception as err:  # missing or unreadable
      raise InputError(
        '--workdir',
        workdir,
        f'its tokenizer.json cannot be read '
        f'({type(err).__name__}); allowed: the workdir of a training run',
      ) from None
  model = model_parts.merge(params)
  model.eval()
  return model, tokenizer, step, config


def check_request(
  model, prompts: list[list[int]], max_new_tokens: int, repetition_penalty: float = 1.0
) -> None:
  """One-line InputErrors for requests the model cannot serve."""
  if not repetition_penalty > 0:
    raise InputError(
      '--repetition_penalty',
      repetition_penalty,
      'must be > 0 (1: off; above 1 discourages repeats)',
    )
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
    raise InputError('--max_new_tokens', max_new_tokens, 'must be a positive integer')
  if not prompts:
    raise InputError(
      '--prompt',
      '',
      'no prompt given; allowed: --prompt=TEXT or --prompt_file=FILE with one prompt per line',
    )
  for i, prompt in enumerate(prompts):
    if not prompt:
      raise InputError('--prompt', '', f'prompt {i + 1} is empty; allowed: at least one token')
  table = model.position.max_positions
  longest = max(len(p) for p in prompts)
  if table is not None and longest + max_new_tokens > table:
    raise InputError(
      '--max_new_tokens',
      max_new_tokens,
      f'learned positions end at model.max_seq_len={table} and the longest prompt '
      f'has {longest} tokens; allowed: <= {max(table - longest, 0)}',
    )


class TextStream:
  """Turns the decode loop's tokens into text as they come, for one sequence: `on_text` gets
  each new piece once it decodes to whole characters (a byte-level token may end mid-UTF-8)."""

  def __init__(self, tokenizer, on_text, index: int = 0):
    self.tokenizer, self.on_text, self.index = tokenizer, on_text, index
    self.ids, self.emitted = [], 0

  def __call__(self, tokens_B, finished_B):
    token = int(tokens_B[self.index])
    if finished_B[self.index] or token == self.tokenizer.eos_id:
      return
    self.ids.append(token)
    text = self.tokenizer.decode(self.ids)
    if text.endswith('\ufffd'):  # an incomplete character: wait for its other bytes
      return
    self.on_text(text[self.emitted :])
    self.emitted = len(text)


def generate(
  model,
  tokenizer,
  prompts: list[str],
  *,
  max_new_tokens: int = 100,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  repetition_penalty: float = 1.0,
  seed: int = 0,
  stop_at_eos: bool = True,
  on_text=None,
  timings: dict | None = None,
) -> list[str]:
  """The continuation of each text prompt (its new tokens, decoded; EOS not included).
  on_text(piece), with one prompt: called with the text as it is generated."""
  ids = [tokenizer.encode(p) for p in prompts]
  check_request(model, ids, max_new_tokens, repetition_penalty)
  eos = tokenizer.eos_id if stop_at_eos else None
  stream = None
  if on_text is not None:
    if len(prompts) != 1:
      raise ValueError(f'on_text streams one prompt; got {len(prompts)}')
    stream = TextStream(tokenizer, on_text)
  out = generate_tokens(
    model,
    ids,
    max_new_tokens=max_new_tokens,
    eos_id=eos,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    repetition_penalty=repetition_penalty,
    seed=seed,
    stream=stream,
    timings=timings,
  )
  if timings is not None:
    timings.update(prompt_tokens=sum(len(p) for p in ids), new_tokens=sum(len(o) for o in out))
  return [tokenizer.decode([t for t in seq if t != tokenizer.eos_id]) for seq in out]
