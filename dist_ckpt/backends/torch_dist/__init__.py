"""The ``torch_dist`` backend: Megatron-Core's checkpoint format, built on torch.distributed.checkpoint.

Megatron-Core's default format since 2024 (its only one since 0.16), written by NeMo 2 too:
``metadata.json`` (``sharded_backend: torch_dist``), ``common.pt``, and DCP's ``.metadata`` and
``__<rank>_<n>.distcp`` files. Plain DCP directories (torchtitan, OLMo-core, ``dcp.save``: no
``metadata.json``) are read by the same code as the backend ``("dcp", 1)``.

Modules, one job each:

* `metadata` -- read ``.metadata`` with a restricted unpickler (nothing from the file runs);
* `layout` -- ShardedTensors / ShardedObjects <-> DCP keys and chunks (pure functions);
* `checksums` -- crc32c of every item written, and the manifest beside DCP's files;
* [`save`][dist_ckpt.backends.torch_dist.save] -- the save strategy, synchronous and asynchronous;
* `stream` -- whole tensors one at a time (``dist-ckpt convert --to torch_dist``);
* `read_plan` -- requests -> DCP ReadItems (DCP's own resharding helper) and a LoadPlanner;
* [`load`][dist_ckpt.backends.torch_dist.load] -- the load strategy (DCP's ``load`` and ``FileSystemReader`` do the
  reading);
* [`plain`][dist_ckpt.backends.torch_dist.plain] -- plain DCP directories: their load strategies, the common state from
  bytes entries;
* `verify` -- ``dist-ckpt verify`` of the DCP files.

Nothing is imported here: the registry imports the strategies on first use.
"""
