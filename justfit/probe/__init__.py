"""Latency probe: sweep decode budgets x contexts x KV on/off, find anomalous regimes, save maps.

Nothing here imports MLX at import time; backends import it when they are built.
"""
