"""The cache key: the SHA-256 of the canonical JSON of everything that can change a binary.

The key hashes the resolved spec and the family's template files and template-context code
(``render.family_digests``), not the rendered source, so a hit neither renders nor imports Jinja.
Bump ``KEY_SCHEMA`` when what goes into the key changes (``tests/test_key_stability.py`` holds a
table of keys that such a bump updates).
"""

from __future__ import annotations

import hashlib
import json

from .__version__ import __version__
from .arch import Arch
from .compiler import nvrtc_version
from .family import family_of
from .render import family_digests
from .spec import Spec

# 2: the template files and template-context code are hashed instead of the rendered source.
# 3: kernels are named by their spec's readable parts and an 8-digit digest (SpecBase.kernel_name), and the
#    template files are named by their paths under templates/<family>/ and templates/common/.
KEY_SCHEMA = 3


def key_material(spec: Spec, arch: Arch, options: tuple[str, ...], digests: "dict[str, str] | None" = None) -> dict:
    """Everything that can change the binary: the resolved spec, the digests of the family's
    template files and template-context code (default: ``render.family_digests``), the options,
    the NVRTC version, the arch, attngen's version and the key schema. The key is the SHA-256 of
    its canonical JSON."""
    if digests is None:
        digests = family_digests(family_of(spec))
    return {
        "schema": KEY_SCHEMA,
        "attngen": __version__,
        "spec": spec.to_dict(),
        "templates_sha256": digests["templates"],
        "code_sha256": digests["code"],
        "options": list(options),
        "nvrtc": nvrtc_version(),
        "arch": arch.name,
    }


def key_of(material: dict) -> str:
    return hashlib.sha256(json.dumps(material, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
