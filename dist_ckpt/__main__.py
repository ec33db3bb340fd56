"""``python -m dist_ckpt``: the ``dist-ckpt`` command (see `dist_ckpt.cli`)."""

from dist_ckpt.cli import main

if __name__ == "__main__":  # spawned ranks re-import this module as __mp_main__: do not rerun
    raise SystemExit(main())
