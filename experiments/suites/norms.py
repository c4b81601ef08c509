"""Normalization: LayerNorm vs RMSNorm vs partial RMSNorm (Zhang & Sennrich 2019) for quality and
step time; Pre-LN vs Post-LN across three learning rates, with and without warm-up (Xiong et al.
2020: Post-LN without warm-up trains badly, Pre-LN does not need it)."""
from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS

_KINDS = (Variant('rmsnorm', 'norm=rmsnorm'), Variant('layernorm', 'norm=layernorm'),
          Variant('partial_rmsnorm', 'norm=partial_rmsnorm'))


def _warmup(on: bool):
  return lambda config: {'train.warmup_steps': config.train.steps // 10 if on else 0}


# The baseline (rmsnorm, Pre-LN) runs at lr 3e-3 with 10% warm-up (configs/base.py's 50 of 500).
_PLACEMENTS = tuple(
    Variant(f'{placement}-lr{lr:g}-{"warmup" if warmup else "no_warmup"}',
            f'norm=rmsnorm,placement={placement}', {'train.learning_rate': lr},
            derived=_warmup(warmup))
    for placement in ('pre', 'post') for lr in (1e-3, 3e-3, 1e-2) for warmup in (True, False)
    if (placement, lr, warmup) != ('pre', 3e-3, True))  # that one is the baseline itself

SUITE = Suite(
    name='norms',
    description='LayerNorm / RMSNorm / partial RMSNorm; Pre-LN vs Post-LN x learning rate x warm-up',
    base='configs/base.py:pos=rope,ffn=swiglu,placement=pre',
    variants=_KINDS + _PLACEMENTS,
    presets=PRESETS,
    paper_source='Zhang & Sennrich 2019 (RMSNorm 6.9% faster than LayerNorm per step, same '
                 'quality); Xiong et al. 2020 (Post-LN without warm-up: BLEU 8.45 vs ~34)',
)
