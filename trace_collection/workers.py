"""The collection's workers: who this process is, its share of the chunk plan, its device, and the launch.

A collection spreads over workers through torch.distributed's launcher contract: `torchrun` (one node with
`--standalone --nproc-per-node N`, a cluster with `--nnodes`, `--rdzv-backend c10d --rdzv-endpoint HOST:PORT`)
starts the same command in every worker and gives each one `RANK`, `WORLD_SIZE`, `LOCAL_RANK` and the
rendezvous address (`MASTER_ADDR`, `MASTER_PORT`). `dscale-collect --num-workers N` is that launch on this node.

Workers exchange only control messages (rank 0's chunk plan, the final run figures) over a gloo process
group, on CPU and GPU alike; records never cross workers: each writes its own shards into the shared folder.
"""

from __future__ import annotations

import datetime
import os
from contextlib import contextmanager
from dataclasses import dataclass

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# NOTE: workers wait for the slowest one at the end (rank 0 writes the final manifest); gloo's default 30 minutes
# is shorter than an unlucky share of a long GPU run. A dead worker is the launcher's to handle: torchrun stops the
# group when one member exits, and gloo's sockets fail the survivors' collectives at once.
GROUP_TIMEOUT = datetime.timedelta(days=7)


class WorkerError(ValueError):
    """A worker launch that cannot run as configured."""


def launched() -> bool:
    """True inside a worker started by torchrun (or another launcher that sets its environment)."""
    return "WORLD_SIZE" in os.environ


def env_rank() -> int:
    """This process's rank (0 outside a launch)."""
    return int(os.environ.get("RANK", "0"))


@dataclass(frozen=True)
class Workers:
    """This worker's place in the collection; one process outside a launch."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    def share(self, work: list) -> list:
        """This worker's items of a plan every worker holds in the same order: item i goes to worker i % world."""
        return work[self.rank :: self.world]

    def device(self, device: str) -> str:
        """The torch device this worker decodes on: `cuda` becomes `cuda:<LOCAL_RANK>` (one GPU per worker); an
        explicit `cuda:i` is kept (workers then share that GPU). Makes it the current CUDA device."""
        import torch

        dev = torch.device(device)
        if dev.type != "cuda":
            return device
        if not torch.cuda.is_available():
            raise WorkerError(f"--device {device}: no CUDA device is visible to worker {self.rank}")
        index = dev.index if dev.index is not None else self.local_rank if self.world > 1 else None
        if index is None:
            return device
        if index >= torch.cuda.device_count():
            raise WorkerError(f"worker {self.rank} (LOCAL_RANK {self.local_rank}) wants cuda:{index} but this node has "
                              f"{torch.cuda.device_count()} CUDA devices; launch at most that many workers per node "
                              f"(--num-workers / torchrun --nproc-per-node)")
        # NOTE: the engine's streams and CUDA graphs are made on the current device, so it must be this one.
        torch.cuda.set_device(index)
        return f"cuda:{index}"

    def broadcast(self, obj):
        """Rank 0's `obj` on every worker."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        """Wait for every worker."""
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, obj) -> list | None:
        """Every worker's `obj`, in rank order, on rank 0 (None elsewhere)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None or not value.isdigit():
        raise WorkerError(f"environment variable {name}={value!r}: a worker launch sets {', '.join(LAUNCH_ENV)} "
                          "(torchrun does); set them all or none")
    return int(value)


@contextmanager
def worker_group(num_workers: int):
    """This process's `Workers`, with the gloo group joined for the duration (a launch of more than one worker)."""
    if not launched():
        if num_workers > 1:
            raise WorkerError(f"num_workers={num_workers}, but this process was not started by a launcher: run "
                              f"`dscale-collect --num-workers {num_workers} ...` (or torchrun), not collect() directly")
        yield Workers()
        return
    workers = Workers(*(_env_int(name) for name in LAUNCH_ENV))
    if num_workers not in (1, workers.world):
        raise WorkerError(f"--num-workers {num_workers} inside a launch of {workers.world} workers: --num-workers "
                          "launches workers on this node; under torchrun leave it at 1")
    if not 0 <= workers.rank < workers.world:
        raise WorkerError(f"RANK {workers.rank} outside WORLD_SIZE {workers.world}")
    if workers.world == 1:
        yield workers
        return
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)
    try:
        yield workers
        # NOTE: every worker's last transfer completes before any worker tears its group down; without this barrier
        # a worker that left the final broadcast first aborted at exit about one run in two (gloo, torch 2.13:
        # "terminate called without an active exception"). After an exception the peers may be gone: no barrier.
        workers.barrier()
    finally:
        dist.destroy_process_group()


def launch_local(num_workers: int, argv: list[str]) -> None:
    """`torchrun --standalone --nproc-per-node N -m trace_collection.collect ARGV` from this process."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(["--standalone", f"--nproc-per-node={num_workers}", "-m", "trace_collection.collect", *argv])
    except ChildFailedError as exc:
        ends = "; ".join(f"rank {rank}: {f.signal_name() if f.exitcode < 0 else f'exit code {f.exitcode}'}"
                         for rank, f in sorted(exc.failures.items()))
        raise SystemExit(f"dscale-collect: workers stopped ({ends}; any errors are above); the shards written so far "
                         "are kept: rerun the same command to resume") from None
