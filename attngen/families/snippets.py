"""User-written attention variants: ``score_mod`` and ``mask_mod`` snippets (CUDA device-function bodies) and the
named auxiliary tensors they read. Shared by prefill and decode: the spec fields' checks (``check_spec_fields``), the
code the templates insert (``template_context``: ``declarations`` first, ``definitions`` last), the call's checks and
its aux tensors packed for the kernel (``call_mods``, ``check_spec_mods``, ``pack_aux``), and NVRTC's errors at a
snippet's own lines turned into a ``SpecError`` (``snippet_error``).

A snippet is the user's own device code compiled into the user's own kernel (never run on the host). Its text
reaches the template verbatim, in one place only: the body of a function defined at the end of the translation
unit, after ``#line 1 "score_mod"`` (or ``"mask_mod"``), so that NVRTC counts lines in the user's snippet and
nothing of the template follows it (a user's unbalanced brace cannot make a template line look like theirs).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping

from ..errors import AttngenError, CompileError, LaunchError, SpecError
from ..spec import SNIPPET_FIELDS, _snippet_short

MAX_AUX = 4
MAX_NDIM = 4
MAX_SNIPPET = 16384  # characters of one snippet
# aux dtype -> (C element type, what the accessor returns, how one element becomes that)
AUX_TYPES = {
    "fp32": ("float", "float", "{}"),
    "fp16": ("__half", "float", "__half2float({})"),
    "bf16": ("__nv_bfloat16", "float", "__bfloat162float({})"),
    "int32": ("int", "int", "{}"),
    "int64": ("long long", "long long", "{}"),
    "uint8": ("unsigned char", "int", "(int)({})"),
}
# What tensor_info calls the dtypes aux takes (torch's own names where runtime has none): a bool array is read as
# the uint8 it is stored as.
_INFO_DTYPES = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "int32": "int32", "int64": "int64",
                "torch.int64": "int64", "uint8": "uint8", "torch.uint8": "uint8", "bool": "uint8",
                "torch.bool": "uint8"}
# The snippets' arguments, and the names the generated code takes for itself.
ARG_NAMES = ("score", "b", "h", "q_idx", "kv_idx")
_OWN_NAMES = ("score_mod", "mask_mod", "mods_", "user_score_mod", "user_mask_mod", "ModArgs", "INFINITY")
_CXX_KEYWORDS = frozenset("""alignas alignof and and_eq asm auto bitand bitor bool break case catch char char16_t
char32_t char8_t class compl concept const consteval constexpr constinit const_cast continue co_await co_return
co_yield decltype default delete do double dynamic_cast else enum explicit export extern false float for friend goto
if inline int long mutable namespace new noexcept not not_eq nullptr operator or or_eq private protected public
register reinterpret_cast requires return short signed sizeof static static_assert static_cast struct switch
template this thread_local throw true try typedef typeid typename union unsigned using virtual void volatile wchar_t
while xor xor_eq""".split())
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# ModArgs in the kernels' parameters (snippets' aux tensors): 4 pointers, then 4 x 4 element strides.
MOD_ARGS = "4Q16q"
# The aux item mark of a tensor whose offsets need 64 bits (``needs_wide``).
WIDE = "wide"
_INT32_MAX = 2**31 - 1


def check_snippet(name: str, text) -> str:
    """A spec's ``score_mod`` / ``mask_mod``: the source text of a device-function body, or "" (off)."""
    if text is None:
        return ""
    if not isinstance(text, str):
        raise SpecError(name, type(text).__name__, "the source text of a CUDA device-function body, or '' (off)",
                        reason="must be a string")
    if text.startswith("sha:"):
        raise SpecError(name, text, "the snippet's source text",
                        reason="a spec's text form shows a snippet by its hash, which cannot be read back; pass the "
                               "source through the op's argument (score_mod=, mask_mod=) or a dict of the spec's fields")
    if not text.strip():
        return ""
    if len(text) > MAX_SNIPPET or "\0" in text:
        raise SpecError(name, f"<{len(text)} characters>", f"at most {MAX_SNIPPET} characters, no NUL")
    return text


