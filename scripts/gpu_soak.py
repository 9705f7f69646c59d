"""A byte-exact soak of the CUDA copy engine: thousands of random jobs against a sequential model.

Each round submits a burst of random, overlapping jobs - stores, loads and
expedited loads over two KV-cache groups with padded pages, block-size factor
2, strategy ``auto`` with a switch that sends some tensors by kernel and others
by DMA - interleaved with the "model" writing GPU blocks on the compute stream
(after some queued delay, so a missing wait shows up). The worker submits
from the compute stream, as a vLLM worker does. Then it waits for the round
and compares every byte of GPU and host memory with a sequential execution of
the same round in submission order. A wrong byte is counted, reported and the
model is resynchronised, so one fault is not counted again every round.

The model never writes a block a job of the round touches (vLLM's worker never
does either); everything else is allowed to overlap.

``--device simulated`` runs it on the simulated device (CI-sized smoke);
``--device cuda`` on the GPU. Prints one line: jobs, rounds, wrong bytes.
Exit status 1 if any byte was wrong or any job failed.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

import numpy as np
import torch

from tiering.copy import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    Lane,
    make_copy_worker,
    plan_transfer,
    required_cpu_block_bytes,
)
from tiering.copy.cuda.device import CudaDevice
from tiering.copy.cuda.simulated import SimulatedCudaDevice
from tiering.core.specs import CPULoadStoreSpec, GPULoadStoreSpec

PAGES = [2048, 8192, 4096]
GROUPS = [[(0, 2048), (1, 6000)], [(2, 4096), (0, 1500)]]
GPU_BLOCKS = 96
CPU_BLOCKS = 48
FACTOR = 2


class Memory:
    """Device tensors and the host buffer, with the sequential model beside them."""

    def __init__(self, kind: str, seed: int) -> None:
        self.sim = (
            SimulatedCudaDevice(seed=seed, max_delay_s=50e-6) if kind == "simulated" else None
        )
        if kind == "cuda" and not torch.cuda.is_available():
            raise SystemExit("gpu_soak: no CUDA device here (use --device simulated)")
        gen = torch.Generator().manual_seed(seed)
        host_pages = [
            torch.randint(-128, 127, (GPU_BLOCKS, p), dtype=torch.int8, generator=gen)
            for p in PAGES
        ]
        self.gpu = [self.to_device(t) for t in host_pages]
        self.host = np.zeros((CPU_BLOCKS, required_cpu_block_bytes(PAGES, FACTOR)), np.uint8)
        self.model_gpu = [t.numpy().view(np.uint8).copy() for t in host_pages]
        self.model_host = self.host.copy()
        self.device: CudaDevice | None = self.sim
        self.compute: Any = self.sim.new_stream() if self.sim else torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return self.sim.to_device(host) if self.sim is not None else host.to("cuda")

    def on_compute(self) -> Any:
        return (
            self.sim.on_stream(self.compute)
            if self.sim is not None
            else torch.cuda.stream(self.compute)
        )

    def model_write(self, t: int, block: int, data: torch.Tensor, rng: random.Random) -> None:
        """Enqueue on the compute stream: some delay, then ``gpu[t][block] = data``."""
        rows = self.gpu[t][block]
        if self.sim is not None:
            self.sim.launch(time.sleep, rng.uniform(0, 0.002))
            self.sim.launch(rows.copy_, data)
        else:
            torch.cuda._sleep(rng.randrange(0, 2_000_000))  # type: ignore[attr-defined]
            rows.copy_(data, non_blocking=True)

    def settle(self) -> list[np.ndarray[Any, Any]]:
        """Wait for every stream; the GPU tensors' bytes on the host."""
        if self.sim is not None:
            self.sim.drain()
            return [t.numpy().view(np.uint8).copy() for t in self.gpu]
        torch.cuda.synchronize()
        return [t.cpu().numpy().view(np.uint8) for t in self.gpu]

    def close(self) -> None:
        if self.sim is not None:
            self.sim.close()


