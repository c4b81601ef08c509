"""Hugging Face checkpoints → mllm: `from_hf(path) -> (config, model)`.

A folder as transformers' `save_pretrained` writes it: config.json and model.safetensors (or
shards with model.safetensors.index.json). Each family is a config mapping and a weight mapping:
  - Llama, Mistral, Qwen2, Qwen3: RoPE in the 'half' layout (HF's rotate_half, so no permutation
    of q/k rows), RMSNorm pre-LN, SwiGLU; Mistral's sliding window, Qwen2's q/k/v biases,
    Qwen3's QK-norm and explicit head_dim.
  - GPT-2: learned positions, LayerNorm, tanh-GELU FFN, biases everywhere; its Conv1D weights are
    already [in, out].
PyTorch Linear weights are [out, in]; mllm's Einsum kernels are [in, ..., out] with heads split
out ([D, N, H] for q/k/v, [N, H, D] for the output projection).

Strict: a config field that changes the math and that mllm does not represent is a one-line
ValueError naming it; so is a checkpoint with weights missing or left over.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

FAMILIES = ('llama', 'mistral', 'qwen2', 'qwen3', 'gpt2')


class HFImportError(ValueError):
  """A checkpoint mllm cannot represent exactly, or a malformed one (one line)."""


# --- Reading a folder ---------------------------------------------------------------------------

def read_config(path: str) -> dict:
  file = os.path.join(path, 'config.json')
  if not os.path.isfile(file):
    raise HFImportError(f'{path}: no config.json; allowed: a folder written by transformers\' '
                        'save_pretrained (config.json + *.safetensors)')
  with open(file, encoding='utf-8') as f:
    return json.load(f)


def read_weights(path: str) -> dict[str, np.ndarray]:
  """Every tensor of model.safetensors, or of the shards its index names."""
  from safetensors.numpy import load_file  # noqa: PLC0415 (only import needs it)
  single = os.path.join(path, 'model.safetensors')
  index = single + '.index.json'
  if os.path.isfile(index):
    with open(index, encoding='utf-8') as f:
      shards = sorted(set(json.load(f)['weight_map'].values()))
    weights = {}
    for shard in shards:
      weights.update(load_file(os.path.join(path, shard)))
    return weights
  if os.path.isfile(single):
    return load_file(single)
  raise HFImportError(f'{path}: no model.safetensors or model.safetensors.index.json '
                      '(PyTorch .bin checkpoints are not read: re-save with safe_serialization)')


def load_array(x: np.ndarray) -> np.ndarray:
  """safetensors' NumPy loader gives bfloat16 as ml_dtypes arrays; anything else as is."""
  return np.asarray(x)


# --- Config mapping -----------------------------------------------------------------------------

def _rope(hf: dict) -> dict[str, Any]:
  """mllm position keys from HF's rope fields: `rope_parameters` (transformers ≥ 5) or
  `rope_theta` + `rope_scaling` (earlier)."""
  params = dict(hf.get('rope_parameters') or {})
  if not params:
    params = dict(hf.get('rope_scaling') or {})
    params.setdefault('rope_theta', hf.get('rope_theta', 10000.0))
  kind = params.get('rope_type', params.get('type', 'default'))
  out = {'position.kind': 'rope', 'position.rope_layout': 'half',
         'position.rope_theta': float(params['rope_theta'])}
  if kind == 'default':
    return out
  original = params.get('original_max_position_embeddings')
  if kind == 'linear':
    out.update({'position.rope_scaling': 'linear', 'position.rope_scaling_factor':
                float(params['factor'])})
  elif kind == 'llama3':
    out.update({'position.rope_scaling': 'llama3',
                'position.rope_scaling_factor': float(params['factor']),
                'position.llama3_low_freq_factor': float(params['low_freq_factor']),
                'position.llama3_high_freq_factor': float(params['high_freq_factor']),
                'position.rope_original_max_len': int(original)})
  else:
    raise HFImportError(f'rope_type={kind!r}: not mapped to mllm yet; allowed: default, '
                        'linear, llama3')
  return out


