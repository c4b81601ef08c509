"""Building blocks of the transformer, one concept per file, each variant in a name → class registry."""
