"""benchmarks/ffn_replication.py without PyTorch: mllm's parameters under torch_llama's names and
layouts, and the report and evidence written from hand-made runs (the training half needs torch,
which the test venv does not have; its committed results are benchmarks/results/)."""

from __future__ import annotations

import json
import os

import numpy as np

from benchmarks import ffn_replication


def test_parameters_map_to_torch_names_and_layouts():
  """Every mllm parameter of a small SwiGLU model gets a torch_llama name; linear kernels are
  transposed to [out, in], attention's per-head kernels flattened first, nothing else changed."""
  from flax import nnx

  import mllm

  config = mllm.load_config(
    'configs/rope_swiglu.py',
    {'model.d_model': 32, 'model.n_layers': 2, 'model.n_heads': 4, 'model.n_kv_heads': 4},
  )
  model = mllm.build_model(config, rngs=nnx.Rngs(0))
  mapped = ffn_replication._torch_params(nnx.state(model, nnx.Param))
  d, d_ff, vocab = 32, mllm.layers.ffn.hidden_dim(config.model.ffn, 32), config.model.vocab_size
  expected = {'embed.weight': (vocab, d), 'final_norm.scale': (d,)}
  for i in range(2):
    expected |= {
      f'blocks.{i}.attention_norm.scale': (d,),
      f'blocks.{i}.ffn_norm.scale': (d,),
      **{f'blocks.{i}.attention.{n}.weight': (d, d) for n in ('query', 'key', 'value', 'out')},
      f'blocks.{i}.ffn.gate.weight': (d_ff, d),
      f'blocks.{i}.ffn.up.weight': (d_ff, d),
      f'blocks.{i}.ffn.down.weight': (d, d_ff),
    }
  assert {k: v.shape for k, v in mapped.items()} == expected
  block = model.blocks[0]
  query = np.asarray(block.attention.query.kernel[...])  # [d, heads, head_dim]
  np.testing.assert_array_equal(mapped['blocks.0.attention.query.weight'], query.reshape(d, -1).T)
  out = np.asarray(block.attention.out.kernel[...])  # [heads, head_dim, d]
  np.testing.assert_array_equal(mapped['blocks.0.attention.out.weight'], out.reshape(-1, d).T)
  down = np.asarray(block.ffn.down.kernel[...])
  np.testing.assert_array_equal(mapped['blocks.0.ffn.down.weight'], down.T)


def _fake_runs(out: str) -> None:
  """Exported folders of relu and swiglu, seeds 0 and 1, each with a finished torch run at the
  export's weight decay and one without it."""
  finals = {('relu', 0): 2.0, ('relu', 1): 2.1, ('swiglu', 0): 2.15, ('swiglu', 1): 2.27}
  for (variant, seed), loss in finals.items():
    folder = os.path.join(out, f'{variant}-s{seed}')
    os.makedirs(folder)
    meta = {
      'suite': 'ffn_tokens',
      'variant': variant,
      'seed': seed,
      'hash': 'abc',
      'train': {'weight_decay': 0.1},
      'tokens_per_step': 100,
      'mllm': {
        'init_loss': 6.5,
        'curve': {'step': [10, 20, 30], 'loss': [5.0, 4.5, 4.0]},
        'eval_loss': loss + 0.001,
      },
    }
    with open(os.path.join(folder, 'meta.json'), 'w') as f:
      json.dump(meta, f)
    for wd, shift in ((0.1, 0.0), (0.0, 0.05)):
      run = {
        'weight_decay': wd,
        'init': 'mllm',
        'losses': [6.5] + [5.0] * 9 + [4.5] * 10 + [4.0] * 10,
        'evals': [
          {'step': 0, 'eval_loss': 6.5},
          {'step': 30, 'eval_loss': loss + shift, 'up_norm': 1.0, 'hidden_rms': 0.5},
        ],
        'eval_loss': loss + shift,
        'torch': '2.13.0',
        'threads': 1,
        'wall_s': 1.0,
      }
      name = 'torch.json' if wd == 0.1 else 'torch-wd0.json'
      with open(os.path.join(folder, name), 'w') as f:
        json.dump(run, f)


def test_the_report_and_the_evidence_pair_seeds_across_implementations(tmp_path):
  out, results = str(tmp_path / 'export'), str(tmp_path / 'results')
  _fake_runs(out)
  written = ffn_replication.write_evidence(out, results)
  assert written == {'ffn_replication': 4, 'ffn_replication_wd0': 4}
  with open(os.path.join(results, 'ffn_replication', 'results.json')) as f:
    runs = {(r['variant'], r['seed']): r for r in json.load(f)['runs']}
  assert runs[('swiglu', 1)]['eval_loss'] == 2.27
  assert runs[('swiglu', 1)]['eval_curve'] == {'step': [30], 'loss': [2.27]}
  assert runs[('relu', 0)]['tokens'] == 3000 and runs[('relu', 0)]['steps'] == 30
  text = ffn_replication.report(out)
  # PyTorch gaps +0.15 and +0.17 (mean +0.16); mllm's the same (+0.001 on both rows).
  assert '| mllm | 0.1 | PyTorch | +0.1500, +0.1700 | +0.1600 [' in text
  assert '| mllm | 0.1 | mllm | +0.1500, +0.1700 | +0.1600 [' in text
  assert '| mllm | 0 | PyTorch | +0.1500, +0.1700 |' in text
  assert '| relu | 0 | mllm | 0.1 | 6.50000 / 6.50000 | 5.0000 / 5.0000; 4.5000 / 4.5000' in text
  from experiments.diagnosis import Evidence, stays_behind

  finding = stays_behind('ffn_replication', 'relu', cause='a fault', where='(PyTorch)')(
    Evidence(results), 'swiglu'
  )
  assert finding.supported and '+0.160 [' in finding.text
