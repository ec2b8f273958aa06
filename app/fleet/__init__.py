"""Keeping every accepted request moving: ending, handing back, sweeping, reaping, reconciling pools and jobs."""
