"""Config validation: every invalid value or combination raises a one-line `ConfigError` naming
the key, the bad value and what is allowed, before anything is built or compiled. Generic checks
live here; each variant's own rules live with it (`PositionScheme.check`, `MoE.check`,
`check_norm_config`, the attention implementations' records) and are called from here."""

from __future__ import annotations

import math

from ml_collections import config_dict

from mllm.checks import ConfigError, integer, number, one_of, positive, rate
from mllm.config_keys import field_info, flatten, get_path, leaf_paths
from mllm.layers.attention import (
  ATTENTIONS,
  OUTPUT_GATES,
  QK_NORM_OVER,
  layer_patterns,
  pattern_period,
)
from mllm.layers.ffn import check_ffn_config
from mllm.layers.moe import moe_layers
from mllm.layers.norms import check_norm_config
from mllm.layers.parametrization import INIT_SCHEMES, check_parametrization
from mllm.layers.positions import POSITIONS, check_position_config
from mllm.layers.remat import REMAT_POLICIES
from mllm.ops.attention import ATTENTION_IMPLS, impls_with
from mllm.optimizers import OPTIMIZERS
from mllm.variant_config import check_variant_keys

DTYPES = ('float32', 'bfloat16')
DEFAULT_INIT_STD = 0.02  # configs/base.py's model.init_std
DATA_SOURCES = ('stdlib', 'kjv', 'text', 'jsonl', 'parquet', 'hf')
TOKENIZERS = ('bpe', 'byte')
SCHEDULES = ('cosine', 'linear', 'constant', 'inverse_sqrt')
MESH_AXES = ('data', 'fsdp', 'expert', 'tensor')
INIT_SOURCES = ('workdir', 'hf')  # train.init_from='workdir:PATH' or 'hf:PATH'


def check_finite(config: config_dict.ConfigDict, prefix: str = '') -> None:
  """Every float in the config is a number: NaN and ±inf pass most range checks unnoticed
  (`nan <= 0` is False), and would only show up as a NaN loss many steps later."""
  for path, value in flatten(config).items():
    if isinstance(value, float) and not math.isfinite(value):
      raise ConfigError(
        prefix + path, value, 'must be a finite number; NaN and ±inf are not allowed'
      )


def _divisors(n: int) -> str:
  return ', '.join(str(d) for d in range(1, n + 1) if n % d == 0)


def _schema_model_keys() -> tuple[list[str], list[str]]:
  """The model keys the schema declares optional (a placeholder: None means "derive it") and
  those it declares boolean, read from the schema itself (config_schema.py and the variants' own
  keys it adds), not restated here."""
  from mllm.config_schema import get_config  # deferred: the schema imports this module's callers

  model = get_config().model
  paths = list(leaf_paths(model))
  optional = [path for path in paths if field_info(model, path)[2]]
  booleans = [path for path in paths if field_info(model, path)[1] is bool]
  return optional, booleans


def _check_layer_pattern(m, p: str) -> None:
  """Scanned layers repeat one period of the per-layer patterns (attention.py's pattern_period),
  so the layers must be a whole number of periods, and an unrolled loop iteration too."""
  size = pattern_period(m)
  if not m.scan_layers or size == 1:
    return
  named = [f'{p}.{key}' for key, n in layer_patterns(m).items() if n]
  every = ' and '.join(named) + (' repeat' if len(named) > 1 else ' repeats') + f' every {size}'
  if m.n_layers % size:
    raise ConfigError(
      f'{p}.n_layers',
      m.n_layers,
      f'{p}.scan_layers=True scans whole periods of the layer pattern ({every} layers); '
      f'allowed: a multiple of {size}, or {p}.scan_layers=False',
    )
  if m.scan_unroll != 1 and m.scan_unroll % size:
    raise ConfigError(
      f'{p}.scan_unroll',
      m.scan_unroll,
      f'an unrolled iteration runs whole periods of the layer pattern ({every} layers); '
      f'allowed: 1 (one period), or a multiple of {size}',
    )


