"""The one exception hierarchy of attngen.

Every error a user can meet is an ``AttngenError``; the subclass says which stage of the
pipeline refused (spec, compile, cache, launch).
"""

from __future__ import annotations


class AttngenError(Exception):
    """Base of every error attngen raises on purpose."""


class SpecError(AttngenError, ValueError):
    """A spec (or a spec's text form) is invalid, or does not fit the target arch.

    Carries the offending ``field``, its ``value`` and what is ``allowed`` so that callers
    (and the CLI's ``--json``) can report them without parsing the message.
    """

    def __init__(self, field: str, value, allowed: str, *, reason: str | None = None):
        self.field = field
        self.value = value
        self.allowed = allowed
        self.reason = reason
        msg = f"{field}={value!r} is not allowed"
        if reason:
            msg += f": {reason}"
        msg += f"; allowed: {allowed}"
        super().__init__(msg)


class CompileError(AttngenError):
    """NVRTC refused a source. Keeps the log, the source and the options."""

    def __init__(self, message: str, *, log: str = "", source: str = "", name: str = "",
                 options: tuple[str, ...] = ()):
        self.log = log
        self.source = source
        self.name = name
        self.options = tuple(options)
        super().__init__(message)

    def __str__(self) -> str:
        parts = [self.args[0]]
        if self.options:
            parts.append("options: " + " ".join(self.options))
        if self.log:
            parts.append("NVRTC log:\n" + self.log.rstrip())
        excerpt = self.source_excerpt()
        if excerpt:
            parts.append(excerpt)
        return "\n".join(parts)

    def error_lines(self) -> list[int]:
        """Line numbers (1-based) the NVRTC log blames."""
        import re

        lines = []
        for m in re.finditer(r"\((\d+)\): (?:error|catastrophic error)", self.log):
            n = int(m.group(1))
            if n not in lines:
                lines.append(n)
        return lines

    def source_excerpt(self, context: int = 3) -> str:
        """Numbered source lines around each error, with the template they came from."""
        if not self.source:
            return ""
        src = self.source.splitlines()
        out = []
        for n in self.error_lines():
            origin = _template_origin(src, n)
            head = f"--- around line {n}" + (f" (from {origin})" if origin else "") + " ---"
            out.append(head)
            for i in range(max(1, n - context), min(len(src), n + context) + 1):
                mark = ">>" if i == n else "  "
                out.append(f"{mark}{i:6d} | {src[i - 1]}")
        return "\n".join(out)


def _template_origin(src_lines: list[str], line: int) -> str:
    """The template piece a rendered line came from.

    The renderer brackets every included piece with ``// attngen:begin NAME`` /
    ``// attngen:end NAME`` comments; the innermost open one at ``line`` is the origin.
    """
    stack: list[str] = []
    for text in src_lines[: max(0, line - 1)]:
        s = text.strip()
        if s.startswith("// attngen:begin "):
            stack.append(s[len("// attngen:begin "):])
        elif s.startswith("// attngen:end ") and stack:
            stack.pop()
    return stack[-1] if stack else ""


class ManifestError(AttngenError, ValueError):
    """A pre-warm manifest is missing, is not TOML, or is not shaped like a manifest."""


class CacheError(AttngenError):
    """The on-disk cache could not be used (lock timeout, unreadable bundle, ...)."""


class LaunchError(AttngenError, ValueError):
    """Bad tensors or a failed launch; raised before anything is enqueued where possible."""
