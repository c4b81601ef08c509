"""AdamW against Muon (Jordan et al. 2024, `optax.contrib.muon`; "Muon is Scalable", Liu et al.
2025, arXiv 2502.16982, whose update-RMS matching `consistent_rms` 0.2 lets Muon take AdamW's
rate), each at its own tuned rate, on the default model: the final loss at equal tokens, and the
tokens Muon needs to reach AdamW's final loss (evaluated every 50 steps,
experiments/speedup.py). modded-nanogpt's record history (GPT-2 124M): tuned AdamW reached 3.28
val loss in about 5 B tokens, Muon in 3.25 B (~1.5x fewer); Moonshot reports ~2x compute
efficiency at scale."""

from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS_CPU_GELU

# Evaluations along the way (the speed-up reads them), over the first 512 validation windows.
EVALS = {'train.eval_every': 50}

SUITE = Suite(
  name='optimizers',
  description='AdamW vs Muon, each at its tuned rate: final loss and tokens to AdamW\'s loss',
  base='configs/base.py',
  variants=(
    Variant('adamw', 'opt=adamw', EVALS),
    Variant('muon', 'opt=muon', EVALS, expect='better'),
  ),
  presets=PRESETS_CPU_GELU,
  tokens_to_baseline=True,
  # modded-nanogpt at 124M: Muon reached tuned AdamW's 3.28 in 3.25 B tokens against ~5 B.
  tokens_to_baseline_expect={'muon': 3.25 / 5.0},
  paper_source='modded-nanogpt records (124M: ~1.5x fewer tokens than tuned AdamW to 3.28); '
  'Liu et al. 2025 (Muon is Scalable: ~2x compute efficiency)',
)
