"""mllm.interop.hf against transformers: tiny random checkpoints of each family with transformers'
own float32 eager logits and greedy continuations (tests/fixtures/make_hf_fixtures.py wrote
them; these tests need no torch).

Llama (plain, and with Llama 3 RoPE scaling), Mistral (a 64-token window under a 224-token
prompt), Qwen2 (q/k/v biases, tied), Qwen3 (QK-norm, head_dim ≠ d_model / heads) and GPT-2
(learned positions, LayerNorm, tanh GELU, Conv1D weights).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import zlib

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mllm.generation import generate_tokens
from mllm.interop import hf

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'fixtures', 'hf')
FAMILIES = [
  'llama',
  'llama3-scaled',
  'llama-yarn',
  'mistral',
  'qwen2',
  'qwen3',
  'gpt2',
  'mixtral',
  'qwen3-moe',
  'gemma2',
  'olmo2',
  'stablelm',
  'deepseek-v3',
  'deepseek-v3-dense',
  'gpt-oss',
]


def reference(family):
  return np.load(os.path.join(FIXTURES, family, 'reference.npz'))


@nnx.jit  # one compiled forward per model structure (op by op, each call compiled ~60 kernels)
def _forward(model, ids):
  return model(ids)


def logits_of(model, ids):
  out = _forward(model, jnp.asarray(ids))
  return np.asarray(out[0] if isinstance(out, tuple) else out)


@pytest.fixture(scope='module')
def imported():
  cache = {}

  def get(family, path=None):
    if path is not None:
      return hf.from_hf(path)
    if family not in cache:
      cache[family] = hf.from_hf(os.path.join(FIXTURES, family))
    return cache[family]

  return get


def assert_logits_match(model, name):
  """transformers' float32 logits for the fixture's long and short prompts: within 1e-4, same
  argmax. One forward of both (the short prompts right-padded to the long one's length: a causal
  model's logits at a position never see the tokens after it), so a model compiles one forward,
  not two."""
  ref = reference(name)
  long_ids, short_ids = ref['long_ids'], ref['short_ids']
  padded = np.zeros((short_ids.shape[0], long_ids.shape[1]), long_ids.dtype)
  padded[:, : short_ids.shape[1]] = short_ids
  both = logits_of(model, np.concatenate([long_ids, padded]))
  got = {'long': both[: len(long_ids)], 'short': both[len(long_ids) :, : short_ids.shape[1]]}
  for which in ('long', 'short'):
    want = ref[f'logits_{which}']
    np.testing.assert_allclose(got[which], want, atol=1e-4, rtol=0, err_msg=f'{name} {which}')
    assert (got[which].argmax(-1) == want.argmax(-1)).all()


def assert_greedy_matches(model, name):
  """transformers' greedy continuation of the short prompts, decoded with the KV cache."""
  ref = reference(name)
  prompts, want = ref['short_ids'], ref['greedy'][:, ref['short_ids'].shape[1] :]
  got = generate_tokens(model, [list(map(int, p)) for p in prompts], max_new_tokens=want.shape[1])
  assert np.array_equal(np.asarray(got), want)


@pytest.mark.parametrize('family', FAMILIES)
def test_logits_match_transformers(family, imported):
  assert_logits_match(imported(family)[1], family)


@pytest.mark.parametrize('family', FAMILIES)
def test_greedy_generation_with_the_kv_cache_matches_transformers(family, imported):
  assert_greedy_matches(imported(family)[1], family)


@pytest.mark.parametrize(
  'family,keys',
  [
    (
      'qwen3',
      {
        'model.attention.qk_norm': True,
        'model.head_dim': 32,
        'model.n_kv_heads': 2,
        'model.tie_embeddings': True,
      },
    ),
    ('qwen2', {'model.attention.qkv_bias': True, 'model.attention.use_bias': False}),
    ('mistral', {'model.attention.sliding_window': 64}),
    (
      'gemma2',
      {
        'model.norm.placement': 'sandwich',
        'model.norm.unit_offset': True,
        'model.ffn.kind': 'geglu_tanh',
        'model.embed_scale': 8.0,
        'model.attention.softmax_scale': 24**-0.5,
        'model.attention.logit_softcap': 2.0,
        'model.final_logit_softcap': 3.0,
        'model.attention.sliding_window': 32,
        'model.attention.global_every': 2,
        'model.n_layers': 4,
      },
    ),
    (
      'stablelm',
      {
        'model.position.rope.fraction': 0.25,
        'model.norm.kind': 'layernorm',
        'model.norm.use_bias': True,
        'model.attention.qkv_bias': True,
      },
    ),
    (
      'olmo2',
      {
        'model.norm.placement': 'output',
        'model.attention.qk_norm': True,
        'model.attention.qk_norm_over': 'projection',
        'model.tie_embeddings': False,
      },
    ),
    (
      'llama3-scaled',
      {
        'model.position.rope.scaling.kind': 'llama3',
        'model.position.rope.original_max_len': 64,
        'model.position.rope.scaling.llama3.factor': 8.0,
      },
    ),
    (
      'llama-yarn',
      {
        'model.position.rope.scaling.kind': 'yarn',
        'model.position.rope.scaling.yarn.factor': 4.0,
        'model.position.rope.original_max_len': 64,
        'model.position.rope.scaling.yarn.beta_fast': 32.0,
      },
    ),
    (
      'mixtral',
      {
        'model.ffn.kind': 'moe',
        'model.ffn.moe.num_experts': 4,
        'model.ffn.moe.top_k': 2,
        'model.ffn.moe.expert_d_ff': 96,
        'model.ffn.moe.renormalize': True,
        'model.ffn.moe.dispatch': 'dropless',
        'model.position.rope.theta': 1e6,
      },
    ),
    (
      'qwen3-moe',
      {
        'model.ffn.moe.num_experts': 4,
        'model.ffn.moe.expert_d_ff': 48,
        'model.attention.qk_norm': True,
        'model.ffn.moe.first_dense_layers': 0,
      },
    ),
    (
      'gpt2',
      {
        'model.position.kind': 'learned',
        'model.ffn.kind': 'gelu_tanh',
        'model.norm.kind': 'layernorm',
        'model.ffn.d_ff': 256,
      },
    ),
  ],
)
def test_config_fields_map(family, keys, imported):
  config, _ = imported(family)
  for key, value in keys.items():
    node = config
    for part in key.split('.'):
      node = node[part]
    assert node == value, key


def write_copy(tmp_path, family, edit_config=None, edit_weights=None, shards=1):
  """A copy of a fixture folder with its config.json and/or weights edited."""
  from safetensors.numpy import load_file, save_file

  folder = tmp_path / family
  shutil.copytree(os.path.join(FIXTURES, family), folder)
  with open(folder / 'config.json') as f:
    config = json.load(f)
  if edit_config:
    edit_config(config)
  with open(folder / 'config.json', 'w') as f:
    json.dump(config, f)
  weights = load_file(str(folder / 'model.safetensors'))
  if edit_weights:
    weights = edit_weights(weights)
  os.remove(folder / 'model.safetensors')
  if shards == 1:
    save_file(weights, str(folder / 'model.safetensors'), metadata={'format': 'pt'})
  else:
    names = sorted(weights)
    weight_map = {}
    for s in range(shards):
      file = f'model-{s + 1:05d}-of-{shards:05d}.safetensors'
      part = {n: weights[n] for n in names[s::shards]}
      save_file(part, str(folder / file), metadata={'format': 'pt'})
      weight_map.update({n: file for n in part})
    with open(folder / 'model.safetensors.index.json', 'w') as f:
      json.dump({'metadata': {}, 'weight_map': weight_map}, f)
  return str(folder)


def test_a_sharded_checkpoint_loads_the_same(tmp_path, imported):
  path = write_copy(tmp_path, 'qwen3', shards=3)
  assert not os.path.exists(os.path.join(path, 'model.safetensors'))
  _, model = imported(None, path)
  ref = reference('qwen3')
  np.testing.assert_allclose(logits_of(model, ref['short_ids']), ref['logits_short'], atol=1e-4)


def test_a_bfloat16_checkpoint_loads_its_values_exactly(tmp_path, imported):
  import ml_dtypes

  path = write_copy(
    tmp_path,
    'llama',
    edit_weights=lambda w: {k: v.astype(ml_dtypes.bfloat16) for k, v in w.items()},
  )
  _, model = imported(None, path)
  _, f32 = imported('llama')
  got = np.asarray(model.blocks[1].attention.query.kernel[...])
  want = np.asarray(f32.blocks[1].attention.query.kernel[...])
  assert got.dtype == np.float32 and not np.array_equal(got, want)
  np.testing.assert_array_equal(got, want.astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize(
  'params, missing',
  [
    (
      {
        'rope_type': 'llama3',
        'factor': 8.0,
        'low_freq_factor': 1.0,
        'original_max_position_embeddings': 8192,
      },
      'high_freq_factor',
    ),
    (
      {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0},
      'original_max_position_embeddings',
    ),
    ({'rope_type': 'linear'}, 'factor'),
  ],
)
def test_a_rope_scaling_missing_a_field_is_refused_naming_it(params, missing):
  """Each scaling reads its own fields (mllm/layers/rope.py `hf_names`); one that is missing is
  an HFImportError naming it (it was a KeyError or TypeError)."""
  from mllm.hf_errors import HFImportError
  from mllm.layers.rope import rope_keys_from_hf

  hf = {'rope_parameters': {'rope_theta': 5e5, **params}, 'max_position_embeddings': 4096}
  with pytest.raises(HFImportError, match=rf'rope_parameters\.{missing}: missing for rope_type'):
    rope_keys_from_hf(hf)


def test_transformers_4_rope_fields_give_the_same_config(tmp_path, imported):
  """Checkpoints saved before transformers 5 spell RoPE as rope_theta + rope_scaling."""

  def to_v4(config):
    params = config.pop('rope_parameters')
    config['rope_theta'] = params.pop('rope_theta')
    config['rope_scaling'] = params

  config, _ = imported(None, write_copy(tmp_path, 'llama3-scaled', edit_config=to_v4))
  assert config.model.to_dict() == imported('llama3-scaled')[0].model.to_dict()


@pytest.mark.parametrize(
  'fields,factor',
  [({'attention_factor': 2.0}, 2.0), ({'mscale': 0.9, 'mscale_all_dim': 0.7}, 1.0253), ({}, None)],
)
def test_yarn_attention_factors_are_read_as_transformers_infers_them(fields, factor):
  """A Llama's YaRN with an attention factor or DeepSeek's mscale pair (no softmax scale: only
  DeepSeek's attention reads mscale_all_dim there); the factors' arithmetic is test_positions'."""
  with open(os.path.join(FIXTURES, 'llama', 'config.json')) as f:
    config = json.load(f)
  config['rope_parameters'].update(
    rope_type='yarn', factor=4.0, original_max_position_embeddings=64, **fields
  )
  keys = hf.config_overrides(config)
  got = keys['model.position.rope.scaling.yarn.attention_factor']
  assert got == pytest.approx(factor, abs=1e-4) if factor is not None else got is None
  assert keys['model.attention.softmax_scale'] is None


@pytest.mark.parametrize(
  'edit,message',
  [
    (lambda c: c.update(model_type='falcon'), r"model_type='falcon'.*allowed: llama, mistral"),
    (lambda c: c.update(hidden_act='gelu'), r"hidden_act='gelu'.*allowed: 'silu'"),
    (lambda c: c['rope_parameters'].update(rope_type='dynamic'), r"rope_type='dynamic'"),
    (lambda c: c.update(pretraining_tp=2), r'pretraining_tp=2'),
    (lambda c: c.update(partial_rotary_factor=0.5), r'partial_rotary_factor=0.5'),
    (
      lambda c: c['rope_parameters'].update(partial_rotary_factor=0.5),
      r'partial_rotary_factor=0.5',
    ),
    (
      lambda c: c.update(quantization_config={'quant_method': 'gptq', 'bits': 4}),
      r"^quantization_config\.quant_method='gptq': mllm reads float checkpoints, MXFP4 experts "
      r"\(gpt-oss\) and fine-grained FP8 \(DeepSeek-V3, Qwen3-FP8\); allowed: 'mxfp4', 'fp8', "
      r'or the checkpoint saved again after a dequantizing load$',
    ),
    (  # static activation scales: input_scale tensors mllm does not apply
      lambda c: c.update(
        quantization_config={
          'quant_method': 'fp8',
          'activation_scheme': 'static',
          'weight_block_size': [128, 128],
        }
      ),
      r"^quantization_config\.activation_scheme='static': allowed with fp8: dynamic$",
    ),
    (  # per-tensor FP8 (no blocks)
      lambda c: c.update(quantization_config={'quant_method': 'fp8'}),
      r'^quantization_config\.weight_block_size=None: allowed with fp8: \[rows, columns\]',
    ),
  ],
)
def test_unsupported_config_fields_are_refused(tmp_path, edit, message):
  with pytest.raises(hf.HFImportError, match=message):
    hf.from_hf(write_copy(tmp_path, 'llama', edit_config=edit))


@pytest.mark.parametrize(
  'edit,message',
  [
    (lambda c: c.update(mlp_only_layers=[1]), r'mlp_only_layers=\[1\]'),
    (lambda c: c.update(router_jitter_noise=0.1), r'router_jitter_noise=0.1'),
  ],
)
def test_unsupported_moe_fields_are_refused(tmp_path, edit, message):
  with pytest.raises(hf.HFImportError, match=message):
    hf.from_hf(write_copy(tmp_path, 'qwen3-moe', edit_config=edit))


@pytest.mark.parametrize(
  'edit,message',
  [
    (lambda c: c.update(norm_topk_prob=False), r'norm_topk_prob=False'),
    (lambda c: c.update(num_key_value_heads=2), r'num_key_value_heads=2'),
    (lambda c: c.update(attention_bias=True), r'attention_bias=True'),
    (lambda c: c.update(n_shared_experts=0), r'n_shared_experts=0'),
  ],
)
def test_unsupported_deepseek_v3_fields_are_refused(tmp_path, edit, message):
  with pytest.raises(hf.HFImportError, match=message) as err:
    hf.from_hf(write_copy(tmp_path, 'deepseek-v3', edit_config=edit))
  assert '\n' not in str(err.value)


# deepseek-ai/DeepSeek-V3's config.json as the hub publishes it (transformers 4's spelling).
DEEPSEEK_V3_HUB = {
  'architectures': ['DeepseekV3ForCausalLM'],
  'attention_bias': False,
  'attention_dropout': 0.0,
  'aux_loss_alpha': 0.001,
  'bos_token_id': 0,
  'eos_token_id': 1,
  'ep_size': 1,
  'first_k_dense_replace': 3,
  'hidden_act': 'silu',
  'hidden_size': 7168,
  'initializer_range': 0.02,
  'intermediate_size': 18432,
  'kv_lora_rank': 512,
  'max_position_embeddings': 163840,
  'model_type': 'deepseek_v3',
  'moe_intermediate_size': 2048,
  'moe_layer_freq': 1,
  'n_group': 8,
  'n_routed_experts': 256,
  'n_shared_experts': 1,
  'norm_topk_prob': True,
  'num_attention_heads': 128,
  'num_experts_per_tok': 8,
  'num_hidden_layers': 61,
  'num_key_value_heads': 128,
  'num_nextn_predict_layers': 1,
  'q_lora_rank': 1536,
  'qk_nope_head_dim': 128,
  'qk_rope_head_dim': 64,
  'quantization_config': {
    'activation_scheme': 'dynamic',
    'fmt': 'e4m3',
    'quant_method': 'fp8',
    'weight_block_size': [128, 128],
  },
  'rms_norm_eps': 1e-06,
  'rope_scaling': {
    'beta_fast': 32,
    'beta_slow': 1,
    'factor': 40,
    'mscale': 1.0,
    'mscale_all_dim': 1.0,
    'original_max_position_embeddings': 4096,
    'type': 'yarn',
  },
  'rope_theta': 10000,
  'routed_scaling_factor': 2.5,
  'scoring_func': 'sigmoid',
  'seq_aux': True,
  'tie_word_embeddings': False,
  'topk_group': 4,
  'topk_method': 'noaux_tc',
  'torch_dtype': 'bfloat16',
  'transformers_version': '4.33.1',
  'use_cache': True,
  'v_head_dim': 128,
  'vocab_size': 129280,
}


def test_the_hubs_deepseek_v3_config_is_the_papers_model():
  """The full-size config imports (its FP8 and YaRN included) to the model of the DeepSeek-V3
  report (arXiv 2412.19437): 671 B parameters, 37 B active per token; YaRN's factors as
  transformers computes them: cos/sin × 1 (mscale = mscale_all_dim), scores × 192^(-1/2) ·
  (0.1·ln 40 + 1)²."""
  from mllm.accounting import count_params
  from mllm.config import load_config

  keys = hf.config_overrides(DEEPSEEK_V3_HUB)
  assert keys['model.position.rope.scaling.yarn.attention_factor'] == 1.0
  expected = 192**-0.5 * (0.1 * math.log(40.0) + 1.0) ** 2
  assert keys['model.attention.softmax_scale'] == pytest.approx(expected, rel=1e-15)
  counts = count_params(load_config(hf.base_config_path(), keys).model)
  assert counts.total / 1e9 == pytest.approx(671, abs=0.5)
  assert counts.active / 1e9 == pytest.approx(37, abs=0.6)


def test_missing_and_extra_weights_are_refused(tmp_path):
  def drop(w):
    w = dict(w)
    del w['model.layers.1.mlp.up_proj.weight']
    return w

  with pytest.raises(hf.HFImportError, match=r"no weight 'model.layers.1.mlp.up_proj.weight'"):
    hf.from_hf(write_copy(tmp_path, 'llama', edit_weights=drop))
  extra = lambda w: {**w, 'model.layers.0.mlp.extra.weight': np.zeros(3, np.float32)}  # noqa
  with pytest.raises(
    hf.HFImportError, match=r'weights mllm does not use: model\.layers\.0\.mlp\.extra'
  ):
    hf.from_hf(write_copy(tmp_path / 'x', 'llama', edit_weights=extra))


def test_qwen3_layer_types_map_to_every_nth_layer_global_or_are_refused(tmp_path):
  """Every N-th layer full among sliding ones is `attention.global_every` (as Gemma 2's); any other
  mix is refused in one line."""

  def every_other(c):
    c.update(layer_types=['sliding_attention', 'full_attention'], sliding_window=32)

  overrides = hf.config_overrides(hf.read_hf_config(write_copy(tmp_path, 'qwen3', every_other)))
  assert overrides['model.attention.sliding_window'] == 32
  assert overrides['model.attention.global_every'] == 2

  def full_first(c):
    c.update(layer_types=['full_attention', 'sliding_attention'], sliding_window=32)

  with pytest.raises(hf.HFImportError, match=r"^layer_types=\['full_attention', .* every N-th"):
    hf.from_hf(write_copy(tmp_path / 'x', 'qwen3', edit_config=full_first))


# --- Export -------------------------------------------------------------------------------------


def load_tensors(path):
  from safetensors.numpy import load_file

  files = sorted(f for f in os.listdir(path) if f.endswith('.safetensors'))
  out = {}
  for f in files:
    out.update(load_file(os.path.join(path, f)))
  return out


@pytest.mark.parametrize('family', FAMILIES)
def test_hf_to_mllm_to_hf_is_bitwise_the_same(family, imported, tmp_path):
  config, model = imported(family)
  with open(os.path.join(FIXTURES, family, 'config.json')) as f:
    original = json.load(f)
  assert hf.to_hf(config, model, str(tmp_path)) == original['model_type']
  before, after = load_tensors(os.path.join(FIXTURES, family)), load_tensors(str(tmp_path))
  assert sorted(before) == sorted(after)
  for name in before:
    assert before[name].dtype == after[name].dtype and np.array_equal(before[name], after[name])
  from safetensors import safe_open

  with safe_open(str(tmp_path / 'model.safetensors'), 'np') as f:
    assert f.metadata() == {'format': 'pt'}
  exported = hf.read_hf_config(str(tmp_path))
  assert hf.config_overrides(exported) == hf.config_overrides(original)


def test_a_bfloat16_checkpoint_round_trips_bitwise_in_bfloat16(tmp_path, imported):
  import ml_dtypes

  path = write_copy(
    tmp_path,
    'qwen3',
    edit_weights=lambda w: {k: v.astype(ml_dtypes.bfloat16) for k, v in w.items()},
  )
  config, model = imported(None, path)
  hf.to_hf(config, model, str(tmp_path / 'out'), dtype='bfloat16')
  before, after = load_tensors(path), load_tensors(str(tmp_path / 'out'))
  assert sorted(before) == sorted(after)
  for name in before:
    assert after[name].dtype == ml_dtypes.bfloat16
    assert before[name].tobytes() == after[name].tobytes()
  assert hf.read_hf_config(str(tmp_path / 'out'))['dtype'] == 'bfloat16'


def randomized(config, seed=0):
  """An mllm model of `config` with every parameter random (norm scales near 1, biases near 0
  included, so a dropped or swapped tensor shows in the logits); the same in every process (a
  CRC of each parameter's path, not Python's salted `hash`)."""
  import jax
  from flax import nnx

  import mllm

  model = mllm.build_model(config.model, rngs=nnx.Rngs(seed))
  params = nnx.state(model, nnx.Param)
  key = jax.random.key(seed + 1)

  def noisy(path, x):
    scale = 1.0 if 'scale' in str(path[-1]) else 0.0
    return scale + 0.3 * jax.random.normal(
      jax.random.fold_in(key, zlib.crc32(str(path).encode()) % 2**31), x.shape, x.dtype
    )

  nnx.update(model, jax.tree.map_with_path(noisy, params))
  return model


# mllm configs that a transformers class computes exactly, and the family each exports as.
EXPORTABLE = {
  'llama-gqa': ('llama', {}),
  'llama-untied-biases': (
    'llama',
    {'model.tie_embeddings': False, 'model.attention.use_bias': True, 'model.ffn.use_bias': True},
  ),
  'llama-pi': (
    'llama',
    {
      'model.position.rope.scaling.kind': 'linear',
      'model.position.rope.scaling.linear.factor': 2.0,
    },
  ),
  'llama-scanned': ('llama', {'model.scan_layers': True}),
  'mistral': ('mistral', {'model.attention.sliding_window': 5}),
  'qwen2': ('qwen2', {'model.attention.qkv_bias': True}),
  'qwen3': ('qwen3', {'model.attention.qk_norm': True, 'model.head_dim': 8}),
  'llama-yarn': (
    'llama',
    {
      'model.position.rope.scaling.kind': 'yarn',
      'model.position.rope.scaling.yarn.factor': 4.0,
      'model.position.rope.original_max_len': 8,
    },
  ),
  'mixtral': (
    'mixtral',
    {'model.ffn.kind': 'moe', 'model.ffn.moe.num_experts': 4, 'model.ffn.moe.dispatch': 'dropless'},
  ),
  'qwen3-moe': (
    'qwen3_moe',
    {
      'model.ffn.kind': 'moe',
      'model.ffn.moe.num_experts': 4,
      'model.ffn.moe.expert_d_ff': 24,
      'model.attention.qk_norm': True,
      'model.ffn.moe.first_dense_layers': 1,
      'model.n_layers': 3,
      'model.ffn.moe.renormalize': False,
      'model.ffn.moe.dispatch': 'dropless',
    },
  ),
  # An untied head, which the fixtures (tied, as Gemma 2 ships) do not have.
  'gemma2-untied': (
    'gemma2',
    {
      'model.norm.placement': 'sandwich',
      'model.norm.unit_offset': True,
      'model.ffn.kind': 'geglu_tanh',
      'model.embed_scale': 4.0,
      'model.tie_embeddings': False,
      'model.attention.logit_softcap': 2.0,
      'model.final_logit_softcap': 3.0,
      'model.attention.sliding_window': 5,
      'model.attention.global_every': 2,
    },
  ),
  'gpt2': (
    'gpt2',
    {
      'model.position.kind': 'learned',
      'model.norm.kind': 'layernorm',
      'model.ffn.kind': 'gelu_tanh',
      'model.attention.use_bias': True,
      'model.ffn.use_bias': True,
      'model.n_kv_heads': 4,
    },
  ),
  # gpt-oss's choices without a window (every layer global), another clamp.
  'gpt-oss-global': (
    'gpt_oss',
    {
      'model.attention.sinks': True,
      'model.attention.use_bias': True,
      'model.ffn.use_bias': True,
      'model.ffn.kind': 'moe',
      'model.ffn.moe.num_experts': 4,
      'model.ffn.moe.router_bias': True,
      'model.ffn.moe.expert.kind': 'clamped_swiglu',
      'model.ffn.moe.expert.clamped_swiglu.limit': 0.5,
      'model.ffn.moe.dispatch': 'dropless',
    },
  ),
  # MLA over DeepSeekMoE layers only (scanned), every expert group open, a shared expert.
  'deepseek-v3-scanned': (
    'deepseek_v3',
    {
      'model.attention.kind': 'mla',
      'model.n_kv_heads': 4,
      'model.attention.mla.q_lora_rank': 8,
      'model.scan_layers': True,
      'model.ffn.kind': 'moe',
      'model.ffn.moe.num_experts': 4,
      'model.ffn.moe.num_shared_experts': 1,
      'model.ffn.moe.router': 'sigmoid',
      'model.ffn.moe.expert_bias': True,
      'model.ffn.moe.dispatch': 'dropless',
    },
  ),
}


@pytest.mark.parametrize('name', EXPORTABLE)
def test_mllm_to_hf_to_mllm_gives_the_same_logits(name, tiny, tmp_path):
  family, keys = EXPORTABLE[name]
  config = tiny(**{k.replace('.', '__'): v for k, v in keys.items()})
  model = randomized(config)
  import mllm  # the top-level names

  assert mllm.to_hf(config, model, str(tmp_path)) == family
  assert hf.read_hf_config(str(tmp_path))['architectures'] == [hf.ARCHITECTURES[family]]
  _, back = mllm.from_hf(str(tmp_path), {'model.scan_layers': config.model.scan_layers})
  ids = np.random.default_rng(0).integers(0, config.model.vocab_size, (2, 16))
  np.testing.assert_allclose(logits_of(back, ids), logits_of(model, ids), atol=1e-6, rtol=0)


def test_a_large_export_is_written_in_shards_that_import_the_same(tmp_path, imported):
  config, model = imported('llama')
  hf.to_hf(config, model, str(tmp_path), max_shard_bytes=20_000)
  with open(tmp_path / 'model.safetensors.index.json') as f:
    index = json.load(f)
  assert len(set(index['weight_map'].values())) > 3
  assert not (tmp_path / 'model.safetensors').exists()
  _, back = imported(None, str(tmp_path))
  ref = reference('llama')
  np.testing.assert_array_equal(
    logits_of(back, ref['short_ids']), logits_of(model, ref['short_ids'])
  )


@pytest.mark.parametrize(
  'keys,message',
  [
    ({'model.position.kind': 'alibi'}, r"model.position.kind='alibi': .*LlamaForCausalLM.* 'rope'"),
    ({'model.position.kind': 't5'}, r"model.position.kind='t5'"),
    ({'model.position.kind': 'shaw'}, r"model.position.kind='shaw'"),
    ({'model.position.kind': 'sinusoidal'}, r"model.position.kind='sinusoidal'"),
    ({'model.norm.kind': 'partial_rmsnorm'}, r"model.norm.kind='partial_rmsnorm'"),
    ({'model.norm.placement': 'post'}, r"model.norm.placement='post'"),
    ({'model.ffn.kind': 'geglu'}, r"model.ffn.kind='geglu'"),
    ({'model.position.rope.layout': 'interleaved'}, r"model.position.rope.layout='interleaved'"),
    # Partial RoPE exports as StableLM, whose norm is LayerNorm.
    ({'model.position.rope.fraction': 0.5}, r"model.norm.kind='rmsnorm': .*StableLmForCausalLM"),
    # p-RoPE: StableLM's partial_rotary_factor spreads its frequencies as GPT-NeoX does.
    (
      {
        'model.position.rope.fraction': 0.5,
        'model.position.rope.frequencies': 'highest',
        'model.norm.kind': 'layernorm',
        'model.norm.use_bias': True,
        'model.attention.qkv_bias': True,
      },
      r"model.position.rope.frequencies='highest': .*StableLmForCausalLM.* 'spread'",
    ),
    # Sandwich norms export as Gemma 2, which scales its embeddings by √d.
    (
      {'model.norm.placement': 'sandwich'},
      r'model.embed_scale=1.0: .*Gemma2ForCausalLM .* has 4.0',
    ),
    ({'model.ffn.kind': 'relu2'}, r"model.ffn.kind='relu2'"),
    ({'model.attention.output_gate': 'headwise'}, r"model.attention.output_gate='headwise'"),
    (
      {'model.attention.sliding_window': 5, 'model.attention.global_every': 2},
      r'model.attention.global_every=2',
    ),
    ({'model.position.rope.nope_every': 2}, r'model.position.rope.nope_every=2'),
    ({'model.attention.value_residual': True}, r'model.attention.value_residual=True'),
    # Sinks export as gpt-oss, an MoE in every layer.
    ({'model.attention.sinks': True}, r"model.ffn.kind='swiglu': .*GptOssForCausalLM"),
    (
      {'model.position.rope.scaling.kind': 'ntk', 'model.position.rope.scaling.ntk.factor': 2.0},
      r"model.position.rope.scaling.kind='ntk'",
    ),
    ({'model.embed_scale': 4.0}, r'model.embed_scale=4.0'),
    ({'model.attention.softmax_scale': 0.1}, r'model.attention.softmax_scale=0.1'),
    # DeepSeek-V3 scales its softmax through YaRN's mscale_all_dim, by steps too coarse for 0.25.
    (
      {
        'model.attention.kind': 'mla',
        'model.n_kv_heads': 4,
        'model.position.rope.scaling.kind': 'yarn',
        'model.position.rope.scaling.yarn.factor': 4.0,
        'model.attention.softmax_scale': 0.25,
      },
      r'model.attention.softmax_scale=0.25: .*DeepseekV3ForCausalLM.* has 0.2499999',
    ),
    ({'model.norm.final_norm': False}, r'model.norm.final_norm=False'),
    (
      {'model.attention.sliding_window': 5, 'model.attention.use_bias': True},
      r'model.attention.use_bias=True: .*MistralForCausalLM',
    ),
    (
      {'model.ffn.kind': 'moe', 'model.ffn.moe.num_shared_experts': 1},
      r'model.ffn.moe.num_shared_experts=1: .*MixtralForCausalLM',
    ),
    (
      {'model.ffn.kind': 'moe', 'model.ffn.moe.router': 'sigmoid'},
      r"model.ffn.moe.router='sigmoid'",
    ),
    (
      {'model.ffn.kind': 'moe', 'model.ffn.moe.expert_bias': True},
      r'model.ffn.moe.expert_bias=True',
    ),
    (
      {'model.ffn.kind': 'moe', 'model.ffn.moe.renormalize': False},
      r'model.ffn.moe.renormalize=False: .*MixtralForCausalLM',
    ),
    (
      {'model.position.kind': 'learned', 'model.n_kv_heads': 4},
      r"model.norm.kind='rmsnorm': .*GPT2LMHeadModel",
    ),
    # MLA exports as DeepSeek-V3, whose experts route by sigmoid scores and whose attention has
    # no sinks.
    (
      {'model.attention.kind': 'mla', 'model.n_kv_heads': 4, 'model.attention.sinks': True},
      r'model.attention.sinks=True: .*DeepseekV3ForCausalLM',
    ),
    (
      {'model.attention.kind': 'mla', 'model.n_kv_heads': 4, 'model.ffn.kind': 'moe'},
      r'model.ffn.moe.num_shared_experts=0: DeepseekV3ForCausalLM',
    ),
    (
      {
        'model.attention.kind': 'mla',
        'model.n_kv_heads': 4,
        'model.ffn.kind': 'moe',
        'model.ffn.moe.num_shared_experts': 1,
      },
      r"model.ffn.moe.router='softmax': .*DeepseekV3ForCausalLM",
    ),
  ],
)
def test_models_no_transformers_class_computes_are_refused(keys, message, tiny, tmp_path):
  config = tiny(**{k.replace('.', '__'): v for k, v in keys.items()})
  model = randomized(config)
  with pytest.raises(hf.HFExportError, match=message) as err:
    hf.to_hf(config, model, str(tmp_path / 'out'))
  assert '\n' not in str(err.value) and 'allowed:' in str(err.value)
  assert not (tmp_path / 'out').exists()


# --- A Hugging Face folder through launch.py: import, generate, train, export -------------------


def add_tokenizer(folder):
  """A character-level tokenizer.json for a fixture's 96 ids, EOS '</s>' named in
  tokenizer_config.json (as the hub's folders name theirs)."""
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

  chars = [chr(c) for c in range(32, 125)] + ['\n', '<unk>', '</s>']
  tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token='<unk>'))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex('.|\n'), behavior='isolated')
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens(['</s>'])
  tok.save(os.path.join(folder, 'tokenizer.json'))
  with open(os.path.join(folder, 'tokenizer_config.json'), 'w') as f:
    json.dump({'eos_token': '</s>', 'tokenizer_class': 'PreTrainedTokenizerFast'}, f)


