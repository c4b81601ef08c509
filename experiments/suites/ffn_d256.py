"""Diagnosis of Bilinear's gap to ReLU (`ffn`'s one unexplained contradiction of Shazeer 2020) at
twice the width: d_model 256 (8 heads of 32, `make train`'s width) instead of the cpu preset's 128,
the same 1 M tokens. Shazeer's rows are d_model 768; if the gap is a small model's, it should
shrink as the width grows toward it, and a gap that holds or grows here says the width is not
what separates us from the paper (within a factor 2 of it, at least). Both rates are tuned again
at this width, around `ffn`'s (lr_from, retune_lr), on tuning seeds, widened up to 4 √2-steps a
side (the usual 2 left ReLU's best at the lowest rate tried: at twice the width the optimum moves
further than a longer budget moves it); 5 table seeds, as `ffn`."""

import math

from experiments.suite import Suite
from experiments.suites import ffn
from experiments.tuning import LrGrid

SUITE = Suite(
  name='ffn_d256',
  description='ReLU vs Bilinear at d_model 256 (twice the cpu preset), each rate tuned again',
  base=ffn.SUITE.base,
  variants=tuple(v for v in ffn.SUITE.variants if v.name in ('relu', 'bilinear')),
  presets={
    **ffn.SUITE.presets,
    'cpu': {**ffn.SUITE.presets['cpu'], 'model.d_model': 256},
  },
  seeds=5,
  lr_from='ffn',
  retune_lr=('relu', 'bilinear'),
  retune_grid=LrGrid(points=3, ratio=math.sqrt(2), max_widen=4),
  diagnoses_of='ffn',
  paper_source=ffn.SUITE.paper_source,
)
