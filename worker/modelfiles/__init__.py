"""Offline model tooling, apart from the engine runtime: GGUF import, the embedded
default model, random test models and the `mlxd model` command.
"""