def test_tokenizer_settings_take_an_eos_id_from_config_json(tmp_path):
  path = write_copy(tmp_path, 'llama', edit_config=lambda c: c.update(eos_token_id=[95, 94]))
  add_tokenizer(path)
  os.remove(os.path.join(path, 'tokenizer_config.json'))
  assert hf.tokenizer_settings(path)['data.eos_token'] == '</s>'  # id 95, the first listed


def test_tokenizer_settings_name_the_folders_eos(tmp_path):
  path = write_copy(tmp_path, 'llama')
  assert hf.tokenizer_settings(path) == {}
  add_tokenizer(path)
  assert hf.tokenizer_settings(path) == {
    'data.tokenizer': 'bpe',
    'data.eos_token': '</s>',
    'data.pad_token': '</s>',
  }


def test_import_generate_train_and_export_through_launch(corpus, tmp_path):
  """launch.py --mode=import writes a normal workdir: generate, train (its config read from the
  workdir, a shape-keeping toggle on top) and export all work on it."""
  from test_launch import run_launch

  from mllm.generation import generate, load_run

  path = write_copy(tmp_path, 'qwen3')
  add_tokenizer(path)
  workdir, out = str(tmp_path / 'run'), str(tmp_path / 'exported')
  data = [
    '--config.data.source=text',
    f'--config.data.path={corpus}',
    '--config.data.batch_size=2',
    '--config.data.seq_len=32',
    '--config.train.steps=2',
    '--config.train.eval_batches=1',
    '--config.train.warmup_steps=1',
  ]
  result = run_launch('--mode=import', f'--hf={path}', f'--workdir={workdir}', *data)
  assert result.returncode == 0, result.stderr
  assert os.path.isfile(os.path.join(workdir, 'tokenizer.json'))

  # The workdir's step 0 is the checkpoint: the same logits, and generate finds its tokenizer.
  import mllm

  like = mllm.load_config(hf.base_config_path())
  model, tokenizer, step, config = load_run(workdir, like)
  assert step == 0 and config.data.eos_token == '</s>' and config.model.attention.qk_norm
  ref = reference('qwen3')
  np.testing.assert_allclose(logits_of(model, ref['long_ids']), ref['logits_long'], atol=1e-4)
  result = run_launch(
    '--mode=generate', f'--workdir={workdir}', '--prompt=def f(x):', '--max_new_tokens=6'
  )
  assert result.returncode == 0, result.stderr
  assert (
    result.stdout.rstrip('\n')
    == 'def f(x):' + generate(model, tokenizer, ['def f(x):'], max_new_tokens=6)[0]
  )

  # Continue pre-training with the workdir's own config (no --config) and YaRN on top.
  result = run_launch(
    f'--workdir={workdir}',
    '--config.model.position.rope.scaling.kind=yarn',
    '--config.model.position.rope.scaling.yarn.factor=2.0',
    '--config.model.position.rope.original_max_len=128',
  )
  assert result.returncode == 0, result.stderr
  trained, _, step, config = load_run(workdir, like)
  assert step == 2 and config.model.position.rope.scaling.kind == 'yarn'

  result = run_launch('--mode=eval', f'--workdir={workdir}')
  assert result.returncode == 0 and 'step 2 of' in result.stdout, result.stderr

  result = run_launch('--mode=export', f'--workdir={workdir}', f'--hf={out}')
  assert result.returncode == 0, result.stderr
  exported = hf.read_hf_config(out)
  assert exported['rope_parameters']['rope_type'] == 'yarn'
  assert exported['eos_token_id'] == tokenizer.eos_id
  assert os.path.isfile(os.path.join(out, 'tokenizer.json'))
  _, back = hf.from_hf(out)
  np.testing.assert_array_equal(
    logits_of(back, ref['short_ids']), logits_of(trained, ref['short_ids'])
  )


