"""Whole-checkpoint tools used by the CLI and scripts: convert, unshard, inspect, verify, bench, demo."""
