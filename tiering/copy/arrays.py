"""Zero-copy byte views of KV-cache tensors and of the primary tier's host buffer.

torch is imported lazily, only when a torch tensor is actually passed in, so
``import tiering.copy`` stays torch-free.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

ByteArray = npt.NDArray[np.uint8]


def is_torch_tensor(obj: object) -> bool:
    """True for a ``torch.Tensor`` (checked without importing torch)."""
    return any(
        cls.__module__.startswith("torch") and cls.__name__ == "Tensor" for cls in type(obj).__mro__
    )


def block_rows(tensor: Any, page_size_bytes: int, what: str = "tensor") -> ByteArray:
    """A CPU tensor or array as ``(num_blocks, page_size_bytes)`` uint8 rows, sharing memory.

    Accepts a numpy array or a CPU torch tensor of any dtype whose last
    dimension is contiguous: a 2-D byte array of the right width is used as is
    (rows may be strided, as in packed layouts), anything else is reinterpreted
    as bytes and reshaped to ``(-1, page_size_bytes)``. Raises ``ValueError``
    when that is impossible without a copy, and ``TypeError`` for CUDA tensors
    (use the CUDA engine) or other objects.
    """
    if is_torch_tensor(tensor):
        if tensor.device.type != "cpu":
            raise TypeError(
                f"{what} is on {tensor.device}; the host copy engine needs CPU memory "
                f"(use the CUDA engine for GPU tensors)"
            )
        import torch

        if tensor.dtype not in (torch.int8, torch.uint8):
            if tensor.ndim == 0 or tensor.stride(-1) != 1:
                raise ValueError(f"{what}: the last dimension must be contiguous")
            tensor = tensor.view(torch.int8)
        arr: np.ndarray[Any, Any] = tensor.detach().numpy()
    elif isinstance(tensor, np.ndarray):
        arr = tensor
    else:
        raise TypeError(f"{what} must be a numpy array or a torch tensor, not {type(tensor)}")
    if arr.ndim == 0 or (arr.ndim > 0 and arr.strides[-1] != arr.itemsize):
        raise ValueError(f"{what}: the last dimension must be contiguous")
    rows = arr.view(np.uint8)
    if rows.ndim == 2 and rows.shape[1] == page_size_bytes:
        return rows
    try:
        rows = rows.reshape(-1, page_size_bytes)
    except ValueError as exc:
        raise ValueError(
            f"{what} of shape {tuple(arr.shape)} ({arr.dtype}) cannot be viewed as rows of "
            f"{page_size_bytes} bytes without a copy"
        ) from exc
    if not np.may_share_memory(rows, arr):
        raise ValueError(f"{what}: viewing it as ({-1}, {page_size_bytes}) bytes would copy it")
    return rows


def host_rows(primary: Any) -> ByteArray:
    """The primary tier's host buffer as ``(num_blocks, block_bytes)`` uint8 rows.

    Accepts a ``HostBuffer`` (anything with ``as_numpy()``), a 2-D memoryview
    or a 2-D numpy array with contiguous rows; the result shares its memory.
    """
    if hasattr(primary, "as_numpy"):
        arr = np.asarray(primary.as_numpy())
    elif isinstance(primary, memoryview | np.ndarray):
        arr = np.asarray(primary)
    else:
        raise TypeError(
            f"the primary buffer must be a HostBuffer, a memoryview or a numpy array, "
            f"not {type(primary).__name__}"
        )
    if arr.ndim != 2:
        raise ValueError(
            f"the primary buffer must be 2-D (num_blocks, block_bytes), got {arr.shape}"
        )
    if arr.strides[1] != arr.itemsize:
        raise ValueError("the primary buffer's rows must be contiguous")
    return arr.view(np.uint8)


def flat_bytes(rows: ByteArray) -> ByteArray:
    """A 1-D byte view from the first to the last byte of ``rows`` (rows may be strided)."""
    if rows.size == 0:
        return rows.reshape(-1)
    span = (rows.shape[0] - 1) * rows.strides[0] + rows.shape[1]
    return np.lib.stride_tricks.as_strided(
        rows, shape=(span,), strides=(1,), writeable=rows.flags.writeable
    )
