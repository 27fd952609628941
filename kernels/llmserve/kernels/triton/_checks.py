"""Argument checks shared by the kernel wrappers: every launch is preceded by these, so a
bad call fails with a ValueError naming the argument instead of reading stray memory."""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    last_dim_contiguous: bool = True,
    contiguous: bool = False,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} dtype {t.dtype} not in {[str(d) for d in dtypes]}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()})")
    if last_dim_contiguous and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride on its last dim (strides {t.stride()})")


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int | None]) -> None:
    """None in `shape` matches any size."""
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        want = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{name} shape {tuple(t.shape)} does not match {want}")


def check_same_dtype(**tensors: torch.Tensor) -> None:
    dtypes = {n: t.dtype for n, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        raise ValueError(f"dtype mismatch: {dtypes}")


def check_power_of_two(name: str, n: int, lo: int = 1) -> None:
    if n < lo or n & (n - 1):
        raise ValueError(f"{name} must be a power of two >= {lo}, got {n}")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
