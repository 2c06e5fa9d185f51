"""Shared test helpers: run and compare trainings (runs.py); torchrun workers (dist_*.py)."""
