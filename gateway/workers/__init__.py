"""Worker process management: the model registry, each served model, its supervisor
and its IPC client.
"""
