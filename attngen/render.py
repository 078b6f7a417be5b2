"""Rendering: a resolved spec -> one self-contained CUDA translation unit.

Templates only bind constants (``constexpr int HEAD_DIM = {{ head_dim }};``); the algorithm
lives in the included pieces under ``templates/common/``. Every included piece is bracketed
with ``// attngen:begin NAME`` / ``// attngen:end NAME`` so a compile error can name the
template a bad line came from.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jinja2

from .arch import Arch, get_arch
from .spec import DecodeSpec, Mma, Spec, resolve

# Threads of a decode module's `_merge` entry: one warp per output row.
MERGE_THREADS = 128

_PKG_TEMPLATES = "templates"


def templates_dir() -> Path:
    """The template folder: the checkout's ``templates/`` or the copy inside the wheel."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "templates", here / "templates"):
        if (cand / "common").is_dir():
            return cand
    raise FileNotFoundError(f"attngen templates not found next to {here}")


class _MarkedLoader(jinja2.FileSystemLoader):
    def get_source(self, environment, template):
        source, filename, uptodate = super().get_source(environment, template)
        if "/" in template and template.endswith(".jinja"):
            # A piece that writes out long PTX operand lists with loops (wgmma); still no spec
            # values in it, only the instruction shapes.
            source = f"// attngen:begin {template}\n{source.rstrip()}\n// attngen:end {template}\n"
        elif "/" in template:
            # Included pieces are plain CUDA headers (PTX operand lists like "{%0, %1}" would
            # read as Jinja tags): they are pasted verbatim, never parameterised.
            source = (f"// attngen:begin {template}\n{{% raw %}}{source.rstrip()}\n{{% endraw %}}"
                      f"// attngen:end {template}\n")
        return source, filename, uptodate


def bytecode_dir(root: "str | Path") -> str | None:
    """Where Jinja keeps compiled templates between processes: ``<cache root>/v1/jinja``.

    A warm load in a fresh process still renders its source (the cache key hashes it), and
    compiling the templates, the wgmma piece's loops above all, was most of that (~20 ms).
    Jinja checks each entry against the template's source checksum and writes atomically;
    None (no bytecode cache) where the folder cannot be made."""
    from .cache import LAYOUT_VERSION

    d = Path(root) / LAYOUT_VERSION / "jinja"
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return str(d)


class _BytecodeCache(jinja2.FileSystemBytecodeCache):
    """Jinja's file cache (atomic writes, source checksums) where a damaged entry is a miss."""

    def load_bytecode(self, bucket) -> None:
        try:
            super().load_bytecode(bucket)
        except Exception:
            bucket.reset()


@functools.lru_cache(maxsize=None)
def environment(path: str | None = None, bytecode: str | None = None) -> jinja2.Environment:
    return jinja2.Environment(
        loader=_MarkedLoader(path or str(templates_dir())),
        bytecode_cache=_BytecodeCache(bytecode) if bytecode else None,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def template_context(spec: Spec) -> dict:
    """Every value a template may read: the spec's fields as plain values plus derived constants."""
    ctx = spec.to_dict()
    ctx.update(
        kernel_name=spec.kernel_name,
        is_bf16=spec.dtype.value == "bf16",
        q_in_regs=spec.q_in_regs,
        smem_bytes=spec.smem_bytes(),
        threads=spec.threads,
    )
    if isinstance(spec, DecodeSpec):
        ctx.update(warps_m=spec.warps_m, merge_threads=MERGE_THREADS)
    else:
        ctx.update(
            mask_mode={"none": 0, "causal": 1, "sliding_window": 2}[spec.mask.value],
            smem_row_elems=spec.smem_row_elems,
            swizzle=spec.head_dim % 64 == 0,
            wgmma=spec.mma is Mma.WGMMA,
        )
    return ctx


def render(spec: Spec, arch: "str | Arch | None" = None, *, bytecode: str | None = None) -> str:
    """Render the CUDA source for ``spec``.

    Unresolved tuning fields are filled for ``arch`` (default sm_90). The result is
    deterministic: the same spec gives the same bytes in any process. ``bytecode`` names a
    folder for compiled templates (the cache passes ``bytecode_dir(root)``); without it nothing
    is written anywhere.
    """
    if not spec.is_resolved:
        spec = resolve(spec, get_arch(arch or "sm_90"))
    tmpl = environment(None, bytecode).get_template(spec.template)
    return tmpl.render(**template_context(spec))
