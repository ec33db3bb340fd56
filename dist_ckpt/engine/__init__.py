"""The save and load orchestration: numbered steps, checks, reports, ``async_save()``.

The engine asks the registry (``backends/registry.py``) for backends and never imports a
concrete one; collectives come from ``dist_ckpt.collectives``, the commit record from
``dist_ckpt.record``.
"""
