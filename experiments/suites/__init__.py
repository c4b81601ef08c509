"""One file per suite, each defining SUITE (experiments/suite.py)."""
