"""Specs: frozen, validated descriptions of the kernels attngen can build.

A spec holds only ints, bools and enums, so nothing a user types can reach a template
unvalidated. Tuning fields default to 0, meaning "the arch's default": ``resolve(spec, arch)``
fills them in, and the resolved spec is what is rendered, keyed and compiled.

This module holds what every family shares: ``SpecBase`` (serialization, the text form, the
kernel's name), the field coercions, ``parse_spec`` and the generic ``resolve`` / ``validate`` /
``tuning_candidates``. Each family's spec class lives in its own folder
(``attngen/families/<name>/spec.py``) and supplies the hooks ``SpecBase`` leaves open.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import hashlib
import json
import re
from dataclasses import fields
from collections.abc import Mapping
from typing import Any, ClassVar

from .arch import Arch, get_arch
from .errors import SpecError
from .family import families, get_family


# A user's variant (score_mod / mask_mod source and the aux tensors' signature, attngen/families/snippets.py):
# fields that are left out of a spec's dict while "" (off) and shown by hash in its text.
SNIPPET_FIELDS = ("score_mod", "mask_mod", "aux")


def _snippet_short(text: str) -> str:
    return "sha:" + hashlib.sha256(text.encode()).hexdigest()[:8] if text else ""


# The longest kernel name: entry suffixes (``_merge_wide``) come on top of it. Profilers and cache
# listings cut long names; a C identifier itself has no limit.
NAME_MAX = 100


class DType(enum.Enum):
    FP16 = "fp16"
    BF16 = "bf16"

    @property
    def itemsize(self) -> int:
        return 2


class Mma(enum.Enum):
    """Which tensor-core instruction a kernel is built on. ``auto`` (the default) lets
    ``resolve`` choose for the arch, so it is falsy like the other unresolved tuning fields."""

    AUTO = "auto"
    SYNC = "mma_sync"  # mma.sync m16n8k16 per warp: every arch from sm_80
    WGMMA = "wgmma"    # wgmma.mma_async per warpgroup of 4 warps: sm_90a only

    def __bool__(self) -> bool:
        return self is not Mma.AUTO


class Pipeline(enum.Enum):
    """How a kernel's KV tiles reach shared memory. ``auto`` (the default) lets ``resolve`` choose
    for the arch and layout, so it is falsy like the other unresolved tuning fields."""

    AUTO = "auto"
    SYNC = "sync"  # the math warps issue cp.async; a CTA barrier a tile (every arch, every layout)
    TMA = "tma"    # TMA copies (tensor maps built on the host) into an mbarrier ring: wgmma kernels on sm_90a

    def __bool__(self) -> bool:
        return self is not Pipeline.AUTO


def variant_list(*switches: tuple[str, bool]) -> str:
    """The library variants (templates/common/variant.cuh) a spec's switches turn on, as the arguments of the
    template's ``Variants<...>``: the names whose switch is on, in the order given, which is the order they apply in
    (docs/variants.md "Order")."""
    return ", ".join(name for name, on in switches if on)


def allowed_text(values) -> str:
    return ", ".join(str(v.value if isinstance(v, enum.Enum) else v) for v in values)


def coerce_enum(cls, name: str, value):
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        for member in cls:
            if member.value == value.strip().lower():
                return member
    raise SpecError(name, value, allowed_text(cls))


def coerce_int(name: str, value, allowed) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        # Python will not even print an integer past 4300 digits: named by its size instead.
        raise SpecError(name, f"<an integer of {value.bit_length()} bits>", allowed_text(allowed))
    if isinstance(value, bool) or not isinstance(value, int):
        text = value.strip() if isinstance(value, str) else None
        # ASCII digits only: str.isdigit() also takes "²", which int() then refuses.
        if text and text.isascii() and (text[1:] if text[0] == "-" else text).isdigit():
            if len(text) > 20:
                raise SpecError(name, f"{text[:12]}...({len(text)} digits)", allowed_text(allowed))
            value = int(text)
        else:
            raise SpecError(name, value, allowed_text(allowed), reason="must be an integer")
    if value not in allowed:
        raise SpecError(name, value, allowed_text(allowed))
    return value


def coerce_bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise SpecError(name, value, "true, false")


class SpecBase:
    """What every family's spec shares: the resolved check, serialization, the kernel's name.

    A family's spec is a ``@dataclass(frozen=True)`` subclass that sets ``family``,
    ``TUNING_FIELDS`` (0 or a falsy enum member means "the arch's default") and implements
    (its candidate configs come from the family's ``candidates``, see ``attngen.family``):

    - ``check(arch)``: the family's own fit rules for a resolved spec (``validate`` calls it);
    - ``smem_bytes()`` and ``threads``: the main entry's launch shape;
    - ``template_context()``: extends the base context with the family's constants;
    - ``launch_shapes()`` if the module has entries besides the main one.
    """

    family: ClassVar[str]
    TUNING_FIELDS: ClassVar[tuple[str, ...]]
    ALWAYS_SHOWN: ClassVar[tuple[str, ...]] = ("head_dim", "dtype")
    # Fields left out of the dict, key and text while off (falsy), beside the snippets': a spec without them keeps
    # its JSON and its key.
    OFF_UNSHOWN: ClassVar[tuple[str, ...]] = ()
    # The entries of the family's module (by suffix, "" the main one) launched with programmatic
    # dependent launch on sm_90 and newer. Every entry of such a module starts with ``pdl_enter()``
    # (common/ptx.cuh), whether or not it is listed: one that is not still lets the next start early.
    PDL_ENTRIES: ClassVar[tuple[str, ...]] = ()

    @functools.cached_property
    def is_resolved(self) -> bool:
        # (kept on the instance: a spec's fields never change once built, and the ops' launch path
        # reads properties that check it on every call)
        return all(getattr(self, f) for f in self.TUNING_FIELDS)

    @property
    def pins_tuning(self) -> bool:
        """Whether some tuning field is set (the caller pins it): the choice then keeps to what the spec says."""
        return any(getattr(self, f) for f in self.TUNING_FIELDS)

    def _require_resolved(self, what: str):
        if not self.is_resolved:
            raise SpecError("spec", self.to_text(), "a resolved spec (see attngen.resolve)",
                            reason=f"{what} needs concrete tuning fields")

    # --- family hooks ------------------------------------------------------------------------
    def check(self, arch: Arch) -> None:
        raise NotImplementedError

    def smem_bytes(self) -> int:
        raise NotImplementedError

    def compile_error(self, error) -> "Exception | None":
        """The error to raise for NVRTC's ``error`` (a CompileError) where it lies in code of the user's that the
        spec holds (a family with snippets says which); None: the CompileError itself."""
        return None

    @property
    def threads(self) -> int:
        raise NotImplementedError

    def launch_shapes(self) -> tuple[tuple[str, int, int], ...]:
        """(entry name suffix, threads, dynamic shared memory) of every entry of the module, the
        main one (suffix "") first."""
        return (("", self.threads, self.smem_bytes()),)

    @property
    def entries(self) -> tuple[str, ...]:
        """Every entry function in the kernel's module, the main one first."""
        return tuple(self.kernel_name + s for s, _, _ in self.launch_shapes())

    def template_context(self) -> dict:
        """Every value a template may read: the fields as plain values plus derived constants."""
        ctx = self.to_dict()
        ctx.update(kernel_name=self.kernel_name, is_bf16=self.dtype is DType.BF16, smem_bytes=self.smem_bytes(),
                   threads=self.threads)
        return ctx

    @classmethod
    def allowed_values(cls, name: str) -> tuple:
        """The values field ``name`` takes: an enum's members, a bool's two, or for an int the
        class constant named after the field in capitals (``head_dim`` -> ``HEAD_DIMS``,
        ``q_rows`` -> ``Q_ROWS``); () where the class names none."""
        f = next(f for f in fields(cls) if f.name == name)
        default = f.default
        if isinstance(default, enum.Enum):
            return tuple(type(default))
        if isinstance(default, bool):
            return (False, True)
        return tuple(getattr(cls, name.upper(), None) or getattr(cls, name.upper() + "S", None) or ())

    # --- serialization -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"family": self.family}
        for f in fields(self):
            v = getattr(self, f.name)
            if (f.name in SNIPPET_FIELDS or f.name in self.OFF_UNSHOWN) and not v:
                continue  # off: left out, so a spec without snippets keeps its JSON, its key and its kernel's name
            d[f.name] = v.value if isinstance(v, enum.Enum) else v
        return d

    def untuned_dict(self) -> dict[str, Any]:
        """The fields that are not tuning fields, in their JSON form (what a tuned entry is keyed by)."""
        d = self.to_dict()
        return {f.name: d[f.name] for f in fields(self) if f.name not in self.TUNING_FIELDS and f.name in d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpecBase":
        d = dict(d)
        fam = d.pop("family", cls.family)
        if str(fam).strip().lower() != cls.family:
            raise SpecError("family", fam, cls.family)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            near = difflib.get_close_matches(unknown[0], sorted(known), n=1)
            hint = f"; did you mean {near[0]}?" if near else ""
            raise SpecError(unknown[0], d[unknown[0]], ", ".join(sorted(known)),
                            reason=f"unknown field of a {cls.family} spec{hint}")
        return cls(**d)

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def to_text(self, full: bool = False) -> str:
        """Compact form, e.g. ``prefill:head_dim=128,dtype=bf16,mask=causal``."""
        default = type(self)()
        parts = []
        for f in fields(self):
            v = getattr(self, f.name)
            if (f.name in SNIPPET_FIELDS or f.name in self.OFF_UNSHOWN) and not v:
                continue  # off: not shown even in full, as it is left out of the dict
            if full or v != getattr(default, f.name) or f.name in self.ALWAYS_SHOWN:
                v = v.value if isinstance(v, enum.Enum) else v
                if f.name in SNIPPET_FIELDS and f.name != "aux":
                    v = _snippet_short(v)  # source text holds commas and newlines: shown by its hash
                parts.append(f"{f.name}={str(v).lower() if isinstance(v, bool) else v}")
        return f"{self.family}:" + ",".join(parts)

    def __str__(self) -> str:
        return self.to_text()

    def digest(self) -> str:
        """Short stable hash of the canonical spec (8 hex digits), the end of the kernel's name: the
        readable parts before it need not tell every spec apart. The cache key hashes the whole spec
        itself, so two specs whose names met could never share a cubin."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:8]

    def name_parts(self) -> tuple[str, ...]:
        """The readable pieces of the kernel's name after the family, from the fields that tell
        variants apart in a profile or a cache listing (head dims, dtype, mask, tiles, pipeline, ...):
        letters and digits, "" for a piece left out (an unset tuning field, a default flag). A
        family overrides it; the base names none."""
        return ()

    @staticmethod
    def name_piece(fmt: str, *values) -> str:
        """``fmt`` filled with ``values``, or "" where one of them is unset (0, False, an auto enum)."""
        return fmt.format(*values) if all(values) else ""

    @functools.cached_property
    def kernel_name(self) -> str:
        """``attngen_<family>_<name_parts>_<digest>``, e.g. ``attngen_prefill_d128_bf16_causal_q128k64_w4s2_mma_
        1a2b3c4d``: a C identifier of at most ``NAME_MAX`` characters (the parts are cut short, not the digest).
        Every entry of the module is this name plus its suffix (``_merge``)."""
        head = "_".join(("attngen", self.family, *filter(None, self.name_parts())))
        head = re.sub(r"[^A-Za-z0-9_]", "", head)[:NAME_MAX - 9].rstrip("_")
        return f"{head}_{self.digest()}"

    def replace(self, **changes) -> "SpecBase":
        return dataclasses.replace(self, **changes)


Spec = SpecBase  # any family's spec


SPEC_FORMS = ("a spec object (e.g. attngen.PrefillSpec(head_dim=128)), its text "
              "(e.g. 'prefill:head_dim=128,mask=causal') or a dict of its fields with its family "
              "(e.g. {'family': 'prefill', 'head_dim': 128})")


class _Shown(str):
    """A value shown as it is in a SpecError's message (not quoted like a string)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


def _not_a_spec(spec, name: str) -> SpecError:
    return SpecError(name, _Shown(_brief(spec)), SPEC_FORMS, reason=f"got type {type(spec).__name__}")


@functools.lru_cache(maxsize=256)
def _parsed(text: str) -> Spec:
    # A spec is immutable, so a text's parse is kept: a hot call site that passes text parses it once.
    return _parse_text(text)


def as_spec(spec: Spec | str | Mapping, name: str = "spec") -> Spec:
    """The spec object ``spec`` names: a spec object as it is, its text (``parse_spec``'s form) or a
    dict of its fields with ``"family"``. Anything else is refused with a ``SpecError`` naming
    ``name``, the type received and the forms allowed. What every public function that takes a
    spec calls first."""
    if isinstance(spec, SpecBase):
        return spec
    if isinstance(spec, str):
        return _parsed(spec)
    if isinstance(spec, Mapping):
        d = dict(spec)
        if "family" not in d:
            raise SpecError("family", None, ", ".join(sorted(f.name for f in families())),
                            reason=f"{name}={_Shown(_brief(spec))} names no family; a spec's dict names it, "
                                   "e.g. {'family': 'prefill', 'head_dim': 128}")
        fam = d["family"]
        if not isinstance(fam, str):
            raise SpecError("family", fam if fam is None or isinstance(fam, (int, float)) else type(fam).__name__,
                            ", ".join(sorted(f.name for f in families())), reason="a spec's family is a name")
        return get_family(fam).spec.from_dict(d)
    raise _not_a_spec(spec, name)


def _brief(value) -> str:
    # a message names what it was given, without printing a whole tensor or a long spec
    shown = repr(value)
    return shown if len(shown) <= 100 else shown[:97] + "..."


def op_spec(spec: Spec | str | Mapping | None, family: str, op: str) -> "Spec | None":
    """The spec an op's ``spec=`` argument names (None: none), checked to be of ``family``; ``op``
    is the op's public name for the messages (``attngen.mask_plan``). Text and dicts are read as
    ``spec_of_text`` reads text: the op puts its tensors' head dims in."""
    if spec is None:
        return None
    if isinstance(spec, str):
        return spec_of_text(spec, family, op)
    if isinstance(spec, Mapping):
        try:
            items = tuple(sorted(spec.items()))
            hash(items)
        except TypeError:  # unhashable values or keys of mixed types: read it each time
            return _op_spec_of_dict(dict(spec), family, op)
        return _op_spec_of_items(items, family, op)
    spec = as_spec(spec)
    _check_op_family(spec.family, family, op, spec)
    return spec


@functools.lru_cache(maxsize=256)
def _op_spec_of_items(items: tuple, family: str, op: str) -> Spec:
    # a dict passed on every call (a layer's config) is read once, like text
    return _op_spec_of_dict(dict(items), family, op)


def _op_spec_of_dict(d: dict, family: str, op: str) -> Spec:
    _check_op_family(d.get("family"), family, op, d)
    wide = _chunk_head_dim(get_family(family).spec, set(d))
    if wide:
        d["head_dim"] = wide
    return as_spec(d)


def _check_op_family(got, family: str, op: str, spec) -> None:
    if got is not None and str(got).strip().lower() == family:
        return
    shown = _Shown(_brief(str(spec) if isinstance(spec, SpecBase) else spec))
    what = f"is a {got} spec" if got is not None else "names no family"
    raise SpecError("family", got, family, reason=f"{op} takes a {family} spec; spec={shown} {what}")


@functools.lru_cache(maxsize=256)
def spec_of_text(text: str, family: str, op: str = "") -> Spec:
    """The spec an op's ``spec=`` text names (parsed once per text), checked to be of ``family``."""
    spec = parse_spec(text.partition(":")[0])  # the family alone: its defaults
    if spec.family != family:
        _check_op_family(spec.family, family, op or f"attngen.{family}", text)
    names = {item.partition("=")[0].strip() for item in text.partition(":")[2].split(",")}
    wide = _chunk_head_dim(type(spec), names)
    return parse_spec(f"{text},head_dim={wide}" if wide else text)


def _chunk_head_dim(cls, names: set) -> int:
    """The head_dim an op's spec naming ``names`` is read at, 0 for as given. The op replaces head_dim
    with its tensors'. Read at the default head_dim (128), a pinned head_dim_chunk of 128 would be
    taken for "whole rows" (and the fields that only the chunked kernel takes refused): such a spec
    is read at the largest head dim instead (what the chunk divides is checked again at the tensors'
    head dim)."""
    if "head_dim_chunk" in names and "head_dim" not in names and "head_dim_chunk" in cls.__dataclass_fields__:
        return max(cls.HEAD_DIMS)
    return 0


def parse_spec(text: Spec | str | Mapping, **fields) -> Spec:
    """``prefill:head_dim=128,dtype=bf16,mask=causal`` -> PrefillSpec; fields left out take defaults.

    A dict (``{"family": "prefill", "head_dim": 128}``, what ``spec.to_dict()`` gives) or a spec
    object is accepted too; anything else is refused with a ``SpecError``. ``fields``: more fields, checked
    with the text's (a snippet's source, which the text form cannot hold: a field may need it)."""
    if fields and isinstance(text, str):
        cls, d = _text_fields(text)
        for k in fields:
            if k in d:
                raise SpecError(k, d[k], "each field once", reason="given in the text and apart")
        return cls.from_dict({**d, **fields})
    spec = as_spec(text)
    return spec.replace(**fields) if fields else spec


def _parse_text(text: str) -> Spec:
    cls, d = _text_fields(text)
    return cls.from_dict(d)


def _text_fields(text: str) -> tuple[type, dict]:
    s = text.strip()
    fam, colon, rest = s.partition(":")
    try:
        cls = get_family(fam.strip()).spec
    except SpecError as e:
        if e.field != "family":
            raise
        raise SpecError("family", fam.strip(), e.allowed,
                        reason="a spec's text form starts with its family, e.g. prefill:head_dim=128") from None
    d: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise SpecError("spec", item, "name=value pairs separated by commas")
        k = k.strip()
        if k in d:
            raise SpecError(k, v, "each field once", reason="given twice")
        d[k] = v.strip()
    return cls, d


# --- per-arch defaults and fit -----------------------------------------------------------------

def _configs(spec: Spec, a: Arch):
    """(tuning dict, candidate spec) for every candidate config that agrees with what ``spec`` pins."""
    names = spec.TUNING_FIELDS
    pinned = {k: getattr(spec, k) for k in names if getattr(spec, k)}
    for cfg in get_family(spec.family).candidates(spec, a):
        t = dict(zip(names, cfg))
        if any(t[k] != v for k, v in pinned.items()):
            continue
        try:
            cand = spec.replace(**t)
        except SpecError:
            continue  # an inconsistent combination (warps vs cta_tile_q), not a reason to report
        yield t, cand


def default_tuning(spec: Spec, arch: "str | Arch") -> dict[str, Any]:
    """Tuning fields for a spec on an arch: the fastest measured config that agrees with the fields
    the user pinned and fits the arch; failing that, the first allowed combination that does."""
    a = get_arch(arch)
    first_error: SpecError | None = None
    pinned: dict = {k: getattr(spec, k) for k in spec.TUNING_FIELDS if getattr(spec, k)}
    for t, cand in _configs(spec, a):
        try:
            validate(cand, a)
        except SpecError as e:
            first_error = first_error or e  # the closest config's reason is the useful one
            continue
        return t
    if first_error is not None:
        raise first_error
    # Every candidate disagreed with a pinned field: name the first pinned value no config on this
    # arch has with the other pinned values, and the values of that field such configs fit.
    fits: dict[str, list] = {k: [] for k in pinned}
    for cfg in get_family(spec.family).candidates(spec, a):
        t = dict(zip(spec.TUNING_FIELDS, cfg))
        new = [k for k in pinned if t[k] not in fits[k] and all(t[j] == pinned[j] for j in pinned if j != k)]
        if not new:
            continue
        try:
            validate(spec.replace(**t), a)
        except SpecError:
            continue
        for k in new:
            fits[k].append(t[k])
    # the field whose change alone fits first, else the first that no config with the others fits
    field = next((k for k in pinned if pinned[k] not in fits[k] and fits[k]),
                 next((k for k in pinned if pinned[k] not in fits[k]), next(iter(pinned))))
    pins = ", ".join(f"{k}={allowed_text([v])}" for k, v in pinned.items())
    value = getattr(pinned[field], "value", pinned[field])  # an enum member as its text
    raise SpecError(field, value, allowed_text(fits[field]) or f"none on {a.name}",
                    reason=f"no {spec.family} tile configuration with {pins} fits {a.name}")


def tuning_candidates(spec: Spec, arch: "str | Arch") -> list[Spec]:
    """Every resolved spec the tuning space offers for ``spec`` on ``arch``: the configs that agree
    with the tuning fields ``spec`` pins and pass ``validate``. The arch's default
    (``resolve(spec, arch)``) comes first, then the measured configs, then the rest, larger tiles
    first. Raises ``resolve``'s ``SpecError`` when nothing fits."""
    a = get_arch(arch)
    default = resolve(spec, a)
    out, seen = [default], {default}
    for _, cand in _configs(spec, a):
        try:
            validate(cand, a)
        except SpecError:
            continue
        if cand not in seen:
            seen.add(cand)
            out.append(cand)
    return out


def resolve(spec: Spec | str | Mapping, arch: "str | Arch") -> Spec:
    """Fill the tuning fields left at 0 for ``arch``, then validate. ``spec``: a spec object, its
    text or a dict of its fields (as ``parse_spec`` takes)."""
    spec = as_spec(spec)
    a = get_arch(arch)
    if not spec.is_resolved:
        spec = spec.replace(**default_tuning(spec, a))
    validate(spec, a)
    return spec


def validate(spec: Spec | str | Mapping, arch: "str | Arch") -> None:
    """Reject what cannot compile or cannot fit on ``arch``, naming the field to change. ``spec``
    (a spec object, its text or a dict of its fields) must be resolved (``resolve``)."""
    spec = as_spec(spec)
    a = get_arch(arch)
    if not a.has_mma_m16n8k16:
        raise SpecError("arch", a.name, "sm_80 or newer", reason="the kernels use mma.sync m16n8k16 and cp.async")
    spec._require_resolved("validate")
    spec.check(a)


def replaced_if_valid(spec: Spec, arch: "str | Arch", **fields) -> "Spec | None":
    """``spec`` with ``fields`` replaced where that validates on ``arch``, else None (an op's own choice beside
    the resolved default: taken only where it fits)."""
    other = spec.replace(**fields)
    try:
        validate(other, arch)
    except SpecError:
        return None
    return other


def check_wgmma_arch(spec: Spec, a: Arch) -> None:
    """Reject ``mma=wgmma`` on an arch without it, naming the field."""
    if not a.has_wgmma:
        raise SpecError("mma", spec.mma.value, "mma_sync", reason=f"wgmma needs sm_90a; the target is {a.name}")


def check_smem(spec: Spec, a: Arch, field: str, allowed: str) -> None:
    """Reject a spec whose shared memory exceeds the arch's per-block limit, naming ``field``."""
    smem = spec.smem_bytes()
    if smem > a.smem_per_block:
        raise SpecError(field, getattr(spec, field), allowed,
                        reason=f"needs {smem} bytes of shared memory; {a.name} allows {a.smem_per_block} per block")
