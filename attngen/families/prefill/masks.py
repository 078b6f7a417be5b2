"""Custom masks for ``attngen.prefill``: the plan of live KV tiles, built on the GPU, and its checks.

A plan belongs to one mask and to the tile sizes of the kernel that walks it. It is built by
three entries of that kernel's own module (templates/prefill/plan.cuh) on the caller's
stream, with no host sync: the mask as bits, per (mask batch/head, query tile) the list of KV
tiles some row sees (custom mask, causal and window together) with a bit for "the mask keeps
all of it", and the (mask batch/head, query tile) items sorted heaviest first.

A ``mask_mod``'s block plan (``build_mod``) is the same lists with no mask tensor: its first entry
(templates/prefill/mod_plan.cuh) evaluates the snippet on each tile's pairs, per batch row only where the snippet
names ``b`` and per head only where it names ``h`` (``snippets.reads_batch_head``). Where the snippet reads an aux
tensor (``reads_aux``) it also keeps the bits of the tiles it keeps in part in a pool of ``pool_tiles`` slots
(``POOL_BYTES`` at most), which the kernel reads there rather than run the snippet (an aux read a pair); a partial tile
past the pool runs it.
"""

from __future__ import annotations

import struct

from ...errors import LaunchError
from ...runtime import allocator, data_ptr, get_kernel, tensor_info
from ..snippets import mod_layout, reads_aux, reads_batch_head

# PlanParams: 11 pointers, 4 strides, 14 ints, then the serving plan's 3 pointers and int (varlen.launch_order; mask
# plans pass zeros), padded to the struct's 8-byte alignment.
PLAN_PARAMS = struct.Struct("<11Q4q14i3Qi4x")
NO_SERVING = (0, 0, 0, 0)
# A mask_mod plan's pool: a slot a partial tile (BLOCK_M rows of BLOCK_N / 32 words), for every (unit, query tile,
# KV tile) cell where that fits POOL_BYTES (the kernel's mod_bits form: pool_slots, bits_form), else for a quarter of
# them and at least POOL_MIN_TILES, within POOL_BYTES. A mask_mod keeps a tile in part where its boundaries cross it
# (a document's ends, a prefix's), on the order of a tile a row of tiles and boundary; a mask whose tiles are mostly
# partial fills a quarter, and its other partial tiles run mask_mod in the kernel.
POOL_BYTES = 64 << 20
POOL_MIN_TILES = 1024
_MASK_KINDS = {"bool": 0, "fp16": 1, "bf16": 2, "fp32": 3}
_MASK_DIMS = "[seqlen_q, seqlen_k], [batch, 1, seqlen_q, seqlen_k] or [batch, heads, seqlen_q, seqlen_k]"


def _version(x) -> int:
    """torch's in-place modification counter (CuPy arrays have none: -1)."""
    return getattr(x, "_version", -1)


