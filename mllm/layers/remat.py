"""Activation checkpointing (`model.remat`; Chen et al. 2016): which activations a layer keeps for
the backward pass. 'none' keeps all; 'full' keeps only each layer's input and recomputes the layer;
'dots' also keeps the outputs of weight matmuls (not attention scores), trading less recompute for
more memory."""

import jax

# name → the jax.checkpoint policy (None: no rematerialisation).
REMAT_POLICIES = {
  'none': None,
  'full': jax.checkpoint_policies.nothing_saveable,
  'dots': jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}
