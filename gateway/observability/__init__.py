"""Metrics, request traces and the gateway's own process statistics."""
