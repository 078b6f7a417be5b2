"""The host path every op shares: check -> plan -> launch, with what can be worked out once kept.

An op keeps two memos (``OpMemo``). Its plans, by a key of what does not change between calls of one kind of
problem (head dims, dtype, device, masks, the caller's spec, array kind): a ``Plan`` holds the kernels its
family's choice function runs by size (``choice.SizeTable``, loaded on first use), the device's facts, the
allocators and the stream getter, made once. Its calls, by a key of the operands' infos and every other
argument (where the op keeps them): what a call with those launches (checks passed, kernel, grids,
parameters but its own allocations' pointers), for the last few hundred (``runtime.keep_call``). A repeated
call then reads its operands' infos, looks up its call, allocates its outputs and launches.
"""

from __future__ import annotations

import functools
from typing import Callable

from ..runtime import (TunedKernels, allocator, current_stream, keep_call, register_dependent_cache,
                       torch_stream_getter)
from .choice import device_facts

# The softmax runs in base 2: the kernels take the scale times log2(e) beside the scale itself.
LOG2E = 1.4426950408889634


class Plan(TunedKernels):
    """What a call needs that depends only on its plan key: the kernels by size (``TunedKernels``), the
    device's facts (``choice.DeviceFacts``), allocators of the op's dtype and of fp32, and the stream getter
    (device -> the caller's current stream)."""

    __slots__ = ("facts", "alloc", "alloc_f32", "stream")

    def setup(self, table, device: int, kind: str, dtype: str, load: bool = True) -> None:
        """Run ``table`` (``TunedKernels.take``: a table of one spec loaded now, unless ``load`` is false) for
        arrays of ``kind`` and ``dtype`` on ``device``; without a table (an op whose choice runs per call) the plan
        holds no kernels."""
        self.facts = device_facts(device)
        self.kernel, self.device = None, device
        if table is not None:
            self.take(table, device, load)
        self.alloc = allocator(kind, dtype, device)
        self.alloc_f32 = allocator(kind, "fp32", device)
        self.stream = torch_stream_getter() if kind == "torch" else functools.partial(current_stream, "cupy")


class OpMemo:
    """An op's plans (``plan(key)``, made by ``make(key)`` on first use) and calls (``calls``, kept by
    ``keep``); both cleared with the loaded kernels (``runtime.clear_loaded``)."""

    __slots__ = ("plans", "calls", "make")

    def __init__(self, make: Callable):
        self.plans: dict = register_dependent_cache({})
        self.calls: dict = register_dependent_cache({})
        self.make = make

    def plan(self, key):
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = self.make(key)
        return plan

    def keep(self, key, call, flags: tuple = (), numbers: tuple = ()) -> None:
        """Remember ``call`` under ``key`` (None: not kept) where its flags and numbers are plain values."""
        keep_call(self.calls, key, call, flags=flags, numbers=numbers)