def _check_name(name) -> str:
    if not isinstance(name, str) or not _IDENT.match(name) or name in _CXX_KEYWORDS or name in ARG_NAMES \
            or name in _OWN_NAMES or name.startswith("__") or name.lower().startswith("attngen"):
        raise SpecError("aux", name, "a C identifier that is no C++ keyword, not one of the snippets' arguments "
                        f"({', '.join(ARG_NAMES)}), not {', '.join(_OWN_NAMES)}, and not starting with __ or attngen")
    return name


def parse_aux(text) -> tuple[tuple[str, str, int, bool], ...]:
    """A spec's ``aux`` text (``name:dtype:ndim[:wide];...``, sorted by name) as (name, dtype, ndim, wide) tuples,
    checked. ``wide``: the tensor's element offsets are taken in 64 bits (``needs_wide``); without it, in 32."""
    if not text:
        return ()
    if not isinstance(text, str):
        raise SpecError("aux", type(text).__name__, "text 'name:dtype:ndim[:wide];...'", reason="must be a string")
    out = []
    for item in text.split(";"):
        parts = [x.strip() for x in item.strip().split(":")]
        if len(parts) not in (3, 4) or parts[3:] not in ([], [WIDE]):
            raise SpecError("aux", text, f"'name:dtype:ndim' or 'name:dtype:ndim:{WIDE}' items separated by ';'",
                            reason=f"item {item!r}")
        name, dtype, ndim = parts[:3]
        if dtype not in AUX_TYPES:
            raise SpecError("aux", text, ", ".join(AUX_TYPES), reason=f"dtype {dtype!r} of {name!r}")
        if ndim not in tuple(str(n) for n in range(1, MAX_NDIM + 1)):
            raise SpecError("aux", text, f"ndim 1 to {MAX_NDIM}", reason=f"ndim {ndim!r} of {name!r}")
        out.append((_check_name(name), dtype, int(ndim), len(parts) == 4))
    names = [item[0] for item in out]
    if len(out) > MAX_AUX or len(set(names)) != len(names):
        raise SpecError("aux", text, f"at most {MAX_AUX} tensors, each name once")
    return tuple(sorted(out))


def needs_wide(shape, strides) -> bool:
    """Whether some element of an array (``shape``, element ``strides``) lies 2^31 elements or more from its first:
    its accessor must then take offsets in 64 bits. The positive and the negative strides' reaches are bounded
    apart, so no partial sum of an in-range offset leaves 32 bits either."""
    if any(n == 0 for n in shape):
        return False
    up = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0)
    down = sum((n - 1) * -s for n, s in zip(shape, strides) if s < 0)
    return max(up, down) > _INT32_MAX


# C tokens, longest first where two could start at one place: comments and literals are skipped whole (a "h" in a
# printf format or a comment names nothing), pp-numbers too (the "b" of 0x1b is no identifier).
_TOKENS = re.compile(r"""//[^\n]*|/\*.*?(?:\*/|\Z)|"(?:\\.|[^"\\\n])*"?|'(?:\\.|[^'\\\n])*'?"""
                     r"|\.?[0-9](?:[eEpP][+-]|[A-Za-z0-9_.])*|([A-Za-z_][A-Za-z0-9_]*)|.", re.S)


def names_read(text: str) -> frozenset:
    """The identifiers a snippet's text names as C tokens: outside comments, string and character literals and
    numbers. A name inside a macro (``#define B b``) or a token pasting counts too, which only errs on the safe
    side."""
    return frozenset(m.group(1) for m in _TOKENS.finditer(text or "") if m.group(1))


def reads_batch_head(mask_mod: str) -> tuple[bool, bool]:
    """(reads b, reads h) of a ``mask_mod``: whether its text names the identifier ``b`` / ``h`` (``names_read``).
    A snippet that never names one cannot depend on it (its aux reads take only the indices it writes), so its block
    plan is one for every value of it: one plan per batch row shared by all heads, or one for the whole batch."""
    names = names_read(mask_mod)
    return "b" in names, "h" in names