def test_init_from_a_folder_without_its_tokenizer_is_refused(tmp_path):
  from test_launch import run_launch

  path = write_copy(tmp_path, 'llama')
  result = run_launch(f'--config.train.init_from=hf:{path}', f'--workdir={tmp_path / "w"}')
  assert result.returncode == 2
  assert 'has no tokenizer.json' in result.stderr and len(result.stderr.strip().splitlines()) == 1


# --- What mllm exported, as transformers read it --------------------------------------------------
# tests/fixtures/make_export_fixtures.py: `to_hf` wrote random mllm models of each family, then
# transformers 5.24 loaded each folder and recorded its logits, greedy continuations and tokenizer ids.

EXPORTED = [
  'exported-llama',
  'exported-mistral',
  'exported-qwen2',
  'exported-qwen3',
  'exported-gpt2',
  'exported-mixtral',
  'exported-qwen3-moe',
  'exported-gemma2',
  'exported-olmo2',
  'exported-stablelm',
  'exported-deepseek-v3',
  'exported-deepseek-v3-dense',
  'exported-gpt-oss',
]


@pytest.mark.parametrize('name', EXPORTED)
def test_transformers_computes_what_mllm_exported(name, imported):
  _, model = imported(name)
  assert_logits_match(model, name)
  assert_greedy_matches(model, name)