def _check_model_scalars(m: config_dict.ConfigDict, p: str) -> None:
  """The model section's own keys: sizes, what may be None, booleans, init, dtypes, rates."""
  for key in ('vocab_size', 'd_model', 'n_layers', 'n_heads', 'n_kv_heads', 'max_seq_len'):
    value = m[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise ConfigError(f'{p}.{key}', value, 'must be a positive integer')
  optional, booleans = _schema_model_keys()
  for path, value in flatten(m).items():
    if value is None and path not in optional:
      raise ConfigError(
        f'{p}.{path}',
        value,
        'must be set; None is allowed only for ' + ', '.join(f'{p}.{k}' for k in optional),
      )
  for path in booleans:
    value = get_path(m, path)
    if not isinstance(value, bool) and not (value is None and path in optional):
      raise ConfigError(f'{p}.{path}', value, 'must be true or false')
  integer(f'{p}.head_dim', m.head_dim, optional=True)
  one_of(f'{p}.init', m.init, INIT_SCHEMES, 'initialisation scheme')
  positive(f'{p}.init_std', m.init_std)
  if m.init != 'fixed' and m.init_std != DEFAULT_INIT_STD:  # set, and silently unused
    raise ConfigError(
      f'{p}.init_std',
      m.init_std,
      f"read only by {p}.init='fixed' (it is {m.init!r}); set "
      f"{p}.init='fixed' to use it, else leave it at {DEFAULT_INIT_STD}",
    )
  positive(f'{p}.embed_scale', m.embed_scale)
  positive(f'{p}.final_logit_softcap', m.final_logit_softcap, optional=True)
  one_of(f'{p}.dtype', m.dtype, DTYPES, 'compute dtype')
  one_of(f'{p}.param_dtype', m.param_dtype, DTYPES, 'parameter dtype')
  one_of(f'{p}.remat', m.remat, REMAT_POLICIES, 'remat policy')
  integer(f'{p}.scan_unroll', m.scan_unroll)
  if m.scan_unroll > m.n_layers:
    raise ConfigError(f'{p}.scan_unroll', m.scan_unroll, f'allowed: 1 to {p}.n_layers={m.n_layers}')
  if m.scan_unroll != 1 and not m.scan_layers:
    raise ConfigError(
      f'{p}.scan_unroll',
      m.scan_unroll,
      f'unrolls scanned layers; set {p}.scan_layers=True to use it, else leave it at 1',
    )
  rate(f'{p}.dropout', m.dropout)
  rate(f'{p}.embed_dropout', m.embed_dropout)


def validate_model(m: config_dict.ConfigDict, prefix: str = 'model') -> None:
  """Check the `model` part of a config; raise ConfigError on the first problem."""
  p = prefix
  if not isinstance(m, config_dict.ConfigDict):
    raise ConfigError(p, m, 'must be a config section (a ConfigDict)')
  check_finite(m, f'{p}.')
  _check_model_scalars(m, p)
  if m.n_kv_heads > m.n_heads or m.n_heads % m.n_kv_heads:
    raise ConfigError(
      f'{p}.n_kv_heads',
      m.n_kv_heads,
      f'must divide {p}.n_heads={m.n_heads}; allowed: {_divisors(m.n_heads)}',
    )
  if m.head_dim is None and m.d_model % m.n_heads:
    raise ConfigError(
      f'{p}.n_heads',
      m.n_heads,
      f'must divide {p}.d_model={m.d_model} when {p}.head_dim is unset; allowed: '
      f'{_divisors(m.d_model)}, or set {p}.head_dim',
    )

  a = m.attention
  check_variant_keys(a, f'{p}.attention', ATTENTIONS, 'attention kind')
  one_of(f'{p}.attention.impl', a.impl, ATTENTION_IMPLS, 'attention implementation')
  integer(f'{p}.attention.sliding_window', a.sliding_window, optional=True)
  if a.global_every is not None:
    if (
      isinstance(a.global_every, bool) or not isinstance(a.global_every, int) or a.global_every < 2
    ):
      raise ConfigError(
        f'{p}.attention.global_every', a.global_every, 'allowed: an integer >= 2, or None'
      )
    if a.sliding_window is None:
      raise ConfigError(
        f'{p}.attention.global_every',
        a.global_every,
        f'without {p}.attention.sliding_window every layer attends globally; allowed: None, or '
        'a window for the other layers',
      )
  positive(f'{p}.attention.softmax_scale', a.softmax_scale, optional=True)
  positive(f'{p}.attention.logit_softcap', a.logit_softcap, optional=True)
  if a.output_gate is not None:
    one_of(f'{p}.attention.output_gate', a.output_gate, OUTPUT_GATES, 'output gate (or None)')
  one_of(f'{p}.attention.qk_norm_over', a.qk_norm_over, QK_NORM_OVER, 'QK-norm extent')
  if a.qk_norm_over != 'head' and not a.qk_norm:
    raise ConfigError(
      f'{p}.attention.qk_norm_over',
      a.qk_norm_over,
      f"read only with {p}.attention.qk_norm=True; allowed: 'head', or set qk_norm",
    )
  rate(f'{p}.attention.dropout', a.dropout)

  pos = m.position
  one_of(f'{p}.position.kind', pos.kind, POSITIONS, 'position scheme')
  _check_attention_impl(m, p)
  check_position_config(m, p)
  ATTENTIONS[a.kind].check(m, p)
  _check_layer_pattern(m, p)

  check_ffn_config(m, p)

  check_norm_config(m, p)
  check_parametrization(m, p)


def _check_attention_impl(m: config_dict.ConfigDict, p: str) -> None:
  """Refuse what the attention implementation cannot run, naming the reason; each
  implementation's record (mllm/ops/attention.py) says what it takes."""
  a = m.attention
  impl = ATTENTION_IMPLS[a.impl]
  for key in ('block_q', 'block_k'):
    value = a[key]
    if value is None:
      continue
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ConfigError(
        f'{p}.attention.{key}', value, 'a tile size must be a positive integer or None'
      )
    why = impl.refuses_tile(key, value)
    if why:
      raise ConfigError(f'{p}.attention.{key}', value, why)
  # The config's terms each implementation may lack (its record, AttentionImpl.lacks), and how
  # the refusal names the setting that asks for it.
  asks = {
    'learned_bias': f'{p}.position.kind={m.position.kind!r} is a learned relative bias, whose '
    'gradient only autodiff gives',
    'dropout': f'the {a.impl} kernel has no attention dropout ({p}.attention.dropout={a.dropout})',
    'alibi': f"{a.impl} adds no bias to the scores, so no ALiBi ({p}.position.kind='alibi')",
    'float32': f'{impl.half_precision} runs in bfloat16/float16 but {p}.dtype={m.dtype!r}',
    'softcap': f'{a.impl} has no attention-logit soft cap ({p}.attention.logit_softcap='
    f'{a.logit_softcap})',
    'sinks': f'{a.impl} has no attention sinks ({p}.attention.sinks=True)',
  }
  term = impl.lacks(
    learned_bias=POSITIONS[m.position.kind].learned_bias,
    dropout=a.dropout > 0,
    alibi=m.position.kind == 'alibi',
    float32=m.dtype != 'bfloat16',
    softcap=a.logit_softcap is not None,
    sinks=a.sinks,
  )
  if term:
    allowed = ', '.join(repr(name) for name in impls_with(term))
    fix = f"set {p}.dtype='bfloat16' or use " if term == 'float32' else 'allowed with it: '
    raise ConfigError(f'{p}.attention.impl', a.impl, f'{asks[term]}; {fix}{allowed}')


def check_backend(
  m: config_dict.ConfigDict,
  backend: str | None = None,
  p: str = 'model',
  *,
  data: config_dict.ConfigDict | None = None,
  gpu=None,
) -> None:
  """What only the machine can tell: is the attention implementation available on it? `data`
  (the config's data section, when known) gives the training sequence length; `gpu`
  (mllm.ops.cudnn_rules.GpuFacts) the GPU's compute capability and cuDNN version, by default the
  runtime's."""
  import jax  # deferred: validation itself never touches a backend

  backend = backend or jax.default_backend()
  if moe_layers(m) and m.ffn.moe.grouped_matmul == 'megablox' and backend == 'gpu':
    raise ConfigError(
      f'{p}.ffn.moe.grouped_matmul',
      'megablox',
      "megablox's gmm is a TPU kernel (off "
      "TPU it only interprets, for tests); allowed on gpu: 'ragged_dot'",
    )
  why = ATTENTION_IMPLS[m.attention.impl].refuses_backend(backend)
  if why:
    raise ConfigError(f'{p}.attention.impl', m.attention.impl, why)
  if m.attention.impl == 'cudnn' and backend == 'gpu':
    _check_cudnn_runs(m, p, data, gpu)


def _check_cudnn_runs(m, p: str, data, gpu) -> None:
  """impl='cudnn' on a GPU: refuse, at config time, a training call that JAX would refuse to hand
  to cuDNN (mllm/ops/cudnn_rules.py), with the facts the config gives: the head dim, the dtype,
  data.seq_len (queries and keys alike in training), the causal sliding window."""
  from mllm.layers import resolved_head_dim
  from mllm.ops.cudnn_rules import cudnn_refusal, runtime_gpu_facts

  gpu = runtime_gpu_facts() if gpu is None else gpu
  seq_len = None if data is None else data.seq_len
  why = cudnn_refusal(
    dtype=m.dtype,
    q_len=seq_len,
    kv_len=seq_len,
    head_dim=resolved_head_dim(m),
    causal=True,
    window=m.attention.sliding_window,
    training=True,
    gpu=gpu,
  )
  if why:
    kernels = "'pallas_mgpu' (Hopper, bfloat16), 'pallas'" if gpu.hopper else "'pallas'"
    raise ConfigError(
      f'{p}.attention.impl',
      'cudnn',
      f"{why}; allowed here: 'auto' (picks a kernel that runs it), {kernels}, 'blockwise', 'xla'",
    )


def validate_data(config: config_dict.ConfigDict) -> None:
  d = config.data
  one_of('data.source', d.source, DATA_SOURCES, 'data source')
  if d.source not in ('stdlib', 'kjv') and not d.path:  # the built-in corpora find their files
    raise ConfigError(
      'data.path',
      d.path,
      f"data.source={d.source!r} reads data.path; allowed: "
      + ('a dataset name or a save_to_disk folder' if d.source == 'hf' else 'a file or a folder'),
    )
  if not isinstance(d.text_field, str) or not d.text_field:
    raise ConfigError('data.text_field', d.text_field, 'must name the text column')
  number('data.val_fraction', d.val_fraction, 0.0, 0.5, 'the share of documents held out')
  one_of('data.tokenizer', d.tokenizer, TOKENIZERS, 'tokenizer')
  integer('data.tokenizer_train_bytes', d.tokenizer_train_bytes)
  for key in ('eos_token', 'pad_token'):
    if not isinstance(d[key], str) or not d[key]:
      raise ConfigError(f'data.{key}', d[key], 'must name a special token of the BPE tokenizer')
  # Whether the tokenizer fits model.vocab_size is checked when the data is built.
  if not isinstance(d.document_mask, bool):
    raise ConfigError('data.document_mask', d.document_mask, 'must be true or false')
  integer('data.seq_len', d.seq_len)
  integer('data.batch_size', d.batch_size)
  for key in ('path', 'cache_dir', 'hf_config'):
    if d[key] is not None and (not isinstance(d[key], str) or not d[key].strip()):
      raise ConfigError(f'data.{key}', d[key], 'must be a non-empty string, or None')
  if config.model.position.kind == 'learned' and d.seq_len > config.model.max_seq_len:
    raise ConfigError(
      'data.seq_len',
      d.seq_len,
      f'learned positions cover model.max_seq_len={config.model.max_seq_len} '
      'tokens; allowed: <= that, or raise model.max_seq_len',
    )


def validate_train(config: config_dict.ConfigDict) -> None:
  t = config.train
  integer('train.steps', t.steps)
  positive('train.learning_rate', t.learning_rate)
  one_of('train.schedule', t.schedule, SCHEDULES, 'learning-rate schedule')
  integer('train.warmup_steps', t.warmup_steps, 0)
  if t.schedule in ('cosine', 'linear') and t.warmup_steps >= t.steps:
    raise ConfigError(
      'train.warmup_steps',
      t.warmup_steps,
      f'must be < train.steps={t.steps} for a {t.schedule} decay',
    )
  number('train.min_lr_ratio', t.min_lr_ratio, 0.0, 1.0, 'a fraction of the peak rate')
  number('train.b1', t.b1, 0.0, 0.999999, 'an Adam moment decay')
  number('train.b2', t.b2, 0.0, 0.999999, 'an Adam moment decay')
  positive('train.eps', t.eps)
  number('train.weight_decay', t.weight_decay, 0.0, 10.0, 'the decoupled weight decay')
  number('train.grad_clip', t.grad_clip, 0.0, 1e30, 'a global norm (0: off)')
  number('train.z_loss_coef', t.z_loss_coef, 0.0, 1.0, "the output z-loss's weight (0: off)")
  for key in ('mtp_coef', 'mtp_coef_final'):
    number(f'train.{key}', t[key], 0.0, 10.0, "the multi-token-prediction loss's weight")
  number('train.mtp_switch_at', t.mtp_switch_at, 0.0, 1.0, 'a fraction of train.steps')
  check_variant_keys(t.optimizer, 'train.optimizer', OPTIMIZERS, 'optimizer')
  for key in ('decay_embeddings', 'decay_norms_and_biases', 'async_checkpoint', 'tensorboard'):
    if not isinstance(t[key], bool):
      raise ConfigError(f'train.{key}', t[key], 'must be true or false')
  integer('train.grad_accum_steps', t.grad_accum_steps)
  if config.data.batch_size % t.grad_accum_steps:
    raise ConfigError(
      'train.grad_accum_steps',
      t.grad_accum_steps,
      f'must divide data.batch_size={config.data.batch_size}; allowed: '
      + _divisors(config.data.batch_size),
    )
  integer('train.log_every', t.log_every)
  integer('train.eval_every', t.eval_every, 0)
  integer('train.eval_batches', t.eval_batches, 0)
  integer('train.checkpoint_every', t.checkpoint_every)
  integer('train.max_to_keep', t.max_to_keep)
  positive('train.peak_flops', t.peak_flops, optional=True)
  init_source(t.init_from)


def init_source(init_from) -> tuple[str | None, str | None]:
  """train.init_from → (kind, path): (None, None), ('workdir', PATH) or ('hf', PATH)."""
  if init_from is None:
    return None, None
  kind, sep, path = init_from.partition(':') if isinstance(init_from, str) else ('', '', '')
  if kind not in INIT_SOURCES or not sep or not path.strip():
    raise ConfigError(
      'train.init_from',
      init_from,
      'start a fresh run from the parameters of '
      "another run; allowed: None, 'workdir:PATH' (a training workdir, or "
      "one of its checkpoints/<step> folders), or 'hf:PATH' (a Hugging Face "
      'checkpoint folder)',
    )
  return kind, path


def validate_mesh(config: config_dict.ConfigDict) -> None:
  if sorted(config.mesh.keys()) != sorted(MESH_AXES):
    raise ConfigError('mesh', dict(config.mesh), 'needs exactly the axes ' + ', '.join(MESH_AXES))
  sizes = [config.mesh[a] for a in MESH_AXES]
  for axis, size in zip(MESH_AXES, sizes):
    if isinstance(size, bool) or not isinstance(size, int) or not (size >= 1 or size == -1):
      raise ConfigError(
        f'mesh.{axis}',
        size,
        'a mesh axis size is a positive integer, or -1 for all devices left over',
      )
  if sizes.count(-1) > 1:
    raise ConfigError('mesh', dict(config.mesh), 'at most one axis may be -1')
  if config.mesh.expert not in (1, -1):
    check_expert_axis(config.model, config.mesh.expert)


def check_on_mesh(config: config_dict.ConfigDict, mesh) -> None:
  """What a validated run config can be refused for only on the machine: the attention
  implementation on this backend (`check_backend`), the expert axis's resolved size."""
  if 'expert' in mesh.shape:
    check_expert_axis(config.model, mesh.shape['expert'])  # a -1 axis is known only now
  check_backend(config.model, data=config.data)


def check_expert_axis(m: config_dict.ConfigDict, size: int) -> None:
  """The expert mesh axis (its resolved size) shards the experts, so it must divide them."""
  if size == 1:
    return
  if not moe_layers(m):
    raise ConfigError(
      'mesh.expert',
      size,
      f"shards the experts of an MoE model, but "
      f"model.ffn.kind={m.ffn.kind!r}; allowed: 1, or model.ffn.kind='moe'",
    )
  experts = m.ffn.moe.num_experts
  if experts % size:
    raise ConfigError(
      'mesh.expert',
      size,
      f'must divide model.ffn.moe.num_experts={experts}; allowed: {_divisors(experts)}',
    )


def validate(config: config_dict.ConfigDict) -> None:
  """Check a full config (model and the run settings); raise ConfigError on the first problem.

  What needs the machine (device counts, files on disk) is checked when the run starts.
  """
  check_finite(config)
  if (
    isinstance(config.seed, bool)
    or not isinstance(config.seed, int)
    or not (0 <= config.seed < 2**31)
  ):
    raise ConfigError('seed', config.seed, 'must be an integer in [0, 2**31)')
  validate_model(config.model)
  validate_data(config)
  validate_train(config)
  validate_mesh(config)