def reads_aux(mask_mod: str, aux: str) -> bool:
    """Whether a ``mask_mod`` names one of the spec's ``aux`` tensors (``names_read``). Only then do its reads wait on
    memory: prefill's step keeps them in flight together, and its block plan keeps the keep bits of the tiles it
    keeps in part for the kernel to read instead (masks.py). A mask_mod of index arithmetic alone keeps the kernel it
    had: the code that reads a tile's slot took the d64 window kernel to 1.11x its time, with a pool or without."""
    return bool(names_read(mask_mod) & {item[0] for item in parse_aux(aux)})


def aux_text(items) -> str:
    """The canonical ``aux`` text of (name, dtype, ndim, wide) items."""
    return ";".join(f"{n}:{d}:{k}" + (f":{WIDE}" if w else "") for n, d, k, w in sorted(items))


def check_spec_fields(spec) -> tuple[str, str, str]:
    """(score_mod, mask_mod, aux) of a spec under construction, checked and canonical (the aux text sorted). (An
    aux that no snippet reads builds, and reads nothing; the ops refuse such a call.)"""
    return check_snippet("score_mod", spec.score_mod), check_snippet("mask_mod", spec.mask_mod), \
        aux_text(parse_aux(spec.aux))


# How a spec's text form shows a snippet: ``sha:`` and 8 hex digits of its content.
short = _snippet_short


def call_aux(aux) -> tuple[str, tuple]:
    """(canonical aux text, ((name, TensorInfo), ...) sorted by name) of an op's ``aux=`` dict, each checked to be
    a device array of a dtype aux takes with 1-4 dims, marked wide where its offsets need 64 bits; ``aux`` None or
    empty gives ("", ())."""
    if aux is None:
        return "", ()
    if not isinstance(aux, Mapping):
        raise LaunchError(f"aux must be a dict name -> device tensor; got {type(aux).__name__}")
    if len(aux) > MAX_AUX:
        raise LaunchError(f"aux has {len(aux)} tensors ({', '.join(map(str, aux))}); at most {MAX_AUX}")
    from ..runtime import tensor_info

    items, infos = [], []
    for name in sorted(aux, key=str):
        try:
            _check_name(name)
        except SpecError as e:
            raise LaunchError(f"aux name {name!r} is not allowed; allowed: {e.allowed}") from None
        t = aux[name]
        try:
            info = tensor_info(t, f"aux[{name!r}]")
        except LaunchError:
            raise
        except Exception:
            raise LaunchError(f"aux[{name!r}] must be a torch tensor or CuPy array on the device; got "
                              f"{type(t).__name__}") from None
        dtype = _INFO_DTYPES.get(info.dtype)
        if dtype is None:
            raise LaunchError(f"aux[{name!r}] has dtype {info.dtype}; allowed: {', '.join(AUX_TYPES)} (bool as uint8)")
        if not 1 <= len(info.shape) <= MAX_NDIM:
            raise LaunchError(f"aux[{name!r}] has {len(info.shape)} dims (shape {tuple(info.shape)}); allowed: 1 to "
                              f"{MAX_NDIM}")
        items.append((name, dtype, len(info.shape), needs_wide(info.shape, info.strides)))
        infos.append((name, info))
    return aux_text(items), tuple(infos)


