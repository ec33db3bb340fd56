"""Asynchronous saves: the request queue, the background writer process and snapshots."""