@pytest.mark.parametrize('name', EXPORTED)
def test_to_hf_still_writes_the_files_transformers_read(name, imported, tmp_path):
  """If to_hf's output changes, these fixtures no longer show that transformers reads it: rerun
  make_export_fixtures.py (both steps)."""
  from mllm.data.tokenizers import BPETokenizer

  folder = os.path.join(FIXTURES, name)
  config, model = imported(name)
  tokenizer = None
  if os.path.isfile(os.path.join(folder, 'tokenizer.json')):
    settings = hf.tokenizer_settings(folder)
    tokenizer = BPETokenizer.from_file(
      os.path.join(folder, 'tokenizer.json'), settings['data.eos_token'], settings['data.pad_token']
    )
  hf.to_hf(config, model, str(tmp_path), tokenizer=tokenizer)
  for file in ('config.json', 'tokenizer_config.json'):
    if os.path.isfile(os.path.join(folder, file)):
      with open(os.path.join(folder, file)) as a, open(tmp_path / file) as b:
        assert json.load(a) == json.load(b), file
  before, after = load_tensors(folder), load_tensors(str(tmp_path))
  assert sorted(before) == sorted(after)
  assert all(np.array_equal(before[n], after[n]) for n in before)


def test_an_exported_bpe_tokenizer_gives_transformers_ids():
  from mllm.data.tokenizers import BPETokenizer

  folder = os.path.join(FIXTURES, 'exported-gpt2')
  settings = hf.tokenizer_settings(folder)
  assert settings['data.eos_token'] == '<eos>' and settings['data.pad_token'] == '<pad>'
  tok = BPETokenizer.from_file(os.path.join(folder, 'tokenizer.json'), '<eos>', '<pad>')
  text = 'def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # é ü 中\n'
  assert tok.encode(text) == reference('exported-gpt2')['text_ids'].tolist()
  assert tok.decode(tok.encode(text)) == text