def pack_aux(spec_aux: str, infos: tuple, qi) -> tuple:
    """The ModArgs values (4 pointers, 4 x 4 strides) of a call's checked aux ``infos`` (``call_aux``) for a kernel
    whose spec's aux text is ``spec_aux``: every tensor the spec names, of its dtype and ndim, on q's device and of
    q's kind, and marked wide where its offsets need 64 bits; none the spec does not name."""
    want = parse_aux(spec_aux)
    got = {name: info for name, info in infos}
    for name, dtype, ndim, wide in want:
        info = got.get(name)
        if info is None:
            raise LaunchError(f"aux[{name!r}] is missing: the kernel's snippets read {name} ({dtype}, {ndim} dims); "
                              f"the call passed {', '.join(got) or 'no aux'}")
        have = _INFO_DTYPES.get(info.dtype)
        if have != dtype or len(info.shape) != ndim:
            raise LaunchError(f"aux[{name!r}] is {info.dtype} with {len(info.shape)} dims; the spec says {dtype} with "
                              f"{ndim} dims")
        if info.kind != qi.kind or info.device != qi.device:
            raise LaunchError(f"aux[{name!r}] must be a {qi.kind} array on device {qi.device}; got {info.kind} on "
                              f"device {info.device}")
        if not wide and needs_wide(info.shape, info.strides):
            raise LaunchError(_wide_message(name, info.shape, info.strides, spec_aux))
    extra = sorted(set(got) - {item[0] for item in want})
    if extra:
        raise LaunchError(f"aux[{extra[0]!r}] is not read by the kernel: its spec's aux is "
                          f"{spec_aux or 'empty'}; pass only the tensors the snippets read")
    ptrs, strides = [0] * MAX_AUX, [0] * (MAX_AUX * MAX_NDIM)
    for k, (name, _, ndim, _) in enumerate(want):
        info = got[name]
        ptrs[k] = info.ptr
        strides[k * MAX_NDIM:k * MAX_NDIM + ndim] = info.strides
    return (*ptrs, *strides)


def _wide_message(name, shape, strides, spec_aux) -> str:
    return (f"aux[{name!r}] (shape {tuple(shape)}, strides {tuple(strides)}) has elements 2^31 or more apart, and the "
            f"spec's aux {spec_aux} reads it with 32-bit offsets; allowed: its item marked {name}:...:{WIDE} (64-bit "
            "offsets), or a spec whose aux is '' (the call's is taken)")


def mod_layout(layout: struct.Struct) -> struct.Struct:
    """``layout`` with ModArgs after it (a kernel with snippets): 8-byte aligned as the struct is."""
    s = _mod_layouts.get(layout.format)
    if s is None:
        pad = -layout.size % 8
        s = _mod_layouts[layout.format] = struct.Struct(layout.format + (f"{pad}x" if pad else "") + MOD_ARGS)
    return s


_mod_layouts: dict = {}


# --- code ----------------------------------------------------------------------------------------------------

def _accessor(k: int, name: str, dtype: str, ndim: int, wide: bool) -> str:
    elem, ret, conv = AUX_TYPES[dtype]
    # Offsets in 32 bits unless the tensor needs more (``needs_wide``, which the launch checks): a 64-bit multiply
    # is several instructions, and a mask_mod runs one per element of a partial tile.
    index = "long long" if wide else "int"
    args = ", ".join(f"{index} i{d}" for d in range(ndim))
    off = " + ".join(f"i{d} * " + (f"mods_.stride[{k}][{d}]" if wide else f"(int)mods_.stride[{k}][{d}]")
                     for d in range(ndim))
    # Through the read-only path: an aux tensor does not change while the kernel runs, so a read that repeats
    # (doc(b, q_idx) for every key of a row) is one load, hoisted out of the loop over the row's keys.
    read = conv.format(f"__ldg(static_cast<const {elem}*>(mods_.ptr[{k}]) + {off})")
    return f"  [[maybe_unused]] auto {name} = [&]({args}) -> {ret} {{ return {read}; }};\n"


def declarations(score_mod: str, mask_mod: str) -> str:
    """What the kernel's parameters and steps need before the snippets' definitions (``definitions``): the macros
    the plain headers test (params.cuh's ModArgs field; decode's call sites), ModArgs and the two functions."""
    return ("#define ATTNGEN_MODS 1\n" + ("#define ATTNGEN_SCORE_MOD 1\n" if score_mod else "")
            + ("#define ATTNGEN_MASK_MOD 1\n" if mask_mod else "")
            # NVRTC has no <math.h>: the snippets' INFINITY (its intrinsics give the rest of the CUDA math API)
            + "#ifndef INFINITY\n#define INFINITY __int_as_float(0x7f800000)\n#endif\n" +
            "namespace attngen {\n"
            "// The snippets' aux tensors (spec aux, in name order): pointers and element strides.\n"
            "struct ModArgs {\n  const void* ptr[4];\n  long long stride[4][4];\n};\n"
            "__device__ __forceinline__ float user_score_mod(const ModArgs& mods_, float score, int b, int h, int q_idx,"
            " int kv_idx);\n"
            "__device__ __forceinline__ bool user_mask_mod(const ModArgs& mods_, int b, int h, int q_idx, int kv_idx);\n"
            "}  // namespace attngen\n")


