"""The `init` suite with a GELU FFN instead of SwiGLU: whether GPT-2's fixed std 0.02, at
d_model 128, handicaps a smooth ungated activation (pre-activations of std ~√128 · 0.02 = 0.23,
where GELU is nearly linear) when each scheme has its own tuned learning rate. With `init` it
chose mllm's default initialisation."""

from experiments.suite import Suite
from experiments.suites import init

SUITE = Suite(
  name='init_gelu',
  description='initialisation schemes with a GELU FFN: fixed std 0.02 vs fan-in vs small-init, '
  'each at its own tuned learning rate',
  base='configs/rope_swiglu.py:ffn=gelu',
  variants=init.SUITE.variants,
  presets=init.SUITE.presets,
  paper_source=init.SUITE.paper_source,
)