def test_launch_import_and_export_refusals_are_one_line(corpus, tmp_path):
  from test_launch import run_launch

  path = write_copy(tmp_path, 'llama')
  add_tokenizer(path)

  def one_line_error(result, text):
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and text in lines[0], result.stderr

  one_line_error(
    run_launch('--mode=import', f'--workdir={tmp_path / "a"}'),
    '--hf: --mode=import needs the Hugging Face folder',
  )
  one_line_error(
    run_launch('--mode=import', f'--hf={tmp_path / "nope"}', f'--workdir={tmp_path / "a"}'),
    'has no config.json',
  )
  one_line_error(
    run_launch(
      '--mode',
      'import',
      '--hf',
      str(tmp_path / 'nope'),  # absl's spaced form
      f'--workdir={tmp_path / "a"}',
    ),
    'has no config.json',
  )
  # ALiBi keeps the parameters' shapes, so the import takes it; no HF class computes it.
  workdir = str(tmp_path / 'alibi')
  result = run_launch(
    '--mode=import',
    f'--hf={path}',
    f'--workdir={workdir}',
    '--config.model.position.kind=alibi',
    '--config.data.source=text',
    f'--config.data.path={corpus}',
    '--config.data.seq_len=32',
  )
  assert result.returncode == 0, result.stderr
  one_line_error(
    run_launch('--mode=export', f'--workdir={workdir}', f'--hf={tmp_path / "out"}'),
    "model.position.kind='alibi'",
  )
  one_line_error(
    run_launch('--mode=import', f'--hf={path}', f'--workdir={workdir}'), 'already holds checkpoints'
  )


