"""Initialisation schemes (`model.init`): the std of every weight matrix and lookup table.

Every weight is drawn from N(0, std²). A scheme gives the std from the model config, the weight's
role and, for a matrix, its fan-in (the input dimension it sums over):

    'table'  a lookup table: the token embedding (= the tied head), the untied head, the learned
             position table, Shaw's relative tables
    'in'     a matrix whose output stays inside its branch: q, k, v, FFN gate and up, the MoE
             router, the experts' gate and up
    'out'    a residual branch's output projection: attention out, FFN down, the experts' down

Output projections are further divided by √(2·n_layers) when `model.depth_scaled_init` (GPT-2,
Radford et al. 2019, sec. 2.3): 2·n_layers branches add their outputs to the residual stream, so
its variance at the top stays that of one branch.

Not here, under every scheme: the T5 relative-bias table keeps HF T5's d_model^-½ (a bias, not a
projection), the MoE noise router starts at zero (Shazeer et al. 2017), norm scales at 1.
"""

from __future__ import annotations

import math

from mllm.layers.parametrization import table_std_factor

ROLES = ('table', 'in', 'out')


def fixed_std(cfg, role: str, fan_in: int | None) -> float:
  """GPT-2 (Radford et al. 2019): one std, `model.init_std` (0.02, chosen for d_model 768), for
  every matrix and table, whatever its width. At d_model 128 it gives pre-activations of std
  ~0.23, where GELU / Swish / sigmoid gates are nearly linear."""
  del role, fan_in
  return cfg.init_std


def fan_in_std(cfg, role: str, fan_in: int | None) -> float:
  """LeCun et al. 1998 ("Efficient BackProp", sec. 4.6), the "standard parametrisation":
  std = 1/√fan_in, so every output of a matrix has the variance of one of its inputs. A table has
  no fan-in of its own; it gets 1/√d_model, the tied head's fan-in, so initial logits are O(1)
  (and an untied head gets the same, so tying does not change the initial scale)."""
  return (cfg.d_model if role == 'table' else fan_in) ** -0.5


def small_init_std(cfg, role: str, fan_in: int | None) -> float:
  """Nguyen & Salazar 2019 ("Transformers without Tears"), GPT-NeoX's small_init: every matrix
  and table std = √(2 / (5·d_model)), Xavier's √(2 / (fan_in + fan_out)) of the FFN's d → 4d
  projection used for all weights; below 1/√d_model, so the residual stream starts small."""
  del role, fan_in
  return math.sqrt(2 / (5 * cfg.d_model))


INIT_SCHEMES = {'fixed': fixed_std, 'fan_in': fan_in_std, 'small_init': small_init_std}


def weight_std(cfg, role: str, fan_in: int | None = None) -> float:
  """The std of a weight of `role` (ROLES) under the scheme `cfg.init` (cfg: the model config);
  `fan_in` is required for the matrices ('in', 'out')."""
  if role not in ROLES:
    raise ValueError(f'role {role!r}; allowed: {", ".join(ROLES)}')
  if role != 'table' and fan_in is None:
    raise ValueError(f'a {role!r} matrix needs its fan_in')
  std = INIT_SCHEMES[cfg.init](cfg, role, fan_in)
  if role == 'table':
    std = std * table_std_factor(cfg)  # µP: independent of the width (parametrization.py)
  if role == 'out' and cfg.depth_scaled_init:
    std = std / (2 * cfg.n_layers) ** 0.5
  return std
