"""Initialisation schemes (`model.init`, mllm/layers/parametrization.py) on the default config, each at its
own tuned learning rate: GPT-2's fixed std 0.02 (tuned for d_model 768), fan-in 1/sqrt(fan_in),
and the small-init of Nguyen & Salazar 2019 (sqrt(2/(5d))). This suite chose mllm's default."""

from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS

SUITE = Suite(
  name='init',
  description='initialisation schemes: fixed std 0.02 vs fan-in vs small-init, each at its own '
  'tuned learning rate',
  base='configs/rope_swiglu.py',
  variants=tuple(
    Variant(scheme, overrides={'model.init': scheme})
    for scheme in ('fixed', 'fan_in', 'small_init')
  ),
  presets=PRESETS,
  paper_source='Nguyen & Salazar 2019 (small-init trains better than Xavier at small width); '
  'the GPT-2 value 0.02 is ~0.55/sqrt(768)',
)
