"""Does the best learning rate transfer across widths? (Tensor Programs V, Yang et al. 2022,
arXiv 2203.03466, Figure 1.) The default model at widths 32, 64, 128, 256 and 512 (heads of 16,
so 2 to 32 heads), under the standard parametrization and under µP with its base at 128 (the
`cpu` preset's width), each row's rate tuned on the same factor-2 grid around 3e-3 (widened past
an edge up to twice a side), over 250 steps. Expected: under µP the best rate stays put (within a
grid step); under the standard parametrization it falls about in half per doubling of the width.
The table's lr column holds each row's best rate; each µP row is compared with the standard row
of its width.

Width 32 was added after the first four widths' table (2026-12-01): on 2 df µP's slope CI,
−0.02 [−0.70, +0.66], could not resolve the ±0.5 that reads as flat; a fifth width doubles the
spread of log2 widths and gives the fit 3 df (the CI about half as wide at the same scatter),
and a d32 run costs seconds. Both families gain it, so neither claim is fitted on other widths
than the other's.

The µP rows before 2026-12-01 left `mup.base_head_dim` at its default, base_d_model / n_heads,
which assumes the heads widen; here they multiply, so those rows scaled the scores by
√(128 / n_heads) / 16 instead of 1/√16: ×2 at d32, ×1.4 at d64, ×0.7 at d256, ×0.5 at d512
(found when µP at d32 trailed the standard parametrization by +0.42; with the fix, +0.29). Every
µP row was tuned and run again with base_head_dim 16 (d128's runs came out identical, as they
must); the old runs' ledger lines are in git at commit 69aef98, not in the ledger, which holds
the suite's runs only."""

from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS_CPU_GELU

WIDTHS = (32, 64, 128, 256, 512)
BASE_WIDTH = 128
HEAD_DIM = 16
SHORT = {'train.steps': 250, 'train.warmup_steps': 25}


def _width(d: int) -> dict:
  return {'model.d_model': d, 'model.n_heads': d // HEAD_DIM, 'model.n_kv_heads': d // HEAD_DIM}


def _variants():
  for d in WIDTHS:
    yield Variant(f'standard-d{d}', 'param=standard', _width(d))
  for d in WIDTHS:
    mup = {
      **_width(d),
      'model.parametrization.mup.base_d_model': BASE_WIDTH,
      # The heads grow in number, not size: the head dim at the base width is 16 too, so the
      # scores keep 1/√16 at every width (the setting's default, base_d_model / n_heads,
      # assumes heads that widen).
      'model.parametrization.mup.base_head_dim': HEAD_DIM,
    }
    yield Variant(f'mup-d{d}', 'param=mup', mup, versus=f'standard-d{d}')


SUITE = Suite(
  name='mup_transfer',
  description='best learning rate against width (32-512) under the standard parametrization and µP',
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
