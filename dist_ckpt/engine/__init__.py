"""The save and load orchestration: numbered steps, the commit record, checks, the registry.

The engine asks the registry for backends and never imports a concrete one; its
``distributed`` module is the only user of ``torch.distributed`` in dist_ckpt.
"""