def definitions(score_mod: str, mask_mod: str, aux: str) -> str:
    """The two functions with the user's bodies, last in the translation unit (a snippet left "" gives the score
    unchanged / keeps every pair, and is never called)."""
    access = "".join(_accessor(k, *item) for k, item in enumerate(parse_aux(aux)))
    out = ["namespace attngen {\n",
           "__device__ __forceinline__ float user_score_mod(const ModArgs& mods_, float score, int b, int h, int q_idx,"
           " int kv_idx) {\n", access]
    out += ['#line 1 "score_mod"\n', score_mod.rstrip() + "\n"] if score_mod else ["  return score;\n"]
    out += ["}\n#line 1 \"attngen_mods\"\n"
            "__device__ __forceinline__ bool user_mask_mod(const ModArgs& mods_, int b, int h, int q_idx, int kv_idx) {\n",
            access]
    out += ['#line 1 "mask_mod"\n', mask_mod.rstrip() + "\n"] if mask_mod else ["  return true;\n"]
    out.append("}\n}  // namespace attngen\n")
    return "".join(out)


def template_context(score_mod: str, mask_mod: str, aux: str) -> dict:
    """The template values of a spec's snippet fields: ``mods`` (either snippet on), the two flags, and the code."""
    on = bool(score_mod or mask_mod or aux)
    # score_mod_positions: whether score_mod reads q_idx or kv_idx (prefill's step then runs it on whole tiles,
    # templates/prefill/step.cuh.jinja); mask_mod_aux: whether mask_mod reads an aux tensor (reads_aux)
    return dict(mods=on, has_score_mod=bool(score_mod), has_mask_mod=bool(mask_mod),
                score_mod_positions=bool(names_read(score_mod) & {"q_idx", "kv_idx"}),
                mask_mod_aux=reads_aux(mask_mod, aux),
                mods_decl=declarations(score_mod, mask_mod) if on else "", mods_defs=definitions(score_mod, mask_mod, aux) if on else "")


_LOG_LINE = re.compile(r'^(score_mod|mask_mod)\((\d+)\): (?:catastrophic )?error[^:]*: (.*)$', re.M)
_UNDEFINED = re.compile(r'identifier "([A-Za-z_][A-Za-z0-9_]*)" is undefined')


def snippet_error(e: CompileError, spec) -> AttngenError | None:
    """The error of a compile that failed at a snippet's line: a ``SpecError`` naming the field, the line (numbered
    from 1 in the user's snippet) and NVRTC's message there; where that message is an undefined name the snippet
    reads as a call (``doc(q_idx)``), a ``LaunchError`` naming the aux tensor the call did not pass. None where no
    error lies in a snippet."""
    m = _LOG_LINE.search(e.log or "")
    if m is None:
        return None
    field, line = m.group(1), int(m.group(2))
    lines = (getattr(spec, field, "") or "").splitlines()
    shown = lines[line - 1].strip() if 0 < line <= len(lines) else ""
    messages = [f"{f}({n}): {msg}" for f, n, msg in _LOG_LINE.findall(e.log)]
    undefined = _UNDEFINED.search(m.group(3))
    if undefined and re.search(rf"\b{undefined.group(1)}\s*\(", shown):
        name = undefined.group(1)
        # (the spec's aux is the call's where a call built it, so "the kernel's" covers both a call and a bare build)
        have = [item[0] for item in parse_aux(spec.aux)]
        held = f"the kernel's aux tensors are {', '.join(have)}" if have else "the kernel has no aux tensors"
        return LaunchError(f"aux[{name!r}] is missing: {field} line {line} reads {name}(...), and {held}; allowed: "
                           f"{name} passed in the call's aux= (or named in the spec's aux) (NVRTC: {messages[0]})")
    return SpecError(field, f"line {line}: {shown}" if shown else f"line {line}", "CUDA device code NVRTC compiles",
                     reason="NVRTC: " + "; ".join(messages[:3]))


