"""Tensors as (meta, bytes): how a tensor travels in every pickle of ours, both ways.

A tensor that can travel as its raw bytes (`shippable`) leaves the pickle stream as a flat
uint8 buffer and a small meta tuple (`tensor_meta`: dtype, shape, requires_grad, whether a
Parameter, its device type). The receiving side builds a tensor of its own from them
(`build`), or writes the new bytes into a tensor it holds already (`write_into`), so that
every object holding that tensor sees them. Its digest (`digest`) says whether its bytes
changed.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch

from . import writewatch


def shippable(obj: Any) -> bool:
    """Whether `obj` is a tensor that travels as its bytes (anything else pickles as usual)."""
    return (
        type(obj) in (torch.Tensor, torch.nn.Parameter)
        and obj.layout == torch.strided
        and obj.device.type in ("cpu", "cuda")
        and not obj.is_quantized
        and not obj.is_neg()
        and not obj.is_conj()
    )


def tensor_bytes(tensor: torch.Tensor) -> tuple[np.ndarray, tuple]:
    """The tensor's elements as a flat uint8 array (a view when it can be) and its meta.

    A view is sent as its own elements, not its base's whole storage; on the workers it
    becomes a tensor of its own.
    """
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous()
    array = data.reshape(-1).view(torch.uint8).numpy() if data.numel() else np.empty(0, np.uint8)
    return array, tensor_meta(tensor)


def tensor_meta(tensor: torch.Tensor) -> tuple:
    requires_grad = tensor.requires_grad and tensor.grad_fn is None  # non-leaf: just data
    return (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), requires_grad,
            type(tensor) is torch.nn.Parameter, tensor.device.type)


def build(meta: tuple, buffer, device: torch.device | None, copy: bool = True) -> torch.Tensor:
    dtype_name, shape, requires_grad, is_parameter, device_type = meta
    dtype = getattr(torch, dtype_name)
    # The received frame may be read-only and owned by the transport: copy it into
    # memory the tensor owns (one memcpy per worker), unless the caller copies it itself.
    if not copy and memoryview(buffer).readonly:
        copy = True
    raw = (torch.frombuffer(bytearray(buffer) if copy else buffer, dtype=torch.uint8) if len(buffer)
           else torch.empty(0, dtype=torch.uint8))
    tensor = (raw.view(dtype) if raw.numel() else torch.empty(0, dtype=dtype)).reshape(shape)
    if device_type == "cuda" and device is not None and device.type == "cuda":
        tensor = tensor.to(device)  # a notebook GPU tensor lands on this rank's GPU
    if is_parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def digest(tensor: torch.Tensor, array: np.ndarray) -> bytes:
    """The digest of `array`, `tensor`'s bytes: their chunks hashed only if they were
    written since they were last hashed (see writewatch)."""
    return writewatch.watch().digest(tensor, array)


def write_into(held: torch.Tensor, meta: tuple, buffer) -> torch.Tensor:
    """`held` with the bytes of `buffer`: the same object, so everything holding it sees them."""
    if type(held).__name__ == "DTensor":  # sharded since it was received: this rank's part of the new value
        from torch.distributed.tensor import DTensor, distribute_tensor

        sharded = cast(DTensor, held)  # its type's name says so
        whole = build(meta, buffer, held.device)
        if tuple(whole.shape) != tuple(held.shape):
            raise RuntimeError(f"a sharded tensor of shape {tuple(held.shape)} cannot take a new value of shape "
                               f"{tuple(whole.shape)}; %scale restart starts afresh")
        with torch.no_grad():
            sharded.to_local().copy_(distribute_tensor(whole.detach(), sharded.device_mesh, sharded.placements,
                                                       src_data_rank=None).to_local())
        return held
    writewatch.will_write(held)
    if _copy_into(held, meta, buffer):
        return held
    fresh = build(meta, buffer, held.device)
    with torch.no_grad():
        if held.shape == fresh.shape and held.dtype == fresh.dtype:
            held.copy_(fresh)
        else:
            held.data = fresh.data.to(held.device)
    if held.is_leaf:
        held.requires_grad_(fresh.requires_grad)
    return held


def _copy_into(held: torch.Tensor, meta: tuple, buffer) -> bool:
    """Write new bytes straight into a held CPU tensor of the same layout (one memcpy)."""
    dtype_name, shape, requires_grad, _, _ = meta
    if (held.device.type != "cpu" or not held.is_contiguous() or tuple(held.shape) != tuple(shape)
            or str(held.dtype).removeprefix("torch.") != dtype_name or held.requires_grad != requires_grad):
        return False
    if held.numel():
        with torch.no_grad():
            held.detach().reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(buffer, np.uint8)
    return True
