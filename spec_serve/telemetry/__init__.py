"""Logs and Prometheus metrics."""