# --- the ops' checks -----------------------------------------------------------------------------------------

def call_mods(score_mod, mask_mod, aux) -> tuple:
    """An op's snippet arguments as (score_mod, mask_mod, aux text, aux infos): the first three what the spec
    takes, the infos (``call_aux``) what the launch packs. Aux tensors without a snippet are refused."""
    score, mask = check_snippet("score_mod", score_mod), check_snippet("mask_mod", mask_mod)
    if aux and not (score or mask):
        names = ", ".join(map(str, aux)) if isinstance(aux, Mapping) else type(aux).__name__
        raise LaunchError(f"aux ({names}) is passed without a score_mod or mask_mod to read it")
    sig, infos = call_aux(aux)
    for name, _ in infos:
        if not re.search(rf"\b{name}\b", score) and not re.search(rf"\b{name}\b", mask):
            raise LaunchError(f"aux[{name!r}] is not read by the snippets (neither score_mod nor mask_mod names "
                              f"{name}); pass only the tensors they read")
    return score, mask, sig, infos


def check_spec_mods(spec, mods) -> None:
    """A caller's spec and the call's snippets (``call_mods``, None: none) must agree: each of the spec's snippet
    fields "" (the call's fill it in) or the call's own."""
    if spec is None:
        return
    call = ("", "", "") if mods is None else mods[:3]
    if spec.aux and spec.aux != call[2]:  # named by tensor: which one the call lacks, adds or types otherwise
        want = {item[0]: item[1:] for item in parse_aux(spec.aux)}
        got = {item[0]: item[1:] for item in parse_aux(call[2])}
        infos = dict(mods[3]) if mods else {}
        for name in sorted(set(want) | set(got)):
            if name not in got:
                raise LaunchError(f"aux[{name!r}] is missing: the spec's aux is {spec.aux}")
            if name not in want:
                raise LaunchError(f"aux[{name!r}] is not in the spec's aux {spec.aux}")
            if want[name][:2] != got[name][:2]:
                raise LaunchError(f"aux[{name!r}] is {got[name][0]} with {got[name][1]} dims; the spec's aux says "
                                  f"{want[name][0]} with {want[name][1]} dims")
            if got[name][2] != want[name][2]:
                info = infos[name]
                if got[name][2]:
                    raise LaunchError(_wide_message(name, info.shape, info.strides, spec.aux))
                raise LaunchError(f"aux[{name!r}] (shape {tuple(info.shape)}, strides {tuple(info.strides)}) has no "
                                  f"elements 2^31 or more apart, and the spec's aux {spec.aux} marks it {WIDE}; "
                                  f"allowed: the call's own aux {call[2]}, or a spec whose aux is ''")
    for name, got in zip(SNIPPET_FIELDS[:2], call):
        have = getattr(spec, name)
        if have and have != got:
            raise LaunchError(f"{name}: the spec has {name}={short(have)} but the call passes {short(got) or 'none'}; "
                              f"allowed: a spec whose {name} is '' (the call's is taken) or the call's own")


def mods_fields(mods) -> dict:
    """The spec fields of a plan key's snippets ((score_mod, mask_mod, aux text) or ())."""
    return dict(zip(SNIPPET_FIELDS, mods)) if mods else {}


def refuse_traced(op: str, score_mod, mask_mod, aux) -> None:
    """Snippets have no torch.compile op yet (a custom op's schema takes no dict of tensors): refused by name."""
    for name, value in (("score_mod", score_mod), ("mask_mod", mask_mod), ("aux", aux)):
        if value:
            raise LaunchError(f"{op}({name}=...) is not supported under torch.compile; allowed there: no score_mod, "
                              "mask_mod or aux (call the op outside the compiled region, e.g. through "
                              "torch.compiler.disable)")
