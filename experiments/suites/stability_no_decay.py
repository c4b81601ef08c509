"""`stability`'s z-loss rows without weight decay: the experiment that says whether mllm's default
decay is why the z-loss changes nothing there. Wortsman et al. 2023 (arXiv 2309.14322) train with
an independent weight decay of 1e-4 a step (Sec. 2.1); mllm's default is AdamW's coupled decay
0.1, i.e. lr · 0.1 a step: 1e-2 at lr 1e-1, 100x theirs, which by itself shrinks the output
head's weights and so bounds log Z. In `stability`'s tuning sweep (seed 1000) the z-loss curve lay
on the baseline's at every rate (log Z 7.3-8.5, never drifting negative). Here both rows train with
no decay over the same two decades of rate: if the output logits now diverge at high rates, the
baseline's LR sensitivity rises and the z-loss lowers it (Fig. 4), and the decay explains
`stability`'s z-loss row; if not, that row's result stays unexplained by it."""

from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS_CPU_GELU
from experiments.suites.stability import CENTRE
from experiments.tuning import LrGrid

NO_DECAY = {**CENTRE, 'train.weight_decay': 0.0}

SUITE = Suite(
  name='stability_no_decay',
  description='final loss and output log Z against two decades of learning rate without weight '
  'decay, with and without the z-loss',
  base='configs/base.py',
  variants=(
    Variant('baseline', overrides=NO_DECAY),
    Variant('z_loss', overrides={**NO_DECAY, 'train.z_loss_coef': 1e-4}, expect='same'),
  ),
  lr_grid=LrGrid(points=7, ratio=10 ** (1 / 3), max_widen=0),
  presets=PRESETS_CPU_GELU,
  stability=True,
  stability_claims={'z_loss': ('lr_sensitivity', 'abs_log_z')},  # as in `stability`
  paper_source='Wortsman et al. 2023 (arXiv 2309.14322), Fig. 4: z-loss 1e-4 removes '
  'output-logit divergence and lowers the LR sensitivity (their decay: independent, 1e-4); the '
  'best loss is about unchanged',
)
