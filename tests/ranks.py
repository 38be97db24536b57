"""What the multi-process TorchRec tests share: a free port for the process group, and a rank's
start (its device, one CPU thread, the process group: gloo on the CPU, NCCL on GPUs)."""

from __future__ import annotations

import os
import socket

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rank(rank: int, world: int, port: int, on_gpu: bool = False) -> torch.device:
    """Joins the process group as `rank` of `world`; returns the rank's device."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # (also keeps forked ranks out of the parent's OpenMP thread pool)
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=rank, world_size=world)
    return device