def _refuse(hf: dict, field: str, allowed: Callable[[Any], bool], what: str) -> None:
  if field in hf and not allowed(hf[field]):
    raise HFImportError(f'{field}={hf[field]!r}: mllm has no equivalent; allowed: {what}')


def _llama_like(hf: dict, family: str) -> dict[str, Any]:
  _refuse(hf, 'hidden_act', lambda v: v == 'silu', "'silu' (SwiGLU)")
  _refuse(hf, 'pretraining_tp', lambda v: v in (None, 1), '1')
  _refuse(hf, 'attention_dropout', lambda v: not v, '0.0')
  n_heads = hf['num_attention_heads']
  head_dim = hf.get('head_dim') or hf['hidden_size'] // n_heads
  out = {
      'model.vocab_size': hf['vocab_size'], 'model.d_model': hf['hidden_size'],
      'model.n_layers': hf['num_hidden_layers'], 'model.n_heads': n_heads,
      'model.n_kv_heads': hf.get('num_key_value_heads') or n_heads, 'model.head_dim': head_dim,
      'model.max_seq_len': hf['max_position_embeddings'],
      'model.tie_embeddings': bool(hf.get('tie_word_embeddings', False)),
      'model.embed_scale': 1.0,
      'model.norm.kind': 'rmsnorm', 'model.norm.placement': 'pre',
      'model.norm.eps': float(hf['rms_norm_eps']),
      'model.ffn.kind': 'swiglu', 'model.ffn.d_ff': hf['intermediate_size'],
      'model.ffn.match_params': False, 'model.ffn.use_bias': bool(hf.get('mlp_bias', False)),
      'model.attention.use_bias': bool(hf.get('attention_bias', False)),
      'model.attention.qkv_bias': family == 'qwen2',
      'model.attention.qk_norm': family == 'qwen3',
      'model.attention.sliding_window': _window(hf, family),
  }
  out.update({f'model.{k}': v for k, v in _rope(hf).items()})
  return out


def _window(hf: dict, family: str) -> int | None:
  window = hf.get('sliding_window')
  if family in ('qwen2', 'qwen3'):
    layer_types = hf.get('layer_types') or []
    sliding = hf.get('use_sliding_window', False) or 'sliding_attention' in layer_types
    if not sliding:
      return None
    if layer_types and set(layer_types) != {'sliding_attention'}:
      raise HFImportError('layer_types mixes full and sliding attention; allowed: one kind for '
                          'every layer (mllm has one window for all layers)')
  return None if window is None else int(window)


def _gpt2(hf: dict) -> dict[str, Any]:
  acts = {'gelu_new': 'gelu_tanh', 'gelu_pytorch_tanh': 'gelu_tanh', 'gelu': 'gelu'}
  _refuse(hf, 'activation_function', lambda v: v in acts, ', '.join(acts))
  _refuse(hf, 'scale_attn_by_inverse_layer_idx', lambda v: not v, 'false')
  _refuse(hf, 'scale_attn_weights', lambda v: v, 'true')
  d = hf['n_embd']
  return {
      'model.vocab_size': hf['vocab_size'], 'model.d_model': d, 'model.n_layers': hf['n_layer'],
      'model.n_heads': hf['n_head'], 'model.n_kv_heads': hf['n_head'],
      'model.head_dim': d // hf['n_head'], 'model.max_seq_len': hf['n_positions'],
      'model.tie_embeddings': bool(hf.get('tie_word_embeddings', True)), 'model.embed_scale': 1.0,
      'model.position.kind': 'learned',
      'model.norm.kind': 'layernorm', 'model.norm.placement': 'pre',
      'model.norm.eps': float(hf['layer_norm_epsilon']), 'model.norm.use_bias': True,
      'model.ffn.kind': acts[hf.get('activation_function', 'gelu_new')],
      'model.ffn.d_ff': hf.get('n_inner') or 4 * d, 'model.ffn.match_params': False,
      'model.ffn.use_bias': True, 'model.attention.use_bias': True,
  }


def family_of(hf: dict) -> str:
  model_type = hf.get('model_type')
  if model_type not in FAMILIES:
    raise HFImportError(f'model_type={model_type!r}: not imported yet; allowed: '
                        f'{", ".join(FAMILIES)}')
  return model_type


