"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437, sec. 2.2: one extra depth, its loss
weighted 0.3 then 0.1) against next-token training alone, each at its own tuned learning rate, the
next-token eval loss compared. Gloeckle et al. 2024 (arXiv 2404.19737) find that multi-token
prediction hurts small models and helps large ones: expected worse at this size. Defined and
planned; not run yet."""

from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS_CPU_GELU

SUITE = Suite(
  name='mtp',
  description='next-token training vs one multi-token-prediction depth (DeepSeek-V3), each at its '
  'own learning rate, on the next-token loss',
  base='configs/base.py',
  variants=(
    Variant('next_token'),
    Variant('mtp', overrides={'model.multi_token_prediction': True}, expect='worse'),
  ),
  presets=PRESETS_CPU_GELU,
  extra_metrics='decode',  # each row's decode tokens/s and KV-cache bytes per token
  paper_source='Gloeckle et al. 2024 (multi-token prediction hurts small models, helps large ones); '
  'DeepSeek-V3 (one depth, weight 0.3 then 0.1)',
)