def apply(
    plan: Any, layout: Any, gpu: list[np.ndarray[Any, Any]], host: np.ndarray[Any, Any]
) -> None:
    for entry in plan.copies:
        t, n = entry.tensor_idx, entry.nbytes
        page = layout.gpu_page_bytes[t]
        base = layout.cpu_slot_offsets[t]
        for g, c, s in zip(entry.gpu_blocks, entry.cpu_blocks, entry.cpu_subblocks, strict=True):
            at = base + int(s) * page
            if plan.lane.gpu_to_cpu:
                host[c, at : at + n] = gpu[t][g, :n]
            else:
                gpu[t][g, :n] = host[c, at : at + n]


def random_specs(rng: random.Random) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
    sizes = [rng.randint(0, 6), rng.randint(0, 4)]
    if not any(sizes):
        sizes[0] = 1
    starts = [rng.randint(0, 5), rng.randint(0, 5)]
    gpu = rng.sample(range(GPU_BLOCKS), sum(sizes))
    needed = sum(-(-(n + s % FACTOR) // FACTOR) for n, s in zip(sizes, starts, strict=True) if n)
    cpu = rng.sample(range(CPU_BLOCKS), needed)
    return GPULoadStoreSpec(gpu, group_sizes=sizes, block_indices=starts), CPULoadStoreSpec(cpu)


def soak(kind: str, jobs: int, seed: int) -> tuple[int, int, int, int]:
    """Returns (jobs run, rounds, wrong bytes, failed jobs)."""
    rng = random.Random(seed)
    memory = Memory(kind, seed)
    kv = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, p) for t, p in zip(memory.gpu, PAGES, strict=True)],
        [[CanonicalKVCacheRef(t, n) for t, n in g] for g in GROUPS],
    )
    options: dict[str, Any] = {"device": memory.sim} if memory.sim is not None else {}
    worker = make_copy_worker(
        kv,
        memory.host,
        block_size_factor=FACTOR,
        engine="cuda",
        strategy="auto",
        dma_min_bytes=4096,
        **options,
    )
    layout = worker.engine.layout
    done = rounds = wrong = failed = 0
    job_id = 0
    try:
        while done < jobs:
            rounds += 1
            touched: set[int] = set()
            ids = []
            for _ in range(min(rng.randint(4, 24), jobs - done)):
                if rng.random() < 0.3:  # the model writes blocks no job of the round touches
                    free = [b for b in range(GPU_BLOCKS) if b not in touched]
                    block = rng.choice(free)
                    with memory.on_compute():
                        for t, page in enumerate(PAGES):
                            data = torch.randint(-128, 127, (page,), dtype=torch.int8)
                            memory.model_write(t, block, memory.to_device(data), rng)
                            memory.model_gpu[t][block] = data.numpy().view(np.uint8)
                gpu, cpu = random_specs(rng)
                lane = rng.choice([Lane.STORE, Lane.LOAD, Lane.LOAD_EXPEDITED])
                job_id += 1
                with memory.on_compute():
                    if lane is Lane.STORE:
                        ok = worker.submit_store(job_id, gpu, cpu)
                    else:
                        ok = worker.submit_load(
                            job_id, cpu, gpu, expedited=lane is Lane.LOAD_EXPEDITED
                        )
                if not ok:
                    failed += 1
                    continue
                plan = plan_transfer(layout, gpu, cpu, lane)
                apply(plan, layout, memory.model_gpu, memory.model_host)
                touched.update(int(b) for b in plan.gpu_block_ids)
                ids.append(job_id)
                done += 1
            worker.wait(ids, timeout=120)
            failed += sum(not r.success for r in worker.get_finished())
            actual_gpu = memory.settle()
            wrong += int(np.count_nonzero(memory.host != memory.model_host))
            for t, actual in enumerate(actual_gpu):
                wrong += int(np.count_nonzero(actual != memory.model_gpu[t]))
            # Resynchronise, so one fault is counted once.
            memory.model_host[:] = memory.host
            memory.model_gpu = [a.copy() for a in actual_gpu]
    finally:
        worker.shutdown(timeout=60)
        memory.close()
    return done, rounds, wrong, failed


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "simulated"), default="cuda")
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    start = time.monotonic()
    jobs, rounds, wrong, failed = soak(args.device, args.jobs, args.seed)
    verdict = "ok" if wrong == 0 and failed == 0 else "FAILED"
    print(
        f"soak ({args.device}): {jobs} jobs in {rounds} rounds, {wrong} wrong bytes, "
        f"{failed} failed jobs, {time.monotonic() - start:.1f} s: {verdict}"
    )
    return 0 if verdict == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
