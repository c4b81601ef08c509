"""Extending a RoPE model's context (Chen et al. 2023, Position Interpolation, Table 1 and Fig. 2):
one RoPE model trained at context L, then evaluated at L, 2L, 4L and 8L
- unchanged (extrapolation);
- with Position Interpolation (positions scaled by L/8L), NTK-aware scaling (base b·s^(d/(d−2)))
  and YaRN (Peng et al. 2023, ramp α=1 β=32 plus the attention temperature), each applied to the
  trained weights with no training;
- fine-tuned at 8L for a short run (a fifth of pre-training's steps, the same tokens a step) with
  PI, and without it (direct fine-tuning, the PI paper's slow baseline).
Every extension targets 8L (scaling factor 8) and is evaluated at every length with that factor,
as one deploys it. Variants that do not train start from the `rope` run of their seed.
"""

import math

from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS

TARGET = 8  # extend to 8 × the pre-training context


def _pretraining_length(config) -> dict:
  """Name L (the scalings' original context), so that the lengths a variant is measured at stay
  multiples of the pre-training L when its own context grows."""
  return {'model.position.rope.original_max_len': config.data.seq_len}


def _scaled(kind: str) -> dict:
  return {
    'model.position.rope.scaling.kind': kind,
    f'model.position.rope.scaling.{kind}.factor': float(TARGET),
  }


def _finetune_at_target(config) -> dict:
  """A fifth of pre-training's steps at 8L, the same tokens per step (batch / 8), a tenth of its
  learning rate with a short warm-up (PI fine-tunes LLaMA with 2e-5 after 3e-4)."""
  length, t = config.data.seq_len, config.train
  steps = max(2, t.steps // 5)
  return {
    **_pretraining_length(config),
    'data.seq_len': TARGET * length,
    'model.max_seq_len': TARGET * length,
    'data.batch_size': max(1, config.data.batch_size // TARGET),
    'train.steps': steps,
    'train.warmup_steps': max(1, steps // 10),
    'train.learning_rate': t.learning_rate / 10,
  }


def _applied(name: str, kind: str) -> Variant:
  """The rope run's parameters evaluated under a scaling to 8L, with no training."""
  return Variant(
    name,
    overrides=_scaled(kind),
    derived=_pretraining_length,
    starts_from='rope',
    trains=False,
    expect='better',
  )


# Every extension beats the unchanged model past L: unchanged, the PI paper's LLaMA reads > 1e3 ppl
# at 2L (its Table 1), where each extension stays near its ppl at L (expect='better' at 8L).
# LLaMA 7B on PG-19 (PI paper, Table 1): perplexity at 8192 = 4L of the models extended to 4L
# (the paper's longest); we compare ln(perplexity) at our longest, 8L.
_PAPER_AT_4L = {'pi-finetune': 6.95, 'direct-finetune': 7.69}

SUITE = Suite(
  name='context_extension',
  description='a RoPE model trained at L and extended to 8L: unchanged, PI, NTK, YaRN, '
  'and PI / direct fine-tuning at 8L',
  base='configs/rope_swiglu.py',
  variants=(
    Variant('rope'),  # the default config: its runs are the noise suite's, copied
    *(_applied(name, kind) for name, kind in (('pi', 'linear'), ('ntk', 'ntk'), ('yarn', 'yarn'))),
    Variant(
      'pi-finetune',
      overrides=_scaled('linear'),
      derived=_finetune_at_target,
      starts_from='rope',
      paper={'loss_at_8L': math.log(_PAPER_AT_4L['pi-finetune'])},
      expect='better',
    ),
    # Compared with PI fine-tuning, as the PI paper compares them (both numbers from its Table 1).
    Variant(
      'direct-finetune',
      derived=_finetune_at_target,
      starts_from='rope',
      paper={'loss_at_8L': math.log(_PAPER_AT_4L['direct-finetune'])},
      versus='pi-finetune',
    ),
  ),
  presets=PRESETS,
  metric='loss_at_8L',
  extra_metrics='context_extension',
  paper_source='Chen et al. 2023 (LLaMA 7B, PG-19, L = 2048, extended to 4L; ln ppl at 4L). At '
  'L / 2L / 4L the paper has: unchanged 7.20 / > 1e3 / > 1e3 ppl; direct fine-tune '
  '7.21 / 7.34 / 7.69; PI with 1000 steps 7.13 / 6.96 / 6.95',
)
