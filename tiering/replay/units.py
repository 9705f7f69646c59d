"""Byte sizes for the replay tools (see :mod:`tiering.support.units`, where they live)."""

from __future__ import annotations

from tiering.support.units import format_bytes, parse_size

__all__ = ["format_bytes", "parse_size"]
