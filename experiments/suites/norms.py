"""Normalization: LayerNorm vs RMSNorm vs partial RMSNorm (Zhang & Sennrich 2019) for quality and
step time; Pre-LN vs Post-LN across three learning rates, with and without warm-up (Xiong et al.
2020: Post-LN without warm-up trains badly, Pre-LN does not need it), with each layer's FFN
gradient norm at initialisation and after training (their Fig. 3). Step times under contention-free
conditions: benchmarks/variants.py --axis=norm."""
from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS


def _warmup(on: bool):
  return lambda config: {'train.warmup_steps': config.train.steps // 10 if on else 0}


# The baseline (rmsnorm, Pre-LN) runs at lr 3e-3 with 10% warm-up.
_KINDS = tuple(Variant(kind, f'norm={kind}', derived=_warmup(True))
               for kind in ('rmsnorm', 'layernorm', 'partial_rmsnorm'))

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
    # 14 variants × 3 seeds: 300 steps a run keeps the cpu suite under 90 minutes (--jobs=2).
    presets={**PRESETS, 'cpu': {**PRESETS['cpu'], 'train.steps': 300}},
    extra_metrics='layer_grad_norms',
    paper_source='Zhang & Sennrich 2019 (RMSNorm 6.9% faster than LayerNorm per step, same '
                 'quality); Xiong et al. 2020 (Post-LN without warm-up: BLEU 8.45 vs ~34)',
)
