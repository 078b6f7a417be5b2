"""attngen: attention kernels generated from specs, compiled with NVRTC, cached on disk.

Each kernel family adds its own public names (its op, e.g. ``attngen.prefill``, its spec class
and enums) through its registration (``Family.exports``), so a new family needs no line here.
"""

from .__version__ import __version__
from .arch import ARCHS, get_arch
from .builder import BuildResult, build
from .cache import DiskCache
from .cascade import cascade_decode
from .cache_env import cache_root
from .compiler import Binary, Resources, compile
from .errors import AttngenError, CacheError, CompileError, LaunchError, ManifestError, SpecError
from .family import Family, get_family, register
from .flash_api import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                        flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
from .family import families as _families
from .render import render
from .serving import BatchAttention
from .runtime import Kernel, get_kernel
from .spec import DType, parse_spec, resolve, validate

__all__ = [
    "__version__", "ARCHS", "get_arch", "DiskCache", "build", "BuildResult", "cache_root", "Binary", "Resources",
    "compile",
    "AttngenError", "CacheError", "CompileError", "LaunchError", "ManifestError", "SpecError",
    "render", "Kernel", "get_kernel", "DType", "parse_spec", "resolve", "validate",
    "Family", "get_family", "register", "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
    "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func", "cascade_decode", "BatchAttention",
]

try:
    _loaded = _families()
except SpecError:  # a bad ATTNGEN_FAMILIES: the first call that needs the families (the CLI's too) says so
    from .family import _registry

    _loaded = tuple(_registry.values())
    del _registry
for _family in _loaded:
    globals().update(_family.exports)
    __all__ += [n for n in _family.exports if n not in __all__]
del _family, _families, _loaded

if "torch" in __import__("sys").modules:  # torch.compile support; without torch: import attngen.torch_ops
    try:
        from . import torch_ops as _torch_ops  # noqa: F401
    except Exception as _e:  # a torch without torch.library.custom_op (< 2.4): eager calls still work
        __import__("logging").getLogger("attngen").warning("attngen's torch custom ops not registered: %s", _e)
