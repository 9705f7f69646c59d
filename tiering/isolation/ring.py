"""A single-producer, single-consumer ring of byte messages in shared memory.

One process writes messages, one other process reads them, with no system
call and no lock on either side: the producer copies a length-prefixed
message behind ``tail`` and then publishes the new ``tail``; the consumer
reads messages up to the ``tail`` it sees and then publishes the new
``head``, which frees their room. Each counter has one writer, is an
aligned 8-byte word (a single store or load on x86-64, whose total store
order also keeps a message's bytes visible before the ``tail`` that covers
them) and only grows, so positions never wrap; offsets into the data area
are positions modulo its power-of-two capacity.

A full ring refuses a message (:meth:`ByteRing.try_send` returns False)
instead of waiting: the sender keeps it and tries again later, so neither
process ever blocks on the other. The ring does not wake its consumer;
:class:`~tiering.isolation.wakeup.WakeFlag` beside it does that, once per
batch.

The memory is a :class:`~tiering.primary.host_buffer.HostBuffer` (a named object
under ``/dev/shm``) that the other process attaches to by name.
"""

from __future__ import annotations

import struct

from tiering.primary.host_buffer import HostBuffer, make_shared_name

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_HEAD = 0  # next position the consumer reads (consumer writes it)
_TAIL = 64  # next position the producer writes (producer writes it); own cache line
_WAKE = 128  # the wake-up flag's word (see tiering.isolation.wakeup)
_HEADER = 4096
_LENGTH = _U32.size


class ByteRing:
    """One direction of a byte-message channel between two processes (see the module docs).

    Create it in one process (:meth:`create`), pass :attr:`name` and
    :attr:`capacity` to the other, which calls :meth:`attach`; each side then
    uses only its own half (``try_send`` on the producer, ``receive`` on the
    consumer). Not thread-safe: one thread per side.
    """

    def __init__(self, buffer: HostBuffer, capacity: int) -> None:
        self._buffer = buffer
        self._view = buffer.row(0)  # flat bytes
        self.capacity = capacity
        self._mask = capacity - 1
        self._data = self._view[_HEADER : _HEADER + capacity]
        # Each side's own counter, mirrored locally (it is the only writer of it).
        self._tail: int = _U64.unpack_from(self._view, _TAIL)[0]
        self._head: int = _U64.unpack_from(self._view, _HEAD)[0]

    @classmethod
    def create(cls, capacity: int) -> ByteRing:
        """A new ring of ``capacity`` bytes (a power of two, at least 4 KiB) in shared memory."""
        if capacity < 4096 or capacity & (capacity - 1):
            raise ValueError(f"ring capacity must be a power of two >= 4096, got {capacity}")
        buffer = HostBuffer.create(
            1, _HEADER + capacity, shared_name=make_shared_name("kvring"), require_alignment=False
        )
        return cls(buffer, capacity)

    @classmethod
    def attach(cls, name: str, capacity: int) -> ByteRing:
        """The ring ``name`` another process created with ``capacity`` bytes."""
        return cls(HostBuffer.attach(name, 1, _HEADER + capacity), capacity)

    @property
    def name(self) -> str:
        name = self._buffer.name
        assert name is not None  # created shared
        return name

    @property
    def max_message(self) -> int:
        """The largest message the ring can ever hold."""
        return self.capacity - _LENGTH

    def word(self, offset: int) -> memoryview:
        """The 8-byte header word at ``offset`` (for the wake flag beside the ring)."""
        return self._view[offset : offset + 8]

    # -- producer -----------------------------------------------------------------------------

    def try_send(self, message: bytes) -> bool:
        """Append ``message``; False (nothing written) if the ring lacks room for it now.

        Raises ``ValueError`` for a message longer than :attr:`max_message`.
        """
        size = len(message)
        if size > self.capacity - _LENGTH:
            raise ValueError(f"a {size}-byte message cannot fit a {self.capacity}-byte ring")
        tail = self._tail
        head = _U64.unpack_from(self._view, _HEAD)[0]
        if self.capacity - (tail - head) < _LENGTH + size:
            return False
        self._put(tail, _U32.pack(size))
        self._put(tail + _LENGTH, message)
        self._tail = tail = tail + _LENGTH + size
        _U64.pack_into(self._view, _TAIL, tail)  # publish: after the bytes it covers
        return True

    def _put(self, position: int, data: bytes) -> None:
        start = position & self._mask
        first = min(len(data), self.capacity - start)
        self._data[start : start + first] = data[:first]
        if first < len(data):
            self._data[: len(data) - first] = data[first:]

    # -- consumer -----------------------------------------------------------------------------

    def pending(self) -> bool:
        """Whether a message is waiting (one 8-byte read)."""
        tail: int = _U64.unpack_from(self._view, _TAIL)[0]
        return tail != self._head

    def receive(self) -> list[bytes]:
        """Every message waiting, oldest first (empty if none); frees their room."""
        tail = _U64.unpack_from(self._view, _TAIL)[0]
        head = self._head
        if tail == head:
            return []
        messages: list[bytes] = []
        while head < tail:
            size = _U32.unpack(self._get(head, _LENGTH))[0]
            messages.append(self._get(head + _LENGTH, size))
            head += _LENGTH + size
        self._head = head
        _U64.pack_into(self._view, _HEAD, head)
        return messages

    def _get(self, position: int, size: int) -> bytes:
        start = position & self._mask
        end = start + size
        if end <= self.capacity:
            return bytes(self._data[start:end])
        return bytes(self._data[start:]) + bytes(self._data[: end - self.capacity])

    # -- life cycle ---------------------------------------------------------------------------

    def unlink(self) -> None:
        """Remove the name (both sides keep their mapping); idempotent."""
        self._buffer.unlink()

    def close(self) -> None:
        """Unmap this side's view of the ring; idempotent."""
        self._data.release()
        self._view.release()
        self._buffer.close()


WAKE_WORD = _WAKE
