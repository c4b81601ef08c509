"""Does the best learning rate transfer across widths? (Tensor Programs V, Yang et al. 2022,
arXiv 2203.03466, Figure 1.) The default model at widths 64, 128, 256 and 512 (heads of 16, so
4 to 32 heads), under the standard parametrization and under µP with its base at 128 (the
`cpu` preset's width), each row's rate tuned on the same factor-2 grid around 3e-3 (widened past
an edge up to twice a side), over 250 steps. Expected: under µP the best rate stays put (within a
grid step); under the standard parametrization it falls about in half per doubling of the width.
The table's lr column holds each row's best rate; each µP row is compared with the standard row
of its width."""

from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS_CPU_GELU

WIDTHS = (64, 128, 256, 512)
BASE_WIDTH = 128
SHORT = {'train.steps': 250, 'train.warmup_steps': 25}


def _width(d: int) -> dict:
  return {'model.d_model': d, 'model.n_heads': d // 16, 'model.n_kv_heads': d // 16}


def _variants():
  for d in WIDTHS:
    yield Variant(f'standard-d{d}', 'param=standard', _width(d))
  for d in WIDTHS:
    mup = {**_width(d), 'model.parametrization.mup.base_d_model': BASE_WIDTH}
    yield Variant(f'mup-d{d}', 'param=mup', mup, versus=f'standard-d{d}')


SUITE = Suite(
  name='mup_transfer',
  description='best learning rate against width (64-512) under the standard parametrization and µP',
  base='configs/base.py',
  variants=tuple(_variants()),
  presets={
    name: {**preset, **SHORT} if name == 'cpu' else preset
    for name, preset in PRESETS_CPU_GELU.items()
  },
  lr_transfer={kind: {f'{kind}-d{d}': d for d in WIDTHS} for kind in ('standard', 'mup')},
  # TP5 Sec. 1 and Fig. 1: under Adam the standard parametrization's best rate scales as
  # 1/width (halves per doubling); µP's stays put.
  lr_transfer_expect={'standard': -1.0, 'mup': 0.0},
  paper_source='Yang et al. 2022 (Tensor Programs V), Fig. 1: under µP the best rate is flat '
  'across widths; under the standard parametrization it shifts',
)
