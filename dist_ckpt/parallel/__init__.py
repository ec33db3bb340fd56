"""Strategies that spread reads and writes over the ranks: exchange, two-stage, fully parallel."""