def config_overrides(hf: dict) -> dict[str, Any]:
  """mllm config keys (dotted) that make the model of this HF config, in float32."""
  family = family_of(hf)
  out = _gpt2(hf) if family == 'gpt2' else _llama_like(hf, family)
  out.update({'model.dtype': 'float32', 'model.param_dtype': 'float32', 'model.dropout': 0.0,
              'model.embed_dropout': 0.0, 'model.attention.dropout': 0.0,
              'data.seq_len': out['model.max_seq_len']})
  return out


# --- Weight mapping -----------------------------------------------------------------------------

def _linear(w: np.ndarray, *shape: int) -> np.ndarray:
  """A PyTorch Linear weight [out, in] as an mllm kernel [in, *shape]."""
  return w.T.reshape(w.shape[1], *shape)


def _llama_weights(hf: dict, c, take: Callable[[str], np.ndarray]) -> dict:
  n, k, h, d = c.n_heads, c.n_kv_heads, c.head_dim, c.d_model
  params: dict[str, Any] = {'embed': {'embedding': take('model.embed_tokens.weight')},
                            'final_norm': {'scale': take('model.norm.weight')}, 'blocks': {}}
  if not c.tie_embeddings:
    params['head'] = {'kernel': take('lm_head.weight').T}
  for i in range(c.n_layers):
    p = f'model.layers.{i}.'
    att = {'query': {'kernel': _linear(take(p + 'self_attn.q_proj.weight'), n, h)},
           'key': {'kernel': _linear(take(p + 'self_attn.k_proj.weight'), k, h)},
           'value': {'kernel': _linear(take(p + 'self_attn.v_proj.weight'), k, h)},
           'out': {'kernel': take(p + 'self_attn.o_proj.weight').T.reshape(n, h, d)}}
    if c.attention.use_bias or c.attention.qkv_bias:
      for name, heads in (('query', n), ('key', k), ('value', k)):
        att[name]['bias'] = take(p + f'self_attn.{name[0]}_proj.bias').reshape(heads, h)
    if c.attention.use_bias:
      att['out']['bias'] = take(p + 'self_attn.o_proj.bias')
    if c.attention.qk_norm:
      att['query_norm'] = {'scale': take(p + 'self_attn.q_norm.weight')}
      att['key_norm'] = {'scale': take(p + 'self_attn.k_norm.weight')}
    ffn = {name: {'kernel': take(p + f'mlp.{name}_proj.weight').T}
           for name in ('gate', 'up', 'down')}
    if c.ffn.use_bias:
      for name in ('gate', 'up', 'down'):
        ffn[name]['bias'] = take(p + f'mlp.{name}_proj.bias')
    params['blocks'][i] = {'attention': att, 'ffn': ffn,
                           'attention_norm': {'scale': take(p + 'input_layernorm.weight')},
                           'ffn_norm': {'scale': take(p + 'post_attention_layernorm.weight')}}
  return params


def _gpt2_weights(hf: dict, c, take: Callable[[str], np.ndarray]) -> dict:
  n, h, d = c.n_heads, c.head_dim, c.d_model
  prefix = 'transformer.' if any(k.startswith('transformer.') for k in take.names) else ''
  t = lambda name: take(prefix + name)  # noqa: E731
  norm = lambda name: {'scale': t(name + '.weight'), 'bias': t(name + '.bias')}  # noqa: E731
  params: dict[str, Any] = {'embed': {'embedding': t('wte.weight')},
                            'position': {'table': t('wpe.weight')},
                            'final_norm': norm('ln_f'), 'blocks': {}}
  if not c.tie_embeddings:
    params['head'] = {'kernel': take('lm_head.weight').T}
  for i in range(c.n_layers):
    p = f'h.{i}.'
    qkv_w, qkv_b = t(p + 'attn.c_attn.weight'), t(p + 'attn.c_attn.bias')  # Conv1D: [in, out]
    att = {name: {'kernel': w.reshape(d, n, h), 'bias': b.reshape(n, h)}
           for name, w, b in zip(('query', 'key', 'value'), np.split(qkv_w, 3, axis=1),
                                 np.split(qkv_b, 3))}
    att['out'] = {'kernel': t(p + 'attn.c_proj.weight').reshape(n, h, d),
                  'bias': t(p + 'attn.c_proj.bias')}
    ffn = {'up': {'kernel': t(p + 'mlp.c_fc.weight'), 'bias': t(p + 'mlp.c_fc.bias')},
           'down': {'kernel': t(p + 'mlp.c_proj.weight'), 'bias': t(p + 'mlp.c_proj.bias')}}
    params['blocks'][i] = {'attention': att, 'ffn': ffn, 'attention_norm': norm(p + 'ln_1'),
                           'ffn_norm': norm(p + 'ln_2')}
  return params


