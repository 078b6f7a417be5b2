"""attngen: attention kernels generated from specs, compiled with NVRTC, cached on disk."""

from .__version__ import __version__
from .arch import ARCHS, get_arch
from .cache import DiskCache, build, cache_root
from .compiler import Binary, compile
from .errors import AttngenError, CacheError, CompileError, LaunchError, ManifestError, SpecError
from .ops.decode import decode
from .ops.prefill import prefill
from .render import render
from .runtime import Kernel, get_kernel
from .spec import DecodeSpec, DType, MaskMode, Mma, PrefillSpec, Variant, parse_spec, resolve, validate

__all__ = [
    "__version__", "ARCHS", "get_arch", "DiskCache", "build", "cache_root", "Binary", "compile",
    "AttngenError", "CacheError", "CompileError", "LaunchError", "ManifestError", "SpecError", "decode", "prefill", "render", "Kernel",
    "get_kernel", "DType", "MaskMode", "Mma", "PrefillSpec", "DecodeSpec", "Variant", "parse_spec", "resolve", "validate",
]
