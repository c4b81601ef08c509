"""The stability harness (Wortsman et al. 2023, arXiv 2309.14322): the default model swept over
two decades of learning rate, 1e-3 to 1e-1 (7 rates a factor 10^(1/3) apart, no widening), with
and without each stabiliser, on one tuning seed; then each row at its best rate on 3 paired
seeds. Per rate: the final loss, the largest attention logit and the output log Z; per row: the
LR sensitivity (experiments/stability.py). Their findings at small scale: without QK-norm the
attention logits grow at high rates and the loss degrades (Fig. 1-2: QK-layernorm flattens
the loss-vs-rate curve); without the z-loss the output logits diverge (Fig. 4: log Z drifts
negative, z-loss 1e-4 removes it and lowers the LR sensitivity); at each row's own best rate
the losses are close (expect 'same'). Soft-capping bounds the same logits another way (Gemma 2:
50 on attention, 30 on the output)."""

from experiments import diagnosis
from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS_CPU_GELU
from experiments.tuning import LrGrid

# The sweep's centre: every row's configured rate, so all share one grid (1e-3 ... 1e-1).
CENTRE = {'train.learning_rate': 1e-2}

SUITE = Suite(
  name='stability',
  description='final loss, largest attention logit and output log Z against two decades of '
  'learning rate, with and without QK-norm, z-loss and soft-capping',
  base='configs/base.py',
  variants=(
    Variant('baseline', overrides=CENTRE),
    Variant('qk_norm', overrides={**CENTRE, 'model.attention.qk_norm': True}, expect='same'),
    Variant('z_loss', overrides={**CENTRE, 'train.z_loss_coef': 1e-4}, expect='same'),
    Variant(
      'qk_norm+z_loss',
      overrides={**CENTRE, 'model.attention.qk_norm': True, 'train.z_loss_coef': 1e-4},
      expect='same',
    ),
    Variant(
      'attention_softcap',
      overrides={**CENTRE, 'model.attention.logit_softcap': 50.0},
      expect='same',
    ),
    Variant(
      'final_softcap', overrides={**CENTRE, 'model.final_logit_softcap': 30.0}, expect='same'
    ),
  ),
  lr_grid=LrGrid(points=7, ratio=10 ** (1 / 3), max_widen=0),
  presets=PRESETS_CPU_GELU,
  stability=True,
  stability_claims={
    'qk_norm': ('lr_sensitivity', 'max_attention_logit'),  # Fig. 1 and 2
    'qk_norm+z_loss': ('lr_sensitivity', 'max_attention_logit'),
    # Sec. 3.1.2, Fig. 4: z-loss lowers the LR sensitivity that output-logit divergence causes.
    # |log Z| is what the z-loss penalises: lower with it nearly by construction, so it shows the
    # loss acts, and the sensitivity is the claim that can fail.
    'z_loss': ('lr_sensitivity', 'abs_log_z'),
  },
  paper_source='Wortsman et al. 2023 (arXiv 2309.14322), Fig. 1-4: QK-layernorm removes '
  'attention-logit growth and lowers LR sensitivity; z-loss 1e-4 removes output-logit divergence; '
  'the best loss is about unchanged',
  # At 1 M tokens QK-norm trails at its best rate (+0.05): stability_tokens trains these rows 4x
  # longer, evaluated every 250 steps; recomputed from its runs at every report.
  diagnoses={
    kind: diagnosis.token_budget('stability_tokens', baseline='baseline', of='stability')
    for kind in ('qk_norm', 'qk_norm+z_loss')
  },
)
