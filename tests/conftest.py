"""Shared pytest configuration for dist_ckpt tests."""

import logging

logging.getLogger("dist_ckpt").setLevel(logging.INFO)
