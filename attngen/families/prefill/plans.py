"""The prefill ops' plans: what a call needs that depends only on its plan key (the kernels by query rows, the
allocators), made once per key and shared by the dense, varlen and fp8 paths."""

from __future__ import annotations

from ...errors import LaunchError
from ...runtime import allocator, get_kernel
from ...tuned import stored_choices
from ..choice import device_facts
from ..host import OpMemo, Plan
from .checks import _MASKS
from .choose import CUSTOM_MASK, base_spec, scales_exactly, sync_twin, table
from .spec import Pipeline
from .tma import tensor_maps


class _Plan(Plan):
    """Everything a call needs that does not depend on its shapes (``kernel_for``: by seqlen_q): ``host.Plan``'s,
    an int32 allocator (varlen work lists) and the TMA kernels' cp.async twins."""

    __slots__ = ("alloc_index", "tma_pinned", "sync_twins")

    def sync_twin(self, kern):
        """The cp.async kernel of ``kern``'s tiles, for inputs no TMA map can describe (``kern`` runs
        pipeline=tma and the caller did not ask for it); of its KV tiles on two warpgroups where ``kern`` has
        three (the cp.async kernel has no 12-warp form)."""
        twin = self.sync_twins.get(kern.key)
        if twin is None:
            twin = self.sync_twins[kern.key] = get_kernel(sync_twin(kern.spec), device=self.device)
        return twin

    def mod_kernel(self, qi, ki):
        """The kernel a mask_mod plan's call of these shapes runs, where the caller gave no spec (a custom-mask
        plan with a mask_mod, whose table ``_make_plan`` does not load): its spec by query rows, in its ``mod_bits``
        form where the plan's pool can hold every tile's keep bits (``masks.bits_form``). Only that one is compiled:
        a first call's time is its compile."""
        from .masks import bits_form, mod_cells

        spec = self.spec_for(qi.shape[1])
        bits = bits_form(spec, mod_cells(spec, qi.shape, ki.shape))
        return get_kernel(spec.replace(mod_bits=True) if bits else spec, device=self.device)

    def tma_maps(self, kern, qi, ki, vi):
        """(the kernel to launch, its tensor maps or None): ``kern`` and the maps of q, k, v where ``kern`` runs
        pipeline=tma and the driver can describe them; where it cannot, the cp.async twin (a refusal is raised
        only to a caller who asked for TMA); ``kern`` itself without the TMA pipeline."""
        if not kern.spec.tma:
            return kern, None
        try:
            return kern, tensor_maps(qi, ki, vi, kern.spec)
        except LaunchError:
            if self.tma_pinned:
                raise
            return self.sync_twin(kern), None


def _make_plan(key: tuple) -> _Plan:
    d, dtype, device, mask, return_lse, spec, kind, softcap, alibi, layout, dv, sinks, *mods = key
    scaled = bool(mods) and len(mods[0]) > 3  # (mods_key)
    mods = [m[:3] for m in mods]
    base = base_spec(d, dtype, _MASKS[mask], return_lse, spec, softcap, alibi, layout, dv, sinks, *mods)
    plan = _Plan()
    # the choice's specs by query rows (choose.choose, whose size-independent part a plan keeps)
    tuned = tuple(stored_choices(base, device)) if spec is None else ()
    # (a mask_mod plan's call without a spec chooses its kernel's form by its shapes: mod_kernel)
    lazy = spec is None and layout == CUSTOM_MASK and bool(mods and mods[0][1])
    plan.setup(table(base, device_facts(device).arch, spec is None, tuned, scaled), device, kind, dtype,
               load=not lazy)
    plan.tma_pinned = spec is not None and spec.pipeline is Pipeline.TMA
    plan.sync_twins = {}
    plan.alloc_index = allocator(kind, "int32", device)
    return plan


_memo = OpMemo(_make_plan)
_plans, _calls = _memo.plans, _memo.calls  # key -> _Plan; key -> _Call (runtime.keep_call)


def clear_plans() -> None:
    _plans.clear()


def mods_key(mods, sm_scale: float) -> tuple:
    """A plan key's snippets: () for none; else their (score_mod, mask_mod, aux) text, with True after it where a
    score_mod's call has an sm_scale that ``scales_exactly`` (its plan's specs take q_scaled where they fit)."""
    if mods is None:
        return ()
    return (mods[:3] + ((True,) if mods[0] and scales_exactly(sm_scale) else ()),)


def plan_for(key: tuple) -> _Plan:
    """The ``_Plan`` of ``key`` (d, dtype, device, mask code, return_lse, spec, kind, softcap, alibi,
    layout, v's head dim, sinks, and where a call has snippets ``mods_key``'s), made on first use."""
    return _plans.get(key) or _memo.plan(key)