class MaskPlan:
    """The live-tile lists of one mask (a mask tensor, or a mask_mod's block plan) for one tile size, on the GPU:
    what ``attngen.mask_plan`` returns (it is not built directly). Reusable for every call with the same mask (or
    mask_mod and aux tensors, unchanged), shapes, ``causal``/``window`` and tile sizes; ``live_counts()``,
    ``live_fraction()``, ``tile_states()`` and (a mask_mod's: the partial tiles whose keep bits it holds)
    ``pooled_tiles()`` read it."""

    __slots__ = ("kind", "device", "tiles", "seqlen_q", "seqlen_k", "units_b", "units_h", "mask_mode",
                 "mask_ptr", "mask_shape", "mask_strides", "version", "num_q_tiles", "num_kv_tiles",
                 "bits_words", "_buf", "_at", "mods", "pool_tiles")

    def __init__(self, *args, **kwargs):
        # A plan is only as good as the GPU buffers build() fills in: an empty one would reach a
        # launch with no tile lists, so it cannot be made by hand.
        raise TypeError("attngen.MaskPlan is not built directly: attngen.mask_plan(mask, q, k, causal=..., "
                        "window=..., spec=...) builds one on the GPU and returns it")

    def __repr__(self) -> str:
        if not all(hasattr(self, n) for n in ("tiles", "seqlen_q", "seqlen_k", "units_b", "units_h", "device")):
            return "MaskPlan(<not built>)"  # e.g. made through object.__new__: say so rather than raise
        return (f"MaskPlan(tiles={self.tiles[0]}x{self.tiles[1]}, seqlen_q={self.seqlen_q}, "
                f"seqlen_k={self.seqlen_k}, units={self.units_b}x{self.units_h}, device={self.device})")

    def launch_args(self, heads: int, batch: int) -> tuple[tuple[int, int, int], tuple]:
        """(grid, the PrefillParams fields past the dense ones) for a call with these heads/batch."""
        hpi = heads if self.units_h == 1 else 1
        bpi = batch if self.units_b == 1 else 1
        units = self.units_b * self.units_h
        at = self._at
        return ((units * self.num_q_tiles, hpi, bpi),
                (0, 0, 0, at["work"], 0, at["bits"], at["tiles"], at["counts"], 0, self.seqlen_q * self.bits_words,
                 0, 0, 0, 0, self.bits_words, self.num_kv_tiles, self.num_q_tiles, self.units_h, self.units_b))

    def pool_args(self) -> tuple[int, int]:
        """The kernel's ``mod_bits`` and ``mod_slots`` (params.cuh) of a mask_mod plan: its pool and slots."""
        return (self._at["pool"], self._at["slots"]) if self.pool_tiles else (0, 0)

    @property
    def cells(self) -> int:
        """The plan's (unit, query tile, KV tile) cells."""
        return self.units_b * self.units_h * self.num_q_tiles * self.num_kv_tiles

    def holds_every_tile(self) -> bool:
        """Whether the pool has a slot for every (unit, query tile, KV tile) cell: a kernel of ``mod_bits=true`` can
        then read every partial tile's keep bits."""
        return self.pool_tiles >= self.cells

    def pooled_tiles(self) -> tuple[int, int]:
        """(the partial tiles a mask_mod plan found, the slots of its pool) (reading it waits for the plan): a
        partial tile with a slot has its keep bits read by the kernel; past the slots it runs mask_mod there.
        (0, 0) for a mask tensor's plan and a mask_mod's that reads no aux tensor."""
        if not self.pool_tiles:
            return 0, 0
        return int(self._part("pool_used", 1)[0]), self.pool_tiles

    def live_counts(self):
        """Live KV tiles per (mask batch * heads, query tile), an int32 array ``[units, q tiles]``
        of the caller's kind (reading it waits for the plan)."""
        n = self.units_b * self.units_h * self.num_q_tiles
        return self._part("counts", n).reshape(self.units_b * self.units_h, self.num_q_tiles)

    def tile_states(self):
        """Per (unit, query tile, KV tile) what the plan found, a host (numpy) int32 array ``[units, q tiles, kv
        tiles]`` (reading it waits for the plan): 0 no row sees a key of the tile, 1 some do, 2 the custom mask (or
        mask_mod) keeps every pair of it (a mask_mod's plan: every pair the causal/window mask leaves)."""
        cells = self.cells
        raw = self._part("states", -(-cells // 4))
        import numpy as np  # the states are bytes: viewed as such on the host

        host = raw.cpu().numpy() if hasattr(raw, "cpu") else raw.get()
        states = host.view(np.uint8)[:cells].astype(np.int32) & 3
        return states.reshape(self.units_b * self.units_h, self.num_q_tiles, self.num_kv_tiles)

    def live_fraction(self) -> float:
        """The fraction of (query tile, KV tile) pairs the kernel visits (syncs)."""
        total = self.cells
        return float(self.live_counts().sum()) / total if total else 0.0

    def _part(self, name: str, n: int):
        """``n`` int32 of the plan's buffer from where ``name`` starts."""
        base = data_ptr(self._buf, self.kind)
        i = (self._at[name] - base) // 4
        return self._buf[i:i + n]

    def check(self) -> None:
        """Raise ``LaunchError`` if the mask was additive with a value other than 0 and -inf (such
        values count as 0 there). Syncs, so it is left to the caller."""
        if self.num_q_tiles and self.num_kv_tiles and int(self._part("flags", 1)[0]):
            raise LaunchError("mask held values other than 0 and -inf; an additive mask is 0 (keep) or -inf "
                              "(mask), its other values are read as 0")


def mask_info(mask, b: int, h: int, sq: int, sk: int, kind: str, device: int):
    """(TensorInfo, units_b, units_h, batch stride, head stride) of a mask for a call with these sizes."""
    mi = tensor_info(mask, "mask")
    if mi.kind != kind or mi.device != device:
        raise LaunchError(f"mask must be a {kind} array on device {device}; got {mi.kind} on device {mi.device}")
    if mi.dtype not in _MASK_KINDS:
        raise LaunchError(f"mask has dtype {mi.dtype}; allowed: bool (True keeps) or additive fp16, bf16, fp32 "
                          f"(0 keeps, -inf masks)")
    shape, st = tuple(mi.shape), mi.strides
    if len(shape) == 2:
        shape, st = (1, 1, *shape), (0, 0, *st)
    if len(shape) != 4 or shape[0] not in (1, b) or shape[1] not in (1, h) or shape[2:] != (sq, sk):
        raise LaunchError(f"mask has shape {tuple(mi.shape)}; expected {_MASK_DIMS} with batch={b}, heads={h}, "
                          f"seqlen_q={sq}, seqlen_k={sk}")
    if sk > 1 and st[3] != 1:
        raise LaunchError(f"mask has stride {st[3]} in its last dim; it must be contiguous in the keys")
    ub = b if shape[0] > 1 and st[0] else 1
    uh = h if shape[1] > 1 and st[1] else 1
    return mi, ub, uh, st[0], st[1], st[2]


def _new_plan(kern, qi, ki, ub: int, uh: int, mcode: int, left: int, right: int, bits_words, what: str,
              pooled: bool = False) -> MaskPlan:
    """A plan of ``ub`` x ``uh`` units for ``kern``'s tiles with its buffer allocated (``bits_words`` a row: 0 for a
    mask_mod's, which has no mask bits; ``pooled``: a mask_mod plan's pool and slots), not yet built."""
    b, sq, _, _ = qi.shape
    sk = ki.shape[1]
    tq, tk = kern.spec.cta_tile_q, kern.spec.cta_tile_kv
    nqt, nkt = -(-sq // tq), -(-sk // tk)
    units = ub * uh
    if nqt > 65535 or units > 65535 or (ub == 1 and b > 65535):
        raise LaunchError(f"{what} of {units} batch x head units and {nqt} query tiles of {tq} (batch {b}): "
                          f"at most 65535 of each")
    mp = object.__new__(MaskPlan)  # MaskPlan() refuses: only build and build_mod fill one in
    mp.kind, mp.device, mp.tiles = qi.kind, qi.device, (tq, tk)
    mp.seqlen_q, mp.seqlen_k, mp.units_b, mp.units_h = sq, sk, ub, uh
    mp.mask_mode = (mcode, left, right)
    mp.num_q_tiles, mp.num_kv_tiles = nqt, nkt
    mp.bits_words = bits_words(nkt * tk)
    mp.mods = None
    # One buffer for all of it (one allocation; nothing needs zeroing: every word the kernels
    # read is written first), each part 16-byte aligned (work is read as int2). flags: [0] any
    # odd additive value, then one word per item.
    cells, items = mp.cells, units * nqt
    tile_words = tq * (tk // 32)
    if pooled and kern.spec.mod_bits and cells * tile_words * 4 > POOL_BYTES:
        raise LaunchError(f"the spec's mod_bits=true needs the keep bits of all {cells} tiles of this call's mask_mod "
                          f"plan, {cells * tile_words * 4 >> 20} MiB, over the {POOL_BYTES >> 20} MiB a pool may take: "
                          "leave mod_bits off (without a spec, calls take it where it fits)")
    mp.pool_tiles = pool_slots(kern.spec, cells) if pooled else 0
    sizes = (("bits", units * sq * mp.bits_words), ("states", -(-cells // 4)), ("tiles", cells),
             ("counts", items), ("work", 2 * items), ("flags", 1 + items),
             ("pool_used", 1 if mp.pool_tiles else 0), ("slots", cells if mp.pool_tiles else 0),
             ("pool", mp.pool_tiles * tile_words))
    sizes = tuple((name, -(-n // 4) * 4) for name, n in sizes)
    mp._buf = allocator(qi.kind, "int32", qi.device)(sum(n for _, n in sizes))
    at = mp._at = {}
    ptr = data_ptr(mp._buf, qi.kind)
    for name, n in sizes:
        at[name] = ptr if n else 0  # (no bits: a null pointer, which the kernel reads as a mask_mod's plan)
        ptr += 4 * n
    if mp.pool_tiles:  # the one word that must start at zero, the pool's count of slots handed out: on the
        # current stream of q's kind, which the plan's launches follow
        used = mp._part("pool_used", 1)
        used.fill(0) if qi.kind == "cupy" else used.zero_()
    return mp


def mod_identity(mask_mod: str, aux) -> tuple:
    """What a mask_mod's plan was built from: the snippet, and each aux tensor's name, pointer, shape, strides and
    in-place modification count."""
    infos = ((n, tensor_info(aux[n], f"aux[{n!r}]"), _version(aux[n])) for n in sorted(aux or ()))
    return mask_mod, tuple((n, i.ptr, tuple(i.shape), i.strides, ver) for n, i, ver in infos)


def _lists(kern, mp, params, stream: int) -> None:
    """The plan's lists and work order from its tile states."""
    kern.launch_struct(PLAN_PARAMS, (mp.num_q_tiles, mp.units_b * mp.units_h, 1), stream, *params, entry="_mlists")
    kern.launch_struct(PLAN_PARAMS, (1, 1, 1), stream, *params, entry="_order")


_tensor_plan_kernels: dict = {}


def tensor_plan_kernel(kern):
    """The kernel whose module builds a mask tensor's plan for ``kern``: ``kern`` itself, or for a kernel with
    snippets (whose module leaves the tensor's ``_mtiles`` out, about half of its compile) the kernel of its spec
    without them (nor q_scaled), on the same arch and device: the same tiles and masks, so the same plan, and one
    module for every snippet of those tiles."""
    spec = kern.spec
    if not (spec.score_mod or spec.mask_mod or spec.aux):
        return kern
    twin = _tensor_plan_kernels.get(kern.key)
    if twin is None:
        plain = spec.replace(score_mod="", mask_mod="", aux="", q_scaled=False)  # (q_scaled serves a score_mod)
        twin = _tensor_plan_kernels[kern.key] = get_kernel(plain, kern.binary.arch, kern.device)
    return twin


def build(kern, mask, qi, ki, mcode: int, left: int, right: int, stream: int) -> MaskPlan:
    """Build the plan of ``mask`` for ``kern``'s tile sizes on ``stream`` (enqueued, not waited for)."""
    kern = tensor_plan_kernel(kern)
    b, sq, h, _ = qi.shape
    sk = ki.shape[1]
    mi, ub, uh, m_sb, m_sh, m_sq = mask_info(mask, b, h, sq, sk, qi.kind, qi.device)
    mp = _new_plan(kern, qi, ki, ub, uh, mcode, left, right, lambda keys: keys // 32, "mask")
    mp.mask_ptr, mp.mask_shape, mp.mask_strides, mp.version = mi.ptr, tuple(mi.shape), mi.strides, _version(mask)
    at, nqt, nkt = mp._at, mp.num_q_tiles, mp.num_kv_tiles
    params = (mi.ptr, at["bits"], at["states"], at["tiles"], at["counts"], at["work"], 0, at["flags"], 0, 0, 0,
              m_sb, m_sh, m_sq, sq * mp.bits_words,
              _MASK_KINDS[mi.dtype], sq, sk, ub, uh, nqt, nkt, mp.bits_words, left, right, 0, 0, 0, 0, *NO_SERVING)
    if nqt:
        if nkt:
            kern.launch_struct(PLAN_PARAMS, (-(-mp.bits_words // 32), nqt, ub * uh), stream, *params,
                               entry="_mtiles")
        _lists(kern, mp, params, stream)
    return mp


def mod_units(mask_mod: str, batch: int, heads: int) -> tuple[int, int]:
    """(batch units, head units) of a mask_mod's plan: one a batch row only where mask_mod names ``b``, one a head
    only where it names ``h``."""
    reads_b, reads_h = reads_batch_head(mask_mod)
    return (batch if reads_b else 1), (heads if reads_h else 1)


def mod_cells(spec, q_shape, k_shape) -> int:
    """The (unit, query tile, KV tile) cells of a mask_mod plan for ``spec``'s kernel and operands of these
    ``[batch, seqlen, heads, dim]`` shapes: what ``build_mod`` would make."""
    ub, uh = mod_units(spec.mask_mod, q_shape[0], q_shape[2])
    return ub * uh * -(-q_shape[1] // spec.cta_tile_q) * -(-k_shape[1] // spec.cta_tile_kv)


def pool_slots(spec, cells: int) -> int:
    """The slots of the pool of a mask_mod plan of ``cells`` (unit, query tile, KV tile) cells for ``spec``'s kernel:
    one a cell where the kernel has no mask_mod of its own (``mod_bits``: ``bits_form`` chose it only where they fit
    POOL_BYTES); else a quarter of them, at least POOL_MIN_TILES, within POOL_BYTES; none where the tiles are not
    whole 32-key words."""
    tk = spec.cta_tile_kv
    if tk % 32:
        return 0
    if spec.mod_bits:
        return cells
    return min(cells, max(POOL_MIN_TILES, cells // 4), POOL_BYTES // (spec.cta_tile_q * tk // 8))


def bits_form(spec, cells: int) -> bool:
    """Whether a mask_mod plan of ``cells`` cells can give ``spec``'s kernel (a custom-mask one with a mask_mod) the
    keep bits of every tile, so that it runs its ``mod_bits`` form: only where mask_mod reads an aux tensor
    (``snippets.reads_aux``) and a slot for every cell fits POOL_BYTES."""
    return (spec.cta_tile_kv % 32 == 0 and reads_aux(spec.mask_mod, spec.aux)
            and cells * spec.cta_tile_q * spec.cta_tile_kv // 8 <= POOL_BYTES)


def build_mod(kern, qi, ki, mcode: int, left: int, right: int, aux_args: tuple, aux, stream: int) -> MaskPlan:
    """Build the block plan of ``kern``'s mask_mod (a custom-mask kernel's, templates/prefill/mod_plan.cuh) for a
    call of these operands on ``stream`` (enqueued, not waited for): ``aux_args`` the kernel's packed aux tensors
    (``snippets.pack_aux``), ``aux`` the call's dict of them (or None), whose identity is kept to check a reuse."""
    b, sq, h, _ = qi.shape
    sk = ki.shape[1]
    ub, uh = mod_units(kern.spec.mask_mod, b, h)
    mp = _new_plan(kern, qi, ki, ub, uh, mcode, left, right, lambda keys: 0, "mask_mod plan",
                   pooled=reads_aux(kern.spec.mask_mod, kern.spec.aux))
    mp.mask_ptr, mp.mask_shape, mp.mask_strides, mp.version = None, None, None, -1
    mp.mods = mod_identity(kern.spec.mask_mod, aux)
    at, nqt, nkt = mp._at, mp.num_q_tiles, mp.num_kv_tiles
    params = (0, 0, at["states"], at["tiles"], at["counts"], at["work"], 0, at["flags"], 0, 0, 0,
              0, 0, 0, 0, 0, sq, sk, ub, uh, nqt, nkt, 0, left, right, 0, 0, 0, 0, *NO_SERVING)
    if nqt:
        if nkt:
            kern.launch_struct(_mod_plan_layout(), (nkt, nqt, ub * uh), stream, *params, *aux_args,
                               at["pool"], at["slots"], at["pool_used"], mp.pool_tiles, entry="_modtiles")
        _lists(kern, mp, params, stream)
    return mp


def _mod_plan_layout():
    """ModPlanParams (templates/prefill/mod_plan.cuh): PlanParams, ModArgs, then the pool's 3 pointers and int."""
    global _MOD_PLAN
    if _MOD_PLAN is None:
        _MOD_PLAN = struct.Struct(mod_layout(PLAN_PARAMS).format + "3Qi4x")
    return _MOD_PLAN


_MOD_PLAN = None


def _check_fits(mp, kern, qi, ki, mcode: int, left: int, right: int) -> None:
    """A caller's plan against this call: its kind, device, causal/window, tiles, lengths and units."""
    if not isinstance(mp, MaskPlan):
        raise LaunchError(f"mask_plan is a {type(mp).__name__}; expected the MaskPlan attngen.mask_plan returns")
    if mp.device != qi.device or mp.kind != qi.kind:
        raise LaunchError(f"mask_plan was built for {mp.kind} on device {mp.device}; this call is {qi.kind} on "
                          f"device {qi.device}")
    if mp.mask_mode != (mcode, left, right):
        raise LaunchError("mask_plan was built with other causal/window arguments than this call's")
    tiles = (kern.spec.cta_tile_q, kern.spec.cta_tile_kv)
    if mp.tiles != tiles:
        raise LaunchError(f"mask_plan was built for tiles of {mp.tiles[0]}x{mp.tiles[1]} (cta_tile_q x cta_tile_kv); "
                          f"this call's kernel uses {tiles[0]}x{tiles[1]}: build the plan with the same spec, head dims "
                          f"(mask_plan(..., v=v) when v's differs from k's), dtype and masks as the call")
    if (mp.seqlen_q, mp.seqlen_k) != (qi.shape[1], ki.shape[1]):
        raise LaunchError(f"mask_plan was built for seqlen_q={mp.seqlen_q}, seqlen_k={mp.seqlen_k}; this call has "
                          f"seqlen_q={qi.shape[1]}, seqlen_k={ki.shape[1]}")
    if (mp.units_b not in (1, qi.shape[0])) or (mp.units_h not in (1, qi.shape[2])):
        raise LaunchError(f"mask_plan has {mp.units_b} batch and {mp.units_h} head units; this call has batch "
                          f"{qi.shape[0]}, heads {qi.shape[2]}")


def checked_plan(mp, mask, kern, qi, ki, mcode: int, left: int, right: int, stream: int) -> MaskPlan:
    """``mp`` after checking it fits this call, or a plan built now when ``mp`` is None."""
    if mp is None:
        return build(kern, mask, qi, ki, mcode, left, right, stream)
    if isinstance(mp, MaskPlan) and mp.mods is not None:
        raise LaunchError("mask_plan was built from a mask_mod (attngen.mask_plan(None, ..., mask_mod=...)); this "
                          "call passes a mask tensor: pass the plan attngen.mask_plan(mask, ...) built")
    _check_fits(mp, kern, qi, ki, mcode, left, right)
    mi = tensor_info(mask, "mask")
    if (mi.ptr, tuple(mi.shape), mi.strides) != (mp.mask_ptr, mp.mask_shape, mp.mask_strides):
        raise LaunchError("mask_plan was built from another mask (its data pointer, shape or strides differ)")
    if mp.version != _version(mask):
        raise LaunchError("mask was modified in place after its mask_plan was built; build a new plan")
    return mp


def checked_mod_plan(mp, kern, qi, ki, mcode: int, left: int, right: int, aux_args: tuple, aux,
                     stream: int) -> MaskPlan:
    """A caller's mask_mod plan ``mp`` after checking it fits this call, or one built now when ``mp`` is None."""
    if mp is None:
        return build_mod(kern, qi, ki, mcode, left, right, aux_args, aux, stream)
    if isinstance(mp, MaskPlan) and mp.mods is None:
        raise LaunchError("mask_plan was built from a mask tensor; this call has a mask_mod and no mask: pass the "
                          "plan attngen.mask_plan(None, q, k, mask_mod=..., aux=...) built")
    _check_fits(mp, kern, qi, ki, mcode, left, right)
    if mp.mods[0] != kern.spec.mask_mod:
        raise LaunchError("mask_plan was built for another mask_mod than this call's")
    if mp.mods != mod_identity(kern.spec.mask_mod, aux):
        raise LaunchError("mask_plan was built from other aux tensors than this call's (their data pointers, shapes "
                          "or strides differ, or one was modified in place since): build a new plan")
    return mp


def checked_bits_plan(mp: MaskPlan):
    """Refuse ``mp`` for a kernel of a caller's ``mod_bits=true``: its pool lacks some tiles' keep bits."""
    cells = mp.cells
    raise LaunchError(f"mask_plan has slots for the keep bits of {mp.pool_tiles} of its {cells} tiles; the spec's "
                      "mod_bits=true runs no mask_mod and needs them all: build the plan with the call's spec")