class _Taker:
  """Hands out checkpoint tensors by name and remembers which were used."""

  def __init__(self, weights: dict[str, np.ndarray]):
    self.weights, self.used = weights, set()
    self.names = list(weights)

  def __call__(self, name: str) -> np.ndarray:
    if name not in self.weights:
      raise HFImportError(f'the checkpoint has no weight {name!r}')
    self.used.add(name)
    return load_array(self.weights[name])

  def leftover(self) -> list[str]:
    # Buffers transformers saves for some models: not weights.
    ignorable = ('.attn.bias', '.attn.masked_bias', 'rotary_emb.inv_freq')
    return sorted(k for k in self.weights if k not in self.used
                  and not k.endswith(ignorable) and k != 'lm_head.weight')


# --- The public functions -----------------------------------------------------------------------

def from_hf(path: str, overrides: dict[str, Any] | None = None):
  """(config, model) of the HF checkpoint in folder `path`, in float32. `overrides` (dotted mllm
  keys) apply on top, for toggles that keep the weights' shapes (e.g. an attention impl)."""
  import mllm  # noqa: PLC0415
  from mllm.train.state import _placeholder_rest  # noqa: PLC0415
  hf = read_config(path)
  keys = config_overrides(hf)
  keys.update(overrides or {})
  config = mllm.load_config(_base_config_path(), keys)
  take = _Taker(read_weights(path))
  mapping = _gpt2_weights if family_of(hf) == 'gpt2' else _llama_weights
  pure = mapping(hf, config.model, take)
  if not config.model.tie_embeddings and 'lm_head.weight' not in take.used:
    raise HFImportError('tie_word_embeddings is false but the checkpoint has no lm_head.weight')
  leftover = take.leftover()
  if leftover:
    raise HFImportError(f'weights mllm does not use: {", ".join(leftover[:8])}'
                        + (f' (+{len(leftover) - 8} more)' if len(leftover) > 8 else ''))
  abstract = nnx.eval_shape(lambda: mllm.build_model(config.model, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  expected = nnx.to_pure_dict(params)
  _check_shapes(expected, pure)
  # Cast to the parameters' dtype: a bfloat16 checkpoint gives float32 parameters holding its
  # exact values (the compute dtype is the config's business, not the file's).
  nnx.replace_by_pure_dict(params, jax.tree.map(lambda x, like: jnp.asarray(x, like.dtype),
                                                pure, expected))
  return config, nnx.merge(graphdef, params, _placeholder_rest(abstract))


def _check_shapes(expected, got, where: str = '') -> None:
  """Every parameter mllm expects is given, with its shape; nothing more."""
  if isinstance(expected, dict):
    missing = sorted(set(map(str, expected)) - set(map(str, got)))
    extra = sorted(set(map(str, got)) - set(map(str, expected)))
    if missing or extra:
      raise HFImportError(f'parameters at {where or "the top"}: missing {missing}, extra {extra}')
    for key in expected:
      _check_shapes(expected[key], got[key], f'{where}/{key}')
  elif tuple(expected.shape) != tuple(got.shape):
    raise HFImportError(f'{where}: the checkpoint gives shape {tuple(got.shape)}, the config '
                        f'needs {tuple(expected.shape)}')


def _base_config_path() -> str:
  import configs  # noqa: PLC0415 (installed with mllm: pyproject's packages)
  return os.path.join(os.path.dirname(configs.__file__), 'base.py')
