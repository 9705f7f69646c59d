"""Values quoted in error messages, cut to a readable length.

This module owns :func:`shown`, the one way a config value, a command-line
argument or a trace field is quoted when a message refuses it. A value can be
huge (a long string, a YAML structure that aliases expand, an integer of
thousands of digits): messages show its start, never the whole thing. It
imports nothing of ours, so every module that checks values (:mod:`tiering.support.units`,
:mod:`tiering.config.checks`, :mod:`tiering.config`) can import it at module level.
"""

from __future__ import annotations

import reprlib


class _ShortRepr(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 3 * _SHOWN_INT_DIGITS:  # past Python's digit limit repr() raises
            return f"<an integer of about {int(x.bit_length() * 0.30103)} digits>"
        return super().repr_int(x, level)


_SHOWN_INT_DIGITS = 1000
_SHOWN = _ShortRepr()
_SHOWN.maxlevel = 3
_SHOWN.maxstring = 60
_SHOWN.maxother = 80
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 4
_SHOWN.maxlong = 40


def shown(value: object) -> str:
    """``repr(value)`` cut to a readable length, for error messages.

    A config value can be huge (a long string, or a YAML structure that aliases
    expand): messages show its start, never the whole thing.
    """
    return _SHOWN.repr(value)
