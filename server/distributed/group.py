"""The tensor-parallel process group: backend, rendezvous, environment, device checks.

Ranks meet at a ``TCPStore`` that rank 0 opens on the loopback interface (port chosen
by the OS, so no port is guessed) and join one process group: NCCL on CUDA (rank r on
GPU r of those visible), gloo on the CPU (for tests and CPU pods).
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from kvscale.server.config import ResolvedConfig
from kvscale.server.parallel import ParallelState

STORE_HOST = "127.0.0.1"  # every rank runs on this node
# NVLink multicast (NVLS) stays off in NCCL, PyTorch symmetric memory and NVSHMEM: it can
# take a shared host's GPUs out of service. Forced in every process the engine starts.
NCCL_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
MIN_GROUP_TIMEOUT_S = 600.0  # collectives wait this long at least (loading, first compiles)


def rank_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a rank process: ``base`` (default: this process's) with
    ``NCCL_ENV`` forced and gloo on the loopback interface unless set otherwise."""
    env = dict(os.environ if base is None else base)
    env.update(NCCL_ENV)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def apply_env() -> None:
    """Applies ``rank_env`` to this process (before any process group is created)."""
    os.environ.update(rank_env())


def check_gpus(tensor_parallel_size: int, visible: int) -> None:
    """ValueError unless ``visible`` GPUs are at least ``tensor_parallel_size``."""
    if visible < tensor_parallel_size:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={shown!r})" if shown is not None else ""
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs {tensor_parallel_size} GPUs "
            f"on this node, one per rank, but {visible} {'is' if visible == 1 else 'are'} "
            f"visible{where}; request {tensor_parallel_size} GPUs for the pod or lower "
            "tensor_parallel_size"
        )


def rank_config(config: ResolvedConfig, rank: int) -> ResolvedConfig:
    """``config`` as rank ``rank`` runs it: on GPU ``rank`` (or the CPU)."""
    device = torch.device(config.device)
    if device.type == "cuda":
        return replace(config, device=f"cuda:{rank}")
    return config


def group_timeout(config: ResolvedConfig) -> dt.timedelta:
    return dt.timedelta(seconds=max(MIN_GROUP_TIMEOUT_S, config.engine.watchdog_timeout))


def open_store(world_size: int, timeout: dt.timedelta) -> Any:
    """Rank 0's rendezvous store on the loopback interface; its ``port`` is the OS's pick."""
    return dist.TCPStore(
        STORE_HOST, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False
    )


def join_group(
    config: ResolvedConfig, rank: int, store: Any = None, port: int | None = None
) -> ParallelState:
    """Joins the process group as ``rank`` (rank 0 passes its ``store``, the others the
    store's ``port``) and returns the ``ParallelState`` of the default group. Selects
    the rank's GPU first on CUDA; splits the CPU cores between ranks on the CPU."""
    world = config.engine.tensor_parallel_size
    timeout = group_timeout(config)
    if dist.is_initialized():
        import gc

        gc.collect()  # a tensor-parallel engine no longer referenced leaves its group
        if dist.is_initialized():
            raise RuntimeError(
                "this process already belongs to a process group (another tensor-parallel "
                "engine runs here): shut it down first (LLM.engine.core.shutdown())"
            )
    device = torch.device(rank_config(config, rank).device)
    if store is None:
        assert port is not None
        store = dist.TCPStore(STORE_HOST, port, world, is_master=False, timeout=timeout)
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # the NCCL communicator is created now, not mid-step
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=world,
        timeout=timeout,
        **kwargs,
    )
    return ParallelState(rank, world, None)


def cpu_threads_per_rank(world_size: int) -> int:
    """CPU ranks share this node's cores: each gets its share (at least one thread)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


def leave_group(backend_is_nccl: bool, timeout_s: float = 10.0) -> None:
    """Destroys the default process group so that another can be made in this process.
    NCCL's teardown can hang after CUDA-graph capture (pytorch#115388): it runs in a
    daemon thread, given up on after ``timeout_s``."""
    if not dist.is_initialized():
        return
    if not backend_is_nccl:
        dist.destroy_process_group()
        return
    import threading

    t = threading.Thread(target=dist.destroy_process_group, daemon=True)
    t.start()
    t.join(timeout_s)
