"""Hugging Face checkpoints ↔ mllm: `from_hf(path) -> (config, model)`, `to_hf(config, model, path)`.

A folder as transformers' `save_pretrained` writes it: config.json and model.safetensors (or
shards with model.safetensors.index.json), and the tokenizer's files. Families: Llama, Mistral,
Qwen2, Qwen3, GPT-2, Mixtral, Qwen3-MoE. The config mapping is `hf_config.py` (import) and
`hf_config_export.py` (a variant's own fields are mapped by its class in mllm/layers/), the weight
mapping `hf_weights.py`; all are exact (no approximation) and strict both ways: a setting one side
cannot represent is a one-line error naming it, and so is a checkpoint with weights missing or left
over.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import config_dict

from mllm.config import load_config
from mllm.config_schema import set_key
from mllm.interop import hf_quantized, hf_weights
from mllm.interop.hf_config import (
  ARCHITECTURES,
  FAMILIES,
  HFExportError,
  HFImportError,
  config_overrides,
  family_of,
)
from mllm.interop.hf_config_export import check_exact, family_for, hf_config
from mllm.model import CHECKPOINTED, build_model, rng_stand_ins

__all__ = [
  'ARCHITECTURES',
  'FAMILIES',
  'HFExportError',
  'HFImportError',
  'from_hf',
  'hf_params',
  'read_hf_config',
  'run_config',
  'to_hf',
  'tokenizer_settings',
]

# Buffers some transformers versions save beside the weights: not parameters.
_BUFFERS = ('.attn.bias', '.attn.masked_bias', 'rotary_emb.inv_freq')


# --- Reading a folder ---------------------------------------------------------------------------


def read_hf_config(path: str) -> dict:
  file = os.path.join(path, 'config.json')
  if not os.path.isfile(file):
    raise HFImportError(
      f'{path}: no config.json; allowed: a folder written by transformers\' '
      'save_pretrained (config.json + *.safetensors)'
    )
  with open(file, encoding='utf-8') as f:
    return json.load(f)


class Checkpoint:
  """The tensors of model.safetensors or of the shards its index names, read one at a time
  (a tensor is on the host only while it is being placed)."""

  def __init__(self, path: str, quantization: dict | None = None):
    """`quantization` (the checkpoint's quantization_config, hf_quantized.check_quantization):
    each quantized tensor (MXFP4's _blocks and _scales, FP8's weight and its _scale_inv) is
    presented as the float tensor it holds, dequantized as it is read."""
    from safetensors import safe_open  # deferred: only interop needs it

    single = os.path.join(path, 'model.safetensors')
    index = single + '.index.json'
    if os.path.isfile(index):
      with open(index, encoding='utf-8') as f:
        files = sorted(set(json.load(f)['weight_map'].values()))
    elif os.path.isfile(single):
      files = ['model.safetensors']
    else:
      raise HFImportError(
        f'{path}: no model.safetensors or model.safetensors.index.json '
        '(PyTorch .bin checkpoints are not read: re-save with '
        'safe_serialization)'
      )
    self.where = {}  # tensor name → its file
    for file in files:
      with safe_open(os.path.join(path, file), framework='np') as h:
        self.where.update(dict.fromkeys(h.keys(), os.path.join(path, file)))
    self.quantization = quantization
    self.packed = hf_quantized.packed_names(self.where, quantization)
    stored = {name for pair in self.packed.values() for name in pair}
    self.names = sorted((set(self.where) - stored) | set(self.packed))

  def __call__(self, name: str) -> np.ndarray:
    if name in self.packed:
      stored = (self._read(n) for n in self.packed[name])
      return hf_quantized.dequantize(self.quantization, *stored)
    return self._read(name)

  def _read(self, name: str) -> np.ndarray:
    if name not in self.where:
      raise HFImportError(f'the checkpoint has no weight {name!r}')
    from safetensors import safe_open

    # Opened per tensor: the file's memory map is released as soon as the tensor is copied out.
    with safe_open(self.where[name], framework='np') as h:
      if h.get_slice(name).get_dtype() == 'F8_E4M3':  # NumPy has no float8: safetensors' reader
        return _float8_tensor(self.where[name], name)  # refuses it
      return h.get_tensor(name)


def _float8_tensor(file: str, name: str) -> np.ndarray:
  """A float8 E4M3 tensor of a safetensors file (an 8-byte header length, the JSON header with
  each tensor's shape and byte range, the data) as jnp.float8_e4m3fn, read from its bytes."""
  with open(file, 'rb') as f:
    header_len = int.from_bytes(f.read(8), 'little')
    info = json.loads(f.read(header_len))[name]
    begin, end = info['data_offsets']
    f.seek(8 + header_len + begin)
    data = f.read(end - begin)
  return np.frombuffer(data, jnp.float8_e4m3fn).reshape(info['shape'])


def tokenizer_settings(path: str) -> dict[str, Any]:
  """data.* keys for the folder's tokenizer.json: its EOS (and pad) token, from
  tokenizer_config.json or config.json's ids. {} if the folder has no tokenizer.json."""
  if not os.path.isfile(os.path.join(path, 'tokenizer.json')):
    return {}
  names = {}
  config_file = os.path.join(path, 'tokenizer_config.json')
  if os.path.isfile(config_file):
    with open(config_file, encoding='utf-8') as f:
      tok_config = json.load(f)
    for key in ('eos_token', 'pad_token'):
      value = tok_config.get(key)
      names[key] = value.get('content') if isinstance(value, dict) else value
  hf = read_hf_config(path)
  for key in ('eos_token', 'pad_token'):
    token_id = hf.get(f'{key}_id')
    if isinstance(token_id, list):
      token_id = token_id[0]
    if not names.get(key) and token_id is not None:
      from tokenizers import Tokenizer  # deferred: read only to name an id

      names[key] = Tokenizer.from_file(os.path.join(path, 'tokenizer.json')).id_to_token(
        int(token_id)
      )
  if not names.get('eos_token'):
    raise HFImportError(
      f'{path}: its tokenizer names no EOS token (tokenizer_config.json '
      'eos_token or config.json eos_token_id); allowed: a tokenizer with one'
    )
  return {
    'data.tokenizer': 'bpe',
    'data.eos_token': names['eos_token'],
    'data.pad_token': names.get('pad_token') or names['eos_token'],
  }


# --- Import -------------------------------------------------------------------------------------


def hf_params(path: str, config, abstract_params: nnx.State) -> nnx.State:
  """The checkpoint's weights as `abstract_params` (nnx.Param state, ShapeDtypeStructs) describes
  them: mapped, checked, cast to each parameter's dtype and, where the abstract carries a sharding,
  placed straight onto it (each device gets its slice; the host holds one tensor at a time)."""
  hf = read_hf_config(path)
  family = family_of(hf)
  c = config.model
  take = Checkpoint(path, hf_quantized.check_quantization(hf))
  abstract = hf_weights.flat(nnx.to_pure_dict(abstract_params))
  shapes = {name: tuple(like.shape) for name, like in abstract.items()}
  if c.scan_layers:  # the links name one layer's parameters; scan stacks them [L, ...]
    shapes = {
      hf_weights.layer_path(name, i): shape if i is None else shape[1:]
      for name, shape in shapes.items()
      for i in (range(c.n_layers) if name.startswith('blocks/') else [None])
    }
  links = hf_weights.links_for(c, family, take.names)
  _check_names(c, links, shapes, take)
  # Each parameter is placed as soon as it is read (a scanned one once its last layer is), so
  # the host holds about one tensor besides the placed parameters.
  placed, layers = {}, {}
  for link in links:
    for name, value in zip(link.mllm, link.to_mllm(*[take(n) for n in link.hf])):
      if tuple(value.shape) != shapes[name]:
        raise HFImportError(
          f'{name}: the checkpoint gives shape {tuple(value.shape)}, the '
          f'config needs {shapes[name]}'
        )
      if c.scan_layers and name.startswith('blocks/'):
        _, i, rest = name.split('/', 2)
        stack = layers.setdefault(rest, [None] * c.n_layers)
        stack[int(i)] = value
        if all(v is not None for v in stack):
          placed[f'blocks/{rest}'] = _place(np.stack(layers.pop(rest)), abstract[f'blocks/{rest}'])
      else:
        placed[name] = _place(value, abstract[name])
  state = jax.tree.map(lambda x: x, abstract_params)
  nnx.replace_by_pure_dict(state, hf_weights.nested(placed))
  return state


def _check_names(c, links: list, shapes: dict, take: Checkpoint) -> None:
  """Every parameter the config builds is mapped, every tensor the mapping needs is in the
  checkpoint and every tensor in it is used: checked before a byte is read, so a wrong
  checkpoint fails at once, not after gigabytes."""
  given = {name for link in links for name in link.mllm}
  missing, extra = sorted(set(shapes) - given), sorted(given - set(shapes))
  if missing or extra:  # an override that changes the parameters (norm biases, ...)
    problems = (
      [f'the config builds parameters the checkpoint lacks: {", ".join(missing[:4])}']
      if missing
      else []
    ) + (
      [f'the checkpoint maps to parameters the config does not build: {", ".join(extra[:4])}']
      if extra
      else []
    )
    raise HFImportError('; '.join(problems) + '; allowed: overrides that keep the parameters')
  needed = [n for link in links for n in link.hf]
  stored = set(take.names)
  absent = [n for n in needed if n not in stored]
  if absent:
    raise HFImportError(
      f'the checkpoint has no weight {absent[0]!r}'
      + (f' (+{len(absent) - 1} more)' if len(absent) > 1 else '')
    )
  leftover = sorted(set(take.names) - set(needed))
  leftover = [n for n in leftover if not n.endswith(_BUFFERS)]
  if c.tie_embeddings and 'lm_head.weight' in leftover:
    # Some tied checkpoints store the head too: harmless if it is the embedding, else not tied.
    embedding = next(
      n for link in links for n in link.hf if n.endswith(('embed_tokens.weight', 'wte.weight'))
    )
    if not np.array_equal(take('lm_head.weight'), take(embedding)):
      raise HFImportError(
        'tie_word_embeddings is true but lm_head.weight differs from '
        f'{embedding}; allowed: a checkpoint whose head is its embedding'
      )
    leftover.remove('lm_head.weight')
  if leftover:
    raise HFImportError(
      f'weights mllm does not use: {", ".join(leftover[:8])}'
      + (f' (+{len(leftover) - 8} more)' if len(leftover) > 8 else '')
    )


def _place(value: np.ndarray, like) -> jax.Array:
  """Cast to the parameter's dtype (a bfloat16 checkpoint gives float32 parameters holding its
  exact values: the compute dtype is the config's business, not the file's) and place it."""
  value = np.asarray(value).astype(like.dtype)
  sharding = getattr(like, 'sharding', None)
  if sharding is None:
    return jnp.asarray(value)
  return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def from_hf(path: str, overrides: dict[str, Any] | None = None):
  """(config, model) of the HF checkpoint in folder `path`, in float32. `overrides` (dotted mllm
  keys) apply on top, for toggles that keep the weights' shapes (e.g. an attention impl)."""
  keys = config_overrides(read_hf_config(path))
  keys.update(overrides or {})
  config = load_config(base_config_path(), keys)
  abstract = nnx.eval_shape(lambda: build_model(config.model, rngs=nnx.Rngs(0)))
  graphdef, params, _ = nnx.split(abstract, CHECKPOINTED, ...)
  return config, nnx.merge(graphdef, hf_params(path, config, params), rng_stand_ins(abstract))


# Keys of config_overrides that set how the imported model runs, not what it is: a run's own
# config keeps its values for these.
_RUN_KEYS = (
  'model.dtype',
  'model.param_dtype',
  'model.dropout',
  'model.embed_dropout',
  'model.attention.dropout',
  'data.seq_len',
)


def run_config(config, path: str, explicit: dict[str, Any] | None = None):
  """`config` with the model (and tokenizer settings) of the HF folder `path`, for a run that
  starts from its weights: its other sections stay, data.seq_len is capped at the model's context,
  and `explicit` (dotted keys the user set, e.g. on the command line) is applied last. Not yet
  validated: the caller's load_config does that once."""
  keys = {k: v for k, v in config_overrides(read_hf_config(path)).items() if k not in _RUN_KEYS}
  keys.update(tokenizer_settings(path))
  out = config_dict.ConfigDict(config.to_dict())
  with out.ignore_type():
    # The folder's keys, then the user's, each after all of the folder's (a user's pos=alibi
    # then drops the folder's RoPE θ, as a choice does).
    for key, value in [*keys.items(), *(explicit or {}).items()]:
      set_key(out, key, value)
    if out.data.seq_len > out.model.max_seq_len and 'data.seq_len' not in (explicit or {}):
      out.data.seq_len = out.model.max_seq_len
  return out


def base_config_path() -> str:
  """The config file of the schema's defaults (what configs/base.py re-exports)."""
  return os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'config_schema.py'
  )


# --- Export -------------------------------------------------------------------------------------


def to_hf(
  config,
  model: nnx.Module,
  path: str,
  *,
  tokenizer=None,
  dtype: str | None = None,
  max_shard_bytes: int = 5 * 2**30,
) -> str:
  """Write `model` (of mllm `config`) as a transformers checkpoint folder; returns its family.

  dtype: of the written tensors (None: the parameters' own). tokenizer: an mllm BPE tokenizer,
  written as tokenizer.json + tokenizer_config.json. Refuses, in one line naming the mllm key,
  a model no transformers class computes exactly.
  """
  c = config.model
  family = family_for(c)
  params = hf_weights.flat(nnx.to_pure_dict(nnx.state(model, CHECKPOINTED)))
  dtype = dtype or str(next(iter(params.values())).dtype)
  hf = hf_config(c, family, dtype)
  back = load_config(base_config_path(), config_overrides(hf)).model
  check_exact(c, family, back)
  if c.scan_layers:
    params = hf_weights.unstack_layers(params, c.n_layers)
  tensors = {}
  for link in hf_weights.links_for(c, family):
    outs = link.to_hf(*[np.asarray(params.pop(name)) for name in link.mllm])
    tensors.update({name: np.ascontiguousarray(t.astype(dtype)) for name, t in zip(link.hf, outs)})
  if params:  # the links must account for every parameter; a gap is a bug, not a user error
    raise AssertionError(f'parameters the {family} mapping does not write: {sorted(params)[:4]}')
  os.makedirs(path, exist_ok=True)
  if tokenizer is not None:
    hf.update(_write_tokenizer(tokenizer, path, c.max_seq_len))
  with open(os.path.join(path, 'config.json'), 'w', encoding='utf-8') as f:
    json.dump(hf, f, indent=2, sort_keys=True)
  _write_weights(tensors, path, max_shard_bytes)
  return family


def _write_weights(tensors: dict[str, np.ndarray], path: str, max_shard_bytes: int) -> None:
  from safetensors.numpy import save_file

  meta = {'format': 'pt'}  # transformers refuses safetensors files without it
  shards, size = [{}], 0
  for name in sorted(tensors):
    if shards[-1] and size + tensors[name].nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = tensors[name]
    size += tensors[name].nbytes
  for stale in os.listdir(path):
    if stale.startswith('model') and stale.endswith(('.safetensors', '.index.json')):
      os.remove(os.path.join(path, stale))
  if len(shards) == 1:
    save_file(tensors, os.path.join(path, 'model.safetensors'), metadata=meta)
    return
  weight_map = {}
  for i, shard in enumerate(shards):
    file = f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors'
    save_file(shard, os.path.join(path, file), metadata=meta)
    weight_map.update(dict.fromkeys(shard, file))
  index = {
    'metadata': {'total_size': sum(t.nbytes for t in tensors.values())},
    'weight_map': weight_map,
  }
  with open(os.path.join(path, 'model.safetensors.index.json'), 'w', encoding='utf-8') as f:
    json.dump(index, f, indent=2)


def _write_tokenizer(tokenizer, path: str, max_len: int) -> dict[str, Any]:
  """tokenizer.json and tokenizer_config.json (AutoTokenizer reads them as a fast tokenizer);
  returns the config.json fields naming the special tokens' ids."""
  tokenizer.save(os.path.join(path, 'tokenizer.json'))
  eos = tokenizer.tok.id_to_token(tokenizer.eos_id)
  pad = tokenizer.tok.id_to_token(tokenizer.pad_id)
  with open(os.path.join(path, 'tokenizer_config.json'), 'w', encoding='utf-8') as f:
    json.dump(
      {
        'tokenizer_class': 'PreTrainedTokenizerFast',
        'eos_token': eos,
        'pad_token': pad,
        'model_max_length': max_len,
        'clean_up_tokenization_spaces': False,
      },
      f,
      indent=2,
    )
  return {'eos_token_id': tokenizer.eos_id, 'pad_token_id': tokenizer.pad_id, 'bos_token_id': None}
