"""The named configs (configs/*.py), each one's learning rate tuned on the factor-2 grid around
configs/base.py's default (3e-3, chosen with fan_in init by the `defaults` suite for
configs/rope_swiglu.py), at the size `make train` runs (d_model 256, 500 steps of 8 × 256 tokens).
A config whose best rate sits a grid step or more from the rate it ships trains off its optimum
when a user runs it as shipped; results.md's tuning table and lr_sensitivity.png say which. The
rows then compare each config at its own tuned rate with rope_swiglu (no literature expectation:
the configs differ in several choices at once). gpt2, alibi_gelu and mixtral_like ship 1.5e-3
since this suite and `named_rates` (2026-11-28); every grid stays centred on base's rate, so the
suite measures the same runs whatever a config ships."""

from configs import alibi_gelu, base, gpt2, mistral_like, mixtral_like, qwen3_like, rope_swiglu
from experiments.suite import Suite, Variant
from experiments.suites._presets import GPU, TINY

CENTER = base.get_config().train.learning_rate  # 3e-3: every config's grid is centred here

SUITE = Suite(
  name='named_configs',
  description='every named config: its own tuned learning rate against the shipped default',
  base='configs/base.py',
  variants=tuple(
    Variant(
      module.__name__.split('.')[-1], module.DEFAULTS, overrides={'train.learning_rate': CENTER}
    )
    for module in (rope_swiglu, gpt2, alibi_gelu, mistral_like, qwen3_like, mixtral_like)
  ),
  # cpu: the named configs unchanged, so the rows are what `python launch.py --config=...` trains.
  presets={'tiny': TINY, 'cpu': {}, 'gpu': GPU},
)
