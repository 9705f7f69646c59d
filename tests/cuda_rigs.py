"""The devices the CUDA copy engine's tests run on, behind one small interface.

Every test of ``tests/test_copy_cuda.py`` runs on the simulated device
(:class:`~tiering.copy.cuda.simulated.SimulatedCudaDevice`, everywhere) and
on the real GPU where one exists; a :class:`Rig` gives both the same verbs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import numpy as np
import pytest
import torch

from tests.test_copy_layout import expected_copies
from tiering.copy import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CopyWorker,
    make_copy_worker,
    required_cpu_block_bytes,
)
from tiering.copy.cuda.device import CudaDevice
from tiering.copy.cuda.pins import PinRegistry
from tiering.copy.cuda.simulated import SimulatedCudaDevice
from tiering.primary.host_buffer import HostBuffer

#: What the host buffer holds where no copy may write.
SENTINEL = 0x5A
GPU_BLOCKS = 40
CPU_BLOCKS = 24

#: KV-cache shapes: ``(pages, groups)``, each group ``[(tensor, unpadded bytes), ...]``.
#: Unpadded sizes below the page are the padded pages of real models.
ONE_GROUP = ([4096], [[(0, 3000)]])
TWO_GROUPS = ([2048, 4096], [[(0, 2048), (1, 3000)], [(1, 4096)]])
THREE_GROUPS = ([2048, 4096, 1024], [[(0, 2048)], [(1, 3500), (2, 1000)], [(2, 1024), (0, 1800)]])
#: Unpadded sizes of odd and 2-byte multiples (2,047 and 3,002 bytes): no alignment to lean on.
ODD_BYTES = ([2048, 4096], [[(0, 2047)], [(1, 3002)]])
SHAPES = {
    "1-group": ONE_GROUP,
    "2-groups": TWO_GROUPS,
    "3-groups": THREE_GROUPS,
    "odd-bytes": ODD_BYTES,
}
#: Blocks per group in the round trips, and the request block each group starts at.
GROUP_SIZES = [5, 3, 4]
GROUP_STARTS = [3, 1, 2]


class Rig:
    """One device as the tests drive it."""

    name = "abstract"
    #: The device passed to the engine (None: the engine's default, the real GPU).
    device: CudaDevice | None = None

    def tensor(self, host: torch.Tensor) -> torch.Tensor:
        """A device copy of ``host``."""
        raise NotImplementedError

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def new_stream(self) -> Any:
        raise NotImplementedError

    def on(self, stream: Any) -> AbstractContextManager[Any]:
        """Make ``stream`` the current stream (the model's compute stream) in the block."""
        raise NotImplementedError

    def slow_fill(self, rows: torch.Tensor, value: int) -> None:
        """Enqueue, on the current stream, tens of ms of work and then ``rows.fill_(value)``."""
        raise NotImplementedError

    def is_pinned(self, host: np.ndarray[Any, Any]) -> bool:
        """Whether every byte of ``host`` is page-locked (registered) now."""
        raise NotImplementedError

    def device_with_pins(self, pins: PinRegistry) -> CudaDevice:
        """A device of this rig whose registrations go through ``pins``."""
        raise NotImplementedError

    def register_elsewhere(self, host: np.ndarray[Any, Any]) -> Callable[[], None]:
        """Register ``host`` as another library would; returns its unregistration."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class SimulatedRig(Rig):
    name = "simulated"

    def __init__(self, **options: Any) -> None:
        self.sim = SimulatedCudaDevice(**options)
        self.device = self.sim

    def tensor(self, host: torch.Tensor) -> torch.Tensor:
        return self.sim.to_device(host)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        self.sim.drain()
        return tensor.clone()

    def new_stream(self) -> Any:
        return self.sim.new_stream()

    def on(self, stream: Any) -> AbstractContextManager[Any]:
        return self.sim.on_stream(stream)

    def slow_fill(self, rows: torch.Tensor, value: int) -> None:
        def work() -> None:
            time.sleep(0.03)
            rows.fill_(value)

        self.sim.launch(work)

    def is_pinned(self, host: np.ndarray[Any, Any]) -> bool:
        return self.sim.registered_bytes(host.ctypes.data, host.nbytes) == host.nbytes

    def device_with_pins(self, pins: PinRegistry) -> CudaDevice:
        self.sim.pins = pins
        return self.sim

    def register_elsewhere(self, host: np.ndarray[Any, Any]) -> Callable[[], None]:
        assert self.sim.register_host(host.ctypes.data, host.nbytes) == 0

        def unregister() -> None:
            assert self.sim.unregister_host(host.ctypes.data) == 0

        return unregister

    def close(self) -> None:
        self.sim.close()


class CudaRig(Rig):
    name = "cuda"

    def tensor(self, host: torch.Tensor) -> torch.Tensor:
        return host.to("cuda")

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        torch.cuda.synchronize()
        return tensor.cpu()

    def new_stream(self) -> Any:
        return torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def on(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def slow_fill(self, rows: torch.Tensor, value: int) -> None:
        torch.cuda._sleep(50_000_000)  # type: ignore[attr-defined]  # tens of ms of "model" work
        rows.fill_(value)

    def is_pinned(self, host: np.ndarray[Any, Any]) -> bool:
        return bool(torch.from_numpy(host).is_pinned())

    def device_with_pins(self, pins: PinRegistry) -> CudaDevice:
        from tiering.copy.cuda.torch_device import TorchCudaDevice

        device = TorchCudaDevice("cuda")
        device.pins = pins
        return device

    def register_elsewhere(self, host: np.ndarray[Any, Any]) -> Callable[[], None]:
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        code = cudart.cudaHostRegister(host.ctypes.data, host.nbytes, 0)
        assert int(getattr(code, "value", code)) == 0

        def unregister() -> None:
            code = cudart.cudaHostUnregister(host.ctypes.data)
            assert int(getattr(code, "value", code)) == 0

        return unregister


RIG_KINDS = ["simulated", "cuda"]


def make_rig(kind: str) -> Rig:
    if kind == "simulated":
        return SimulatedRig(seed=7)
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False on this machine)")
    return CudaRig()


@contextmanager
def rig_for(kind: str) -> Iterator[Rig]:
    rig = make_rig(kind)
    try:
        yield rig
    finally:
        rig.close()


class KVRig:
    """KV tensors of one shape on a device, a host buffer and a worker over both."""

    def __init__(
        self,
        rig: Rig,
        shape: tuple[list[int], list[list[tuple[int, int]]]],
        *,
        factor: int = 1,
        seed: int = 0,
        host: HostBuffer | None = None,
        **engine_options: Any,
    ) -> None:
        self.rig = rig
        self.pages, self.groups = shape
        gen = torch.Generator().manual_seed(seed)
        self.gpu = [
            rig.tensor(torch.randint(-128, 127, (GPU_BLOCKS, p), dtype=torch.int8, generator=gen))
            for p in self.pages
        ]
        kv = CanonicalKVCaches(
            [CanonicalKVCacheTensor(t, p) for t, p in zip(self.gpu, self.pages, strict=True)],
            [[CanonicalKVCacheRef(t, n) for t, n in g] for g in self.groups],
        )
        self._owns_host = host is None
        if host is None:
            host = HostBuffer.create(CPU_BLOCKS, required_cpu_block_bytes(self.pages, factor))
            host.as_numpy()[:] = SENTINEL
        self.host = host
        if rig.device is not None:
            engine_options.setdefault("device", rig.device)
        self.worker: CopyWorker = make_copy_worker(
            kv, self.host, block_size_factor=factor, engine="cuda", **engine_options
        )

    @property
    def layout(self) -> Any:
        return self.worker.engine.layout

    def close(self) -> None:
        self.worker.shutdown(timeout=30)
        if self._owns_host:
            self.host.close()


def split(ids: list[int], sizes: list[int]) -> list[list[int]]:
    out, pos = [], 0
    for n in sizes:
        out.append(ids[pos : pos + n])
        pos += n
    return out


def check_host_rows(
    layout: Any,
    gpu: list[np.ndarray[Any, Any]],
    host: np.ndarray[Any, Any],
    group_ids: list[list[int]],
    starts: list[int],
    cpu_ids: list[int],
) -> None:
    """Every planned copy landed, byte-exact, and nothing else of the host changed."""
    written = np.zeros(host.shape, dtype=bool)
    for t, g, c, sub, n in expected_copies(layout, group_ids, starts, cpu_ids):
        start = layout.cpu_slot_offsets[t] + sub * layout.gpu_page_bytes[t]
        assert np.array_equal(host[c, start : start + n], gpu[t][g, :n].view(np.uint8)), (
            f"tensor {t}, GPU block {g} -> CPU block {c}.{sub}"
        )
        written[c, start : start + n] = True
    assert np.all(host[~written] == SENTINEL), "bytes outside the planned copies changed"


def wait_all(worker: CopyWorker, job_ids: list[int]) -> list[Any]:
    worker.wait(job_ids, timeout=60)
    results = worker.get_finished()
    assert sorted(r.job_id for r in results) == sorted(job_ids)
    return results
