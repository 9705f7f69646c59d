"""The CUDA copy engine and the device seam it runs on.

- :mod:`~tiering.copy.cuda.engine`: :class:`CudaCopyEngine`, a stream per lane,
  events per job, the ordering between lanes;
- :mod:`~tiering.copy.cuda.copies`: how bytes move (DMA runs, gather/scatter kernels);
- :mod:`~tiering.copy.cuda.pins`: page-locking the primary buffer (reference counts, chunks);
- :mod:`~tiering.copy.cuda.device`: :class:`CudaDevice`, the seam: all the engine asks
  of a GPU;
- :mod:`~tiering.copy.cuda.torch_device`: the real device, through ``torch.cuda``;
- :mod:`~tiering.copy.cuda.simulated`: a simulated device in host memory, with faults.

Importing this package imports torch (``tiering.copy`` alone does not).
"""

from tiering.copy.cuda.copies import dma_copy, flat_bytes, gpu_block_rows, kernel_copy
from tiering.copy.cuda.device import CudaDevice, DeviceEvent, DeviceStream
from tiering.copy.cuda.engine import (
    DEFAULT_DMA_MIN_BYTES,
    CudaCopyEngine,
    CudaCopyJob,
    Strategy,
)
from tiering.copy.cuda.pins import PinRegistry

__all__ = [
    "DEFAULT_DMA_MIN_BYTES",
    "CudaCopyEngine",
    "CudaCopyJob",
    "CudaDevice",
    "DeviceEvent",
    "DeviceStream",
    "PinRegistry",
    "Strategy",
    "dma_copy",
    "flat_bytes",
    "gpu_block_rows",
    "kernel_copy",
]