def test_a_tied_checkpoint_that_also_stores_its_head_loads_unless_they_differ(tmp_path):
  ref = reference('qwen2')
  path = write_copy(
    tmp_path,
    'qwen2',
    edit_weights=lambda w: {**w, 'lm_head.weight': w['model.embed_tokens.weight'].copy()},
  )
  _, model = hf.from_hf(path)
  np.testing.assert_allclose(logits_of(model, ref['short_ids']), ref['logits_short'], atol=1e-4)
  path = write_copy(
    tmp_path / 'x',
    'qwen2',
    edit_weights=lambda w: {**w, 'lm_head.weight': w['model.embed_tokens.weight'] + 1},
  )
  with pytest.raises(hf.HFImportError, match=r'lm_head\.weight differs from model\.embed_tokens'):
    hf.from_hf(path)


def test_gpt2_checkpoints_without_the_transformer_prefix_load_the_same(tmp_path):
  """The original gpt2 repository names its tensors 'h.0.attn...' and 'wte.weight'."""
  path = write_copy(
    tmp_path,
    'gpt2',
    edit_weights=lambda w: {k.removeprefix('transformer.'): v for k, v in w.items()},
  )
  _, model = hf.from_hf(path)
  ref = reference('gpt2')
  np.testing.assert_allclose(logits_of(model, ref['long_ids']), ref['logits_long'], atol=1e-4)


