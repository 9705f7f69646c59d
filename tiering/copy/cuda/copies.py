"""How a job's bytes move on a device: DMA runs and gather/scatter kernels.

Both copy functions only enqueue work on the device's current stream (see
:meth:`~tiering.copy.cuda.device.CudaDevice.on_stream`); neither waits. Their
host-side work (:func:`prepare_copies`) is done first, before a job's start event.

* :func:`dma_copy`: one copy per run of adjacent blocks on the GPU's copy
  engines (no SM is used), all runs of a tensor in one ``cudaMemcpyBatchAsync``
  call where the runtime has it (:mod:`~tiering.copy.cuda.memcpy_batch`),
  else one ``cudaMemcpyAsync`` per run. Best for large pages.
* :func:`kernel_copy`: the pinned buffer mapped into the device address space
  (a device tensor over host memory); one gather and one scatter kernel per
  tensor move every block of the job over PCIe. Best for small pages, where
  one call per block would be launch-bound. Pure tensor indexing, so its
  arithmetic also runs on CPU tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from tiering.copy.cuda.device import CudaDevice
from tiering.copy.layout import KVLayout
from tiering.copy.plan import BlockCopies, Offsets, TransferPlan, byte_runs

#: Byte runs of one entry: source starts, destination starts, lengths.
Runs = tuple[Offsets, Offsets, Offsets]


def dma_runs(
    entry: BlockCopies, layout: KVLayout, gpu_rows: torch.Tensor, gpu_to_cpu: bool
) -> Runs:
    """The byte runs :func:`dma_copy` copies for ``entry`` (host work only, no device call)."""
    gpu_off = entry.gpu_offsets(gpu_rows.stride(0))
    cpu_off = entry.cpu_offsets(layout)
    src_off, dst_off = (gpu_off, cpu_off) if gpu_to_cpu else (cpu_off, gpu_off)
    return byte_runs(src_off, dst_off, entry.nbytes)


def dma_copy(
    device: CudaDevice,
    entry: BlockCopies,
    layout: KVLayout,
    gpu_rows: torch.Tensor,
    gpu_flat: torch.Tensor,
    host_flat: torch.Tensor,
    gpu_to_cpu: bool,
    host_pinned: bool = False,
    runs: Runs | None = None,
) -> None:
    """Enqueue one copy per run of adjacent blocks of ``entry`` (in one call where batched).

    ``gpu_flat`` / ``host_flat`` are 1-D byte views of the KV tensor and of the
    primary buffer (asynchronous when the host is pinned: ``host_pinned``);
    ``runs`` are :func:`dma_runs`' answer where the caller computed them already.
    """
    src, dst = (gpu_flat, host_flat) if gpu_to_cpu else (host_flat, gpu_flat)
    starts_s, starts_d, lengths = runs or dma_runs(entry, layout, gpu_rows, gpu_to_cpu)
    device.copy_runs_async(dst, src, starts_d, starts_s, lengths, host_pinned=host_pinned)


class PreparedCopies(NamedTuple):
    """A job's host-side work (:func:`prepare_copies`), done before its start event."""

    #: Byte runs of each DMA entry, by ``id(entry)``.
    runs: dict[int, Runs]
    #: The entries copied by kernels, and all their block ids in one array (None if none).
    kernel_entries: list[BlockCopies]
    host_idx: Offsets | None


def prepare_copies(
    plan: TransferPlan,
    layout: KVLayout,
    gpu_rows: Sequence[torch.Tensor],
    uses_kernel: Callable[[BlockCopies], bool],
) -> PreparedCopies:
    """The host side of ``plan``: each DMA entry's byte runs and the kernels' index array."""
    to_cpu = plan.lane.gpu_to_cpu
    runs: dict[int, Runs] = {}
    kernel_entries: list[BlockCopies] = []
    for e in plan.copies:
        if uses_kernel(e):
            kernel_entries.append(e)
        else:
            runs[id(e)] = dma_runs(e, layout, gpu_rows[e.tensor_idx], to_cpu)
    host_idx = None
    if kernel_entries:
        # One staging array and one host-to-device copy for every index of the job.
        host_idx = np.concatenate(
            [np.concatenate((e.gpu_blocks, e.cpu_blocks, e.cpu_subblocks)) for e in kernel_entries]
        )
    return PreparedCopies(runs, kernel_entries, host_idx)


def kernel_copy(
    entry: BlockCopies,
    layout: KVLayout,
    gpu_rows: torch.Tensor,
    mapped_flat: torch.Tensor,
    gpu_idx: torch.Tensor,
    cpu_idx: torch.Tensor,
    sub_idx: torch.Tensor,
    gpu_to_cpu: bool,
) -> None:
    """One gather and one scatter kernel for all of ``entry``'s blocks.

    ``mapped_flat`` is the primary buffer as a 1-D byte tensor on the device
    (device-mapped pinned memory); the indices are ``entry``'s block ids on
    the device. Run through :meth:`CudaDevice.launch`.
    """
    t = entry.tensor_idx
    page = layout.gpu_page_bytes[t]
    pages = gpu_rows[:, : entry.nbytes]
    if layout.block_size_factor == 1:
        slots = torch.as_strided(
            mapped_flat,
            (layout.cpu_num_blocks, entry.nbytes),
            (layout.cpu_block_bytes, 1),
            layout.cpu_slot_offsets[t],
        )
        if gpu_to_cpu:
            slots.index_copy_(0, cpu_idx, pages.index_select(0, gpu_idx))
        else:
            pages.index_copy_(0, gpu_idx, slots.index_select(0, cpu_idx))
        return
    sub_slots = torch.as_strided(
        mapped_flat,
        (layout.cpu_num_blocks, layout.block_size_factor, entry.nbytes),
        (layout.cpu_block_bytes, page, 1),
        layout.cpu_slot_offsets[t],
    )
    if gpu_to_cpu:
        sub_slots.index_put_((cpu_idx, sub_idx), pages.index_select(0, gpu_idx))
    else:
        pages.index_copy_(0, gpu_idx, sub_slots[cpu_idx, sub_idx])


def gpu_block_rows(
    device: CudaDevice, tensor: torch.Tensor, page_size_bytes: int, what: str
) -> torch.Tensor:
    """A device tensor as ``(num_blocks, page_size_bytes)`` int8 rows, sharing memory.

    Raises ``TypeError`` for a tensor that is not ``device``'s memory and
    ``ValueError`` for one whose bytes cannot be viewed so without a copy.
    """
    if not isinstance(tensor, torch.Tensor) or not device.is_device_tensor(tensor):
        raise TypeError(f"{what} must be a CUDA tensor for the CUDA copy engine")
    if tensor.dtype != torch.int8:
        if tensor.ndim == 0 or tensor.stride(-1) != 1:
            raise ValueError(f"{what}: the last dimension must be contiguous")
        tensor = tensor.view(torch.int8)
    if tensor.ndim == 2 and tensor.shape[1] == page_size_bytes and tensor.stride(1) == 1:
        return tensor
    try:
        return tensor.view(-1, page_size_bytes)
    except RuntimeError as exc:
        raise ValueError(
            f"{what} of shape {tuple(tensor.shape)} cannot be viewed as rows of "
            f"{page_size_bytes} bytes without a copy"
        ) from exc


def flat_bytes(rows: torch.Tensor) -> torch.Tensor:
    """A 1-D byte view from the first to the last byte of ``rows`` (rows may be strided)."""
    span = (rows.shape[0] - 1) * rows.stride(0) + rows.shape[1]
    return torch.as_strided(rows, (span,), (1,), rows.storage_offset())
