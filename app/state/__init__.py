"""Vigil's state in Redis: every key, every script, every reader and writer of it."""
