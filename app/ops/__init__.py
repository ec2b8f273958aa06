"""Operator tools: the `vigil` command, status, request views, batch files, the configuration reference."""
