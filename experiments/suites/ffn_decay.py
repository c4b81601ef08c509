"""Diagnosis of Bilinear's gap to ReLU (`ffn`'s one unexplained contradiction of Shazeer 2020):
the same two rows without weight decay (`train.weight_decay` 0, against 0.1 in `ffn`).

Weight decay is the one optimizer setting every row shares untuned. AdamW shrinks each matrix by
lr · wd a step; the bilinear hidden unit xW ⊗ xV is a product of two decayed matrices (of degree
2 in the weights where ReLU's relu(xW) is of degree 1), so the same decay pulls harder on its
function. If the gap closes here, the shared decay is what costs Bilinear at this size; if it
stays, decay is ruled out. Both rates are tuned again without decay, around `ffn`'s (lr_from,
retune_lr), on tuning seeds; 5 table seeds, as `ffn` has, to resolve a gap of its +0.064."""

from experiments.suite import Suite
from experiments.suites import ffn

SUITE = Suite(
  name='ffn_decay',
  description='ReLU vs Bilinear without weight decay (0 against 0.1), each rate tuned again',
  base=ffn.SUITE.base,
  variants=tuple(v for v in ffn.SUITE.variants if v.name in ('relu', 'bilinear')),
  presets={
    name: {**overrides, 'train.weight_decay': 0.0} for name, overrides in ffn.SUITE.presets.items()
  },
  seeds=5,
  lr_from='ffn',
  retune_lr=('relu', 'bilinear'),
  diagnoses_of='ffn',
  # Scored here too: the same contradiction as ffn's Bilinear row, with its unexplained record.
  diagnoses={'bilinear': ffn.SUITE.diagnoses['bilinear']},
  paper_source=ffn.SUITE.paper_source,
)
