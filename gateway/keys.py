"""Typed aiohttp application keys: the app's shared objects, no globals."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from gateway.config import Settings
    from gateway.served_model import ServedModel

SETTINGS: web.AppKey[Settings] = web.AppKey("settings")
MODEL: web.AppKey[ServedModel] = web.AppKey("model")