def test_an_override_that_changes_the_parameters_is_refused_naming_them():
  with pytest.raises(
    hf.HFImportError,
    match=r'the config builds parameters the checkpoint '
    r'lacks: blocks/0/attention_norm/bias.*allowed: overrides that keep',
  ):
    hf.from_hf(os.path.join(FIXTURES, 'llama'), {'model.norm.kind': 'layernorm'})


# --- gpt-oss's hub checkpoints: MXFP4 experts --------------------------------------------------


def test_mxfp4_codes_and_blocks_dequantize_as_the_ocp_spec_defines_them():
  """Each 4-bit E2M1 code against the format's formula (OCP MX v1.0, sec. 5.3.3: sign, 2 exponent
  bits of bias 1, 1 mantissa bit, exponent 0 subnormal), computed here in float64; a block's
  bytes (the low nibble first) and its E8M0 scale (2^(s − 127)) on a worked example; the float
  layout puts the blocks' axis (the input) before the rows."""
  from mllm.interop.hf_quantized import E2M1_VALUES, dequantize_mxfp4

  for code in range(16):
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    magnitude = mantissa / 2 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    assert E2M1_VALUES[code] == (-1) ** sign * magnitude
  # One expert, 2 rows, one block each: row 0 codes 1..15 then 0 (bytes 0x21, 0x43, ...), scale
  # 2^1; row 1 every value -6 (code 15), scale 2^-3.
  codes = np.array([list(range(1, 32 + 1)), [15] * 32]) % 16
  blocks = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)[None, :, None, :]
  scales = np.array([[[128], [124]]], np.uint8)
  got = dequantize_mxfp4(blocks, scales)
  assert got.shape == (1, 32, 2) and got.dtype == np.float32
  np.testing.assert_array_equal(got[0, :, 0], 2.0 * E2M1_VALUES[codes[0]])
  np.testing.assert_array_equal(got[0, :, 1], np.full(32, -6.0 / 8))
  with pytest.raises(hf.HFImportError, match=r'^MXFP4 blocks uint8\[1, 2, 1, 16\] and scales'):
    dequantize_mxfp4(blocks, scales[..., 0])


def test_a_gpt_oss_checkpoint_with_mxfp4_experts_gives_transformers_logits(imported):
  """The gpt-oss fixture with its experts packed as the hub packs them (the _blocks / _scales
  pairs and quantization_config, tests/fixtures/make_hf_fixtures.py) imports to the logits
  transformers computes after dequantizing them itself, and to the float fixture's parameters
  but the experts'."""
  config, model = imported('gpt-oss-mxfp4')
  assert_logits_match(model, 'gpt-oss-mxfp4')
  float_config, float_model = imported('gpt-oss')
  assert config.model.to_dict() == float_config.model.to_dict()
  packed = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  for path, value in nnx.to_flat_state(nnx.state(float_model, nnx.Param)):
    same = np.array_equal(np.asarray(packed[path][...]), np.asarray(value[...]))
    assert same == ('experts' not in path or 'bias' in path[-1]), path
