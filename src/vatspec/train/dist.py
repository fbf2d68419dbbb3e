"""torchrun: the process group training starts (and destroys), and metrics averaged over ranks."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from vatspec.train.errors import TrainError


def dist_setup(device_pref: str) -> tuple[int, int, torch.device, bool]:
    """``(rank, world, device, owned)``: ``owned`` when this call started the process group (under torchrun
    without one), which ``train_arms`` then destroys before it returns."""
    from vatspec.target import resolve_device

    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        device = resolve_device(device_pref, "target.device")
    except ValueError as e:
        raise TrainError(str(e)) from None
    owned = world > 1 and not dist.is_initialized()
    if owned:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if device.type == "cuda" and device.index is None:  # one GPU per rank
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local), owned
    return rank, world, device, owned


def all_reduce_mean(values: dict, world: int) -> dict:
    """Mean over ranks of every number in ``values`` (scalars and lists of numbers)."""
    if world == 1 or not values:
        return values
    keys = sorted(values)
    flat = [float(x) for k in keys for x in (values[k] if isinstance(values[k], list) else [values[k]])]
    t = torch.tensor(flat, dtype=torch.float64)
    dist.all_reduce(t)
    means, out, i = (t / world).tolist(), {}, 0
    for k in keys:
        n = len(values[k]) if isinstance(values[k], list) else 1
        out[k] = means[i : i + n] if isinstance(values[k], list) else means[i]
        i += n
    return out


def broadcast_flag(flag: bool, world: int) -> bool:
    """Rank 0's ``flag`` on every rank (one process: ``flag`` itself)."""
    if world == 1:
        return flag
    t = torch.tensor([float(flag)])
    dist.broadcast(t, 0)
    return bool(t.item())


def barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def release_group(owned: bool) -> None:
    """Destroy the process group ``dist_setup`` started (``owned``), after every rank got here: one left
    to the interpreter's exit can abort it there (gloo: "terminate called without an active exception")."""
    if owned:
        dist.barrier()
        dist.destroy_process_group()
