"""What a suite is: one base config, named variants, the metrics to report, the paper's numbers.

A suite is a small Python file in experiments/suites/ that defines `SUITE = Suite(...)`; adding a
suite is adding that file. The first variant is the baseline the others are compared with.
Presets size every run of a suite: `tiny` (seconds, for tests), `cpu` (2 cores), `gpu` (one H100).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable

from experiments.tuning import BUDGET_GRID, LrGrid

PRESETS = ('tiny', 'cpu', 'gpu')


@dataclasses.dataclass(frozen=True)
class Variant:
  """One row: config choices (e.g. 'ffn=geglu') and/or dotted overrides on the suite's base."""

  name: str
  choices: str = ''
  overrides: dict = dataclasses.field(default_factory=dict)
  paper: dict = dataclasses.field(default_factory=dict)  # metric -> the paper's number
  # Overrides that depend on the preset's sizes: the resolved config -> dotted overrides.
  derived: Callable | None = None
  # Another (earlier) variant whose trained parameters this one starts from, same seed: it
  # fine-tunes them under its own config (train.init_from), or with trains=False only evaluates
  # them under its own config (e.g. a RoPE scaling applied at inference).
  starts_from: str = ''
  trains: bool = True
  # Tune this variant's learning rate (experiments/tuning.py) when the suite is tuned. A
  # starts_from variant is never tuned itself: it inherits its parent's tuned rate.
  tune: bool = True
  # The literature's direction against the baseline where `paper` has no number for both:
  # 'better', 'worse' or 'same' (results.md then says whether this suite agrees).
  expect: str = ''
  # The row this one is compared with (its Δ, test and the literature's direction); '' : the
  # suite's baseline. E.g. direct fine-tuning against PI fine-tuning, as the PI paper compares.
  versus: str = ''
  # Its noise family: rows measuring another kind of number (e.g. the loss at 4x the training
  # context) name one, and each family's seed noise is pooled apart (stats.contrasts); a row
  # compared across families uses its own paired differences.
  noise: str = ''


