"""Checkpoint formats, one package each: strategies that save and load the sharded state.

Backends never import each other; the engine finds them through the registry (``registry.py``).
"""
