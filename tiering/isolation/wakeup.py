"""Coalesced wake-ups across processes: a flag word in shared memory and a pipe.

The cross-process twin of :class:`~tiering.runtime.mailbox.Mailbox`. The
sender appends to the ring *before* it reads the flag, and writes one byte
to the pipe only when the flag is clear (setting it first); the receiver's
event loop watches the pipe, clears the flag *before* it empties the ring.
While the receiver is busy, sends cost no system call at all.

The flag's store and the ring counter's load on each side are not fenced
(Python has no fence), so on rare interleavings a wake-up can be missed;
the receiver therefore also looks at the ring on a short timer
(:data:`SAFETY_POLL_S`). A missed wake-up costs latency, never a message.
"""

from __future__ import annotations

import contextlib
import os

#: How often the receiver looks at the ring without being woken.
SAFETY_POLL_S = 0.005


class WakeSender:
    """The sending side: ``wake()`` after appending to the ring."""

    def __init__(self, flag: memoryview, fd: int) -> None:
        self._flag = flag
        self._fd = fd
        os.set_blocking(fd, False)

    def wake(self) -> None:
        """Wake the receiver unless a wake-up is already pending.

        Raises ``BrokenPipeError`` when the receiver's end is gone (its process died).
        """
        flag = self._flag
        if flag[0]:
            return
        flag[0] = 1
        # A full pipe holds wake-ups the receiver has not read yet: it will wake anyway.
        with contextlib.suppress(BlockingIOError):
            os.write(self._fd, b"\0")


class WakeReceiver:
    """The receiving side: call :meth:`clear` when woken, then empty the ring."""

    def __init__(self, flag: memoryview, fd: int) -> None:
        self._flag = flag
        self.fd = fd
        os.set_blocking(fd, False)

    def clear(self) -> bool:
        """Consume the pending wake-ups and clear the flag; False once the sender is gone."""
        while True:
            try:
                data = os.read(self.fd, 4096)
            except BlockingIOError:
                break
            if not data:
                self._flag[0] = 0
                return False
            if len(data) < 4096:
                break
        self._flag[0] = 0  # before the ring is emptied: see the module docstring
        return True
