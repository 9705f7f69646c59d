"""Stand-in for the PyPI ``liburing`` 2026.3.x wheels on a CPU without AVX-512.

Importing works; constructing a ring dies with SIGILL, as the real wheels do
(``vmovups %zmm0`` in ``Ring.__new__``). Nothing in this project may use it.
"""

import os
import signal


def _die(*_args: object, **_kwargs: object) -> None:
    os.kill(os.getpid(), signal.SIGILL)


class Ring:
    def __new__(cls, *args: object, **kwargs: object) -> "Ring":
        _die()
        raise AssertionError("unreachable")


io_uring = Ring
io_uring_queue_init = _die
