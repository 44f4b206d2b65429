"""Sections of bench_beyond.py (tuned sizes, address guard, fallback graph set, shared pools)."""
