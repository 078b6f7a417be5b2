"""What a cache entry must be before its cubin is served: its files parsed without ever crashing,
its metadata's fields of the right types, its metadata agreeing with the key it sits under, and
its cubin agreeing with both (an ELF for the key's arch that holds the kernel's symbol, with the
register count the metadata reports). A checksum alone says only that the sidecar was written
with the cubin; these say that the pair is what the key asked for.

``entry_problem`` returns the first thing wrong, as text naming the field, or None; a caller
treats any problem as a miss and ``attngen cache verify`` prints it.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import struct
import zlib

from .arch import get_arch
from .cache_key import key_of
from .compiler import cubin_resources
from .errors import AttngenError

_EM_CUDA = 190
_INT_FIELDS = ("registers", "smem_static", "stack_frame", "spill_stores", "spill_loads")


def load_json(raw: bytes):
    """``json.loads`` for bytes read from a root: anything that does not parse (nesting deep enough
    to exhaust the interpreter's recursion, integers past its digit limit, bad UTF-8) is a
    ValueError, never another exception."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except (ValueError, TypeError) as e:
        raise ValueError(str(e)[:200]) from None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def meta_type_problem(meta) -> "str | None":
    """The first metadata field of the wrong type, as text, or None."""
    if not isinstance(meta, dict):
        return "meta.json is not a JSON object"
    for k in ("key", "kernel_name", "arch", "nvrtc", "cubin_sha256"):
        if not isinstance(meta.get(k), str):
            return f"meta.json's {k} is {meta.get(k)!r:.60}, not a string"
    if not isinstance(meta.get("log", ""), str):
        return f"meta.json's log is {type(meta.get('log')).__name__}, not a string"
    opts = meta.get("options")
    if not isinstance(opts, list) or not all(isinstance(o, str) for o in opts):
        return f"meta.json's options is {opts!r:.60}, not a list of strings"
    secs = meta.get("compile_seconds", 0.0)
    if not (_is_int(secs) or isinstance(secs, float)):
        return f"meta.json's compile_seconds is {secs!r:.60}, not a number"
    res = meta.get("resources")
    if not isinstance(res, dict):
        return "meta.json's resources is not an object"
    for k in _INT_FIELDS:
        if not _is_int(res.get(k, 0)) or res.get(k, 0) < 0:
            return f"meta.json's resources.{k} is {res.get(k)!r:.60}, not a count"
    if not isinstance(res.get("known", True), bool):
        return "meta.json's resources.known is not true or false"
    if not isinstance(meta.get("key_material"), dict):
        return "meta.json's key_material is not an object"
    return None


def elf_sm(cubin: bytes) -> "int | None":
    """The SM number (80, 86, 90, 100, 120, ...) a CUDA ELF is built for, or None when it is not one.
    Its ELF ABI version 8 (NVRTC 13) keeps the SM in bits 8-15 of e_flags; earlier ones in bits 0-7."""
    if len(cubin) < 0x40 or cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        return None
    if struct.unpack_from("<H", cubin, 0x12)[0] != _EM_CUDA:
        return None
    flags = struct.unpack_from("<I", cubin, 0x30)[0]
    return (flags >> 8) & 0xFF if cubin[8] >= 8 else flags & 0xFF


def elf_symbols(cubin: bytes) -> "set[bytes] | None":
    """The names in the cubin's symbol table, or None when it has none that can be read."""
    try:
        shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
        heads = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
        for h in heads:
            if h[1] == 2:  # SHT_SYMTAB
                strtab = heads[h[6]]
                names = set()
                for i in range(h[5] // 24):
                    at = strtab[4] + struct.unpack_from("<I", cubin, h[4] + 24 * i)[0]
                    names.add(cubin[at:cubin.index(b"\0", at)])
                return names
    except (struct.error, ValueError, IndexError):
        return None
    return None


def entry_problem(key: str, meta, cubin: bytes) -> "str | None":
    """Why the entry (``meta`` parsed from its meta.json, ``cubin`` its object code) under ``key`` is
    not to be served, or None."""
    why = meta_type_problem(meta)
    if why:
        return why
    if meta["key"] != key:
        return "meta.json's key is not the key it is stored under"
    if meta["cubin_sha256"] != hashlib.sha256(cubin).hexdigest():
        return "kernel.cubin does not match meta.json's cubin_sha256"
    material = meta["key_material"]
    try:
        if key_of(material) != key:
            return "meta.json's key_material does not hash to its key"
    except (TypeError, ValueError, RecursionError):
        return "meta.json's key_material cannot be hashed"
    for k in ("arch", "nvrtc", "options"):
        if material.get(k) != meta[k]:
            return f"meta.json's {k} {meta[k]!r:.60} is not the key's {material.get(k)!r:.60}"
    try:
        a = get_arch(meta["arch"])
    except AttngenError:
        return f"meta.json's arch {meta['arch']!r:.60} is not an arch attngen knows"
    sm = elf_sm(cubin)
    if sm is None:
        return "kernel.cubin is not a CUDA ELF"
    if sm != a.major * 10 + a.minor:
        return f"kernel.cubin is built for sm_{sm}, not for the key's arch {a.name}"
    symbols = elf_symbols(cubin)
    if symbols is None or meta["kernel_name"].encode() not in symbols:
        return f"kernel.cubin has no symbol for meta.json's kernel_name {meta['kernel_name']!r:.80}"
    regs = cubin_resources(cubin, meta["kernel_name"]).registers
    if regs and regs != meta["resources"].get("registers", 0):
        return (f"meta.json's resources.registers {meta['resources'].get('registers')} is not the cubin's "
                f"{regs}")
    return None


# kernel.cu is stored gzip-compressed: the rendered sources are most of a cache's bytes. Entries
# written before hold plain text, which still reads.
def pack_source(text: str) -> bytes:
    return gzip.compress(text.encode(), compresslevel=6, mtime=0)


def unpack_source(raw: bytes) -> "str | None":
    """The text of a stored kernel.cu (compressed or plain), or None when it is neither."""
    try:
        if raw[:2] == b"\x1f\x8b":
            return gzip.decompress(raw).decode()
        return raw.decode()
    except (OSError, EOFError, zlib.error, UnicodeDecodeError):
        return None
