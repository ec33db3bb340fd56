"""The checks a save or load makes before touching data, each in its own module.

* [`sharding`][dist_ckpt.engine.checks.sharding] -- do the main replicas of every tensor cover it exactly once?
* [`strict`][dist_ckpt.engine.checks.strict] -- requested keys vs stored keys (the ``StrictHandling`` modes);
* `common_state` -- does the common state agree across ranks?
* `compatibility` -- which load strategies fit the checkpoint's ``metadata.json``?
* `key_hints` -- when a load request fails: which mistyped key caused it, which stored key it meant?

The checks are pure functions over per-rank metadata (``global_metadata[rank]`` is the list of
that rank's shards without data), so they are tested without processes; the collective
wrappers gather metadata to rank 0 once, check there, and raise the same error on every rank.
"""
