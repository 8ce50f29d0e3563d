"""The device layer: which device a rank computes on, and what differs between device
types -- pinned host memory and asynchronous copies, synchronizing, random generators.
Code outside the communication layer asks here instead of testing ``device.type``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

# (CPU generator state, the device generator's state or None)
RngState = tuple[torch.Tensor, torch.Tensor | None]


def resolve(device: torch.device | str | int) -> torch.device:
    """``device`` with its index: ``"cuda"`` alone is the current CUDA device; an int n,
    ``cuda:n``."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


# What launchers other than torchrun call the node-local rank: srun, Open MPI, MPICH /
# Intel MPI. torchrun's LOCAL_RANK comes first.
LOCAL_RANK_VARIABLES = (
    "LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
)  # fmt: skip


def default_device(
    device: torch.device | str | int | None, world_size: int | None = None
) -> torch.device:
    """The compute device of this rank, made the current CUDA device (object collectives,
    barriers and NCCL's communicator use the current device: left at cuda:0, every rank
    of a node would put them on GPU 0).

    The one given with its index (an int n: ``cuda:n``). Else -- ``None``, or ``"cuda"``
    without an index, which names the device type, not a GPU -- without CUDA the CPU
    (``None``), and with CUDA this rank's GPU, from the first evidence of:

    - a current device other than 0 (torch cannot say whether ``torch.cuda.set_device``
      was called, so cuda:0 proves nothing);
    - exactly one visible device, or ``world_size`` 1 (default: the default process
      group's, 1 without one): the current device;
    - the device the default process group was bound to (``init_process_group(device_id=)``);
    - the launcher's node-local rank (:data:`LOCAL_RANK_VARIABLES`: torchrun, srun,
      mpirun);

    else ``RuntimeError``: guessing cuda:0 would put every rank of a node on one GPU.
    """
    if device is not None:
        given = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if given.type != "cuda":
            return given
        if given.index is not None:
            return _make_current(given)
    elif not torch.cuda.is_available():
        return torch.device("cpu")
    return _make_current(_this_ranks_gpu(world_size))


def _make_current(device: torch.device) -> torch.device:
    if device.index != torch.cuda.current_device():
        torch.cuda.set_device(device)
    return device


def _this_ranks_gpu(world_size: int | None) -> torch.device:
    """This rank's GPU when the user named none (see :func:`default_device`)."""
    current, visible = torch.cuda.current_device(), torch.cuda.device_count()
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    if current != 0 or visible == 1 or world_size == 1:
        return torch.device("cuda", current)
    bound = _bound_device()
    if bound is not None:
        return bound
    for name in LOCAL_RANK_VARIABLES:
        if name in os.environ:
            local = int(os.environ[name])
            if not 0 <= local < visible:
                raise RuntimeError(
                    f"fsdp_lite: {name}={local} names a GPU this rank cannot see: "
                    f"{visible} are visible. Launch one process per visible GPU, or call "
                    "torch.cuda.set_device(...) before wrapping, or pass device= to "
                    "FSDPModule."
                )
            return torch.device("cuda", local)
    raise RuntimeError(
        f"fsdp_lite cannot tell which GPU this rank should use: {visible} GPUs are visible, "
        f"the world size is {world_size}, the current CUDA device is 0 (torch's default, "
        "maybe never set), the default process group is bound to no device, and no "
        f"launcher's local rank is set ({', '.join(LOCAL_RANK_VARIABLES)}). Call "
        "torch.cuda.set_device(local_rank) before wrapping, or pass device= to FSDPModule "
        "(or init_process_group(device_id=...))."
    )


def _bound_device() -> torch.device | None:
    """The CUDA device the default process group was bound to, if any."""
    if not dist.is_initialized():
        return None
    bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
    if bound is None or bound.type != "cuda" or bound.index is None:
        return None
    return bound


def new_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A stream of its own on a CUDA device; None elsewhere (one queue, nothing to
    overlap)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream | None, *inputs: torch.Tensor) -> Iterator[None]:
    """Queue the block's work on ``stream`` (a :func:`new_stream`), after what the current
    stream has queued so far; ``inputs``, made on the current stream, stay allocated until
    ``stream`` is past them. ``None``: the block runs as is."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    for t in inputs:
        t.record_stream(stream)
    with torch.cuda.stream(stream):
        yield


def mark(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """An event at the end of the work queued so far on ``stream`` (None: None)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def wait_mark(event: torch.cuda.Event | None) -> None:
    """Make the current stream wait for a :func:`mark` (without blocking the host)."""
    if event is not None:
        torch.cuda.current_stream(event.device).wait_event(event)


def synchronize(device: torch.device) -> None:
    """Wait until the device has finished the work queued on its current stream."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def pins_host_memory(device: torch.device) -> bool:
    """Are host buffers copied to and from ``device`` pinned, and those copies
    asynchronous? (CUDA: yes; between CPU tensors there is nothing to overlap.)"""
    return device.type == "cuda"


# Process-wide by nature: one upload stream per device, shared by every model (a stream per
# model would only add streams competing for the same copy engine).
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def upload(host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, object | None]:
    """``host`` copied to ``device``, and what :func:`wait` takes before ``host`` may be
    written again. From pinned memory to CUDA the copy runs on a side stream, so it
    overlaps the compute queued before it; the current stream waits for it before its
    next op, and the copy's memory stays reserved until the current stream is past it.
    Elsewhere a plain copy (None to wait for)."""
    if not (pins_host_memory(device) and host.is_pinned()):
        return host.to(device), None
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    current = torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        out = host.to(device, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    current.wait_stream(stream)
    out.record_stream(current)
    return out, done


def wait(event: object | None) -> None:
    """Block the host until an :func:`upload` has read its source."""
    if event is not None:
        event.synchronize()


def rng_state(device: torch.device) -> RngState:
    """The CPU generator's state, and ``device``'s generator's when it has its own."""
    if device.type == "cpu":
        return torch.get_rng_state(), None
    return torch.get_rng_state(), torch.get_device_module(device).get_rng_state(device)


def set_rng_state(state: RngState, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.get_device_module(device).set_rng_state(state[1], device)
