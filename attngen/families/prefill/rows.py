"""Shared-memory row widths of the prefill kernels' tiles (in 16-bit elements), as the templates lay them out: what
the spec's layout fields, its shared-memory sums and fp8's rows of 16-bit pairs (fp8.py) are computed from."""

from __future__ import annotations


def _row(elems: int) -> int:
    """Elements per shared-memory row of the chunked kernel's tiles: padded by 16 bytes."""
    return elems + 8


def _mma_dim(head_dim: int) -> int:
    """The width the whole-row kernel's mma.sync GEMMs run over: the head dim rounded up to 16 (a head dim of
    8 mod 16 computes over one zeroed 16-byte chunk more; templates/prefill/fwd.cuh.jinja, QK_DIM)."""
    return -(-head_dim // 16) * 16


def _smem_row(head_dim: int, swizzled: bool = True) -> int:
    """Elements per shared-memory row of the whole-row kernel's tiles: XOR-swizzled rows (a multiple
    of 64 elements, where ``swizzled``) are dense; others get one 16-byte pad past the GEMMs' width, which
    staggers the rows across the banks (an odd count of 16-byte chunks a row)."""
    return head_dim if swizzled and head_dim % 64 == 0 else _mma_dim(head_dim) + 8
