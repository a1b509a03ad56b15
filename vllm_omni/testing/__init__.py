"""Test doubles switched on by environment variables (faults, simulated CUDA graphs and groups)."""
