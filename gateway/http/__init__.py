"""The HTTP surface: app wiring and middleware, errors, auth, slow-reader bounds,
the OpenAPI description and the operational routes (probes, status, metrics, admin).
"""