@dataclasses.dataclass(frozen=True)
class Suite:
  name: str
  description: str
  base: str  # a config spec, e.g. 'configs/rope_swiglu.py'
  variants: tuple[Variant, ...]
  presets: dict  # preset -> dotted overrides applied to every variant
  metric: str = 'eval_loss'  # the compared metric; lower is better
  # Table seeds 0 .. seeds-1 unless --seeds says otherwise: a suite whose power needs more (the
  # noise floor, ffn) says so here, so that a plain re-run does not report fewer.
  seeds: int = 3
  # Tuning seeds per grid point unless --tune_seeds says otherwise (a headline table tunes on 2).
  tune_seeds: int = 1
  paper_source: str = ''  # where the paper's numbers come from
  extra_metrics: str | None = None  # a name in experiments/measures.py, run after each run
  lr_grid: LrGrid = dataclasses.field(
    default_factory=LrGrid
  )  # the per-variant learning-rate grid (--tune_lr)
  # Another suite whose tuned rates its same-named variants take instead of tuning here (e.g. a
  # longer-training copy of some of its rows, where a grid would cost 4x).
  lr_from: str = ''
  # variant -> why its result departs from the paper (experiments/diagnosis.py): the runs it
  # rests on and the comparison the report recomputes from them.
  diagnoses: dict = dataclasses.field(default_factory=dict)
  # variant -> a Diagnosis whose finding results.md prints under the table whatever the row's
  # verdict: what another suite found of this row (e.g. the row's contradiction at 4x the tokens,
  # where this table sees none), recomputed on every report.
  notes: dict = dataclasses.field(default_factory=dict)
  # A diagnosis suite: the suite whose rows it re-measures (e.g. 4x the tokens). Its rows are
  # listed as evidence for that suite's diagnoses in overview.md, not scored against the
  # literature a second time.
  diagnoses_of: str = ''
  # A method check: the suite whose rows it repeats under another method (bfloat16 compute), run
  # for run, to show the method leaves that suite's answers alone (python -m
  # experiments.precision); it tests no paper, so overview.md leaves it out of its tallies.
  checks_method_of: str = ''
  # Variants whose tuned rate is refined on a half-step grid over two tuning seeds (as
  # --refine_lr does), where a verdict turned on the factor-2 grid's resolution.
  refine_lr: tuple[str, ...] = ()
  # (With lr_from) variants whose borrowed rate is tuned again at this suite's budget, on
  # `retune_grid` centred on it; the table runs at that best.
  retune_lr: tuple[str, ...] = ()
  # experiments/tuning.py's BUDGET_GRID, or a wider one where the suite moves the optimum further
  # than a longer budget does (another width: ffn_d256).
  retune_grid: LrGrid = BUDGET_GRID
  # The stability harness (experiments/stability.py): results.md reports each variant's LR
  # sensitivity and, per rate, the final loss, largest attention logit and log Z; stability.png
  # plots them against the rate (Wortsman et al. 2023, Figures 1-4).
  stability: bool = False
  # (With stability) variant -> the measures the paper says it lowers against the baseline:
  # 'lr_sensitivity', 'max_attention_logit', 'abs_log_z' (experiments/stability.MEASURES).
  stability_claims: dict = dataclasses.field(default_factory=dict)
  # Each variant's steps to the baseline's final eval loss, seed by seed (experiments/speedup.py;
  # the runs evaluate during training).
  tokens_to_baseline: bool = False
  # {variant: the paper's steps to the baseline's final loss over the baseline's}: a claim each,
  # scored and counted (speedup.claims).
  tokens_to_baseline_expect: dict = dataclasses.field(default_factory=dict)
  # {family: {variant: width}}: each family's best rate against the width and its fitted slope
  # (experiments/transfer.py; Tensor Programs V, Fig. 1).
  lr_transfer: dict = dataclasses.field(default_factory=dict)
  # {family: the paper's slope of log2(best rate) per doubling of the width}: a claim each,
  # scored and counted (transfer.claims).
  lr_transfer_expect: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    names = [v.name for v in self.variants]
    if self.tune_seeds < 1:
      raise ValueError(f'suite {self.name!r}: tune_seeds={self.tune_seeds}; allowed: >= 1')
    if len(set(names)) != len(names):
      raise ValueError(f'suite {self.name!r}: variant names repeat: {names}')
    for i, v in enumerate(self.variants):
      if v.starts_from and v.starts_from not in names[:i]:
        raise ValueError(
          f'suite {self.name!r}: variant {v.name!r} starts_from={v.starts_from!r}; '
          f'allowed: an earlier variant ({", ".join(names[:i]) or "none"})'
        )
      if v.expect not in ('', 'better', 'worse', 'same'):
        raise ValueError(
          f"suite {self.name!r}: variant {v.name!r} has expect={v.expect!r}; "
          "allowed: 'better', 'worse', 'same' or ''"
        )
      if (v.versus and v.versus not in names) or v.versus == v.name:
        raise ValueError(
          f'suite {self.name!r}: variant {v.name!r} has versus={v.versus!r}; allowed: another '
          f'variant ({", ".join(n for n in names if n != v.name)})'
        )
      if not v.trains and not v.starts_from:
        raise ValueError(
          f'suite {self.name!r}: variant {v.name!r} has trains=False but no '
          'starts_from; allowed: a starts_from variant to take the parameters of'
        )

    tuned = [v.name for v in self.variants if v.tune and not v.starts_from]
    if self.retune_lr and (not self.lr_from or set(self.retune_lr) - set(tuned)):
      raise ValueError(
        f'suite {self.name!r}: retune_lr={self.retune_lr}; allowed: with lr_from, variants it '
        f'takes a tuned rate for ({", ".join(tuned) or "none"})'
      )

    from experiments.diagnosis import Diagnosis

    claims = {f'{v}: {m}' for v, measures in self.stability_claims.items() for m in measures}
    claims |= {f'{family}: slope' for family in self.lr_transfer_expect}
    claims |= {f'{variant}: steps' for variant in self.tokens_to_baseline_expect}
    if set(self.tokens_to_baseline_expect) - set(names[1:]):
      raise ValueError(
        f'suite {self.name!r}: tokens_to_baseline_expect names '
        f'{sorted(self.tokens_to_baseline_expect)}; allowed: variants other than the baseline '
        f'({", ".join(names[1:]) or "none"})'
      )
    if set(self.lr_transfer_expect) - set(self.lr_transfer):
      raise ValueError(
        f'suite {self.name!r}: lr_transfer_expect names {sorted(self.lr_transfer_expect)}; '
        f'allowed: families of lr_transfer ({", ".join(self.lr_transfer) or "none"})'
      )
    for name, diagnosis in {**self.diagnoses, **self.notes}.items():
      if (name not in names and name not in claims) or not isinstance(diagnosis, Diagnosis):
        raise ValueError(
          f'suite {self.name!r}: diagnoses[{name!r}] = {diagnosis!r:.60}; allowed: a '
          'Diagnosis (experiments/diagnosis.py) of one of its variants or of a claim '
          "('variant: measure', 'family: slope', 'variant: steps')"
        )

  @property
  def baseline(self) -> Variant:
    return self.variants[0]

  def reference(self, variant: Variant) -> Variant:
    """The row `variant` is compared with: its `versus`, else the baseline."""
    return next(v for v in self.variants if v.name == (variant.versus or self.baseline.name))


@dataclasses.dataclass(frozen=True)
class BenchmarkSuite:
  """A suite that is a benchmark rather than training runs: `<module>.main(argv)` with the
  preset's arguments writes the table (results.md), its rows (results.json) and a plot into the
  suite's folder. Seeds do not apply."""

  name: str
  description: str
  module: str  # e.g. 'benchmarks.attention'
  presets: dict  # preset -> command-line arguments of the module
  paper_source: str = ''


def available() -> list[str]:
  """The names of the suites in experiments/suites/."""
  from experiments import suites

  return sorted(m.name for m in pkgutil.iter_modules(suites.__path__) if not m.name.startswith('_'))


def load_suite(name: str) -> Suite | BenchmarkSuite:
  """The suite `name`, or ValueError naming the ones there are."""
  if name not in available():
    raise ValueError(f'suite {name!r} does not exist; allowed: {", ".join(available())}')
  return importlib.import_module(f'experiments.suites.{name}').SUITE
