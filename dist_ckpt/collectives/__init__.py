"""Collectives: the only user of ``torch.distributed``, which ranks failed, shard metadata exchange.

Every layer above asks ``distributed`` for the rank, the world size and collectives that turn an
error on one rank into the same error on every rank; a single process needs no process group.
"""
