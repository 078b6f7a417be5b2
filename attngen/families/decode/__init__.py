"""The decode family: a few new tokens against a KV cache, GQA-packed, split-KV, contiguous or paged."""

from ...family import Family, register
from .choose import reachable
from .defaults import candidates
from .op import decode
from .spec import DecodeSpec, Variant

FAMILY = register(Family(
    name="decode",
    spec=DecodeSpec,
    candidates=candidates,
    reachable=reachable,
    template="decode/decode.cu.jinja",
    # The snippets' code (ModArgs, the accessors, the two functions) is pasted into the source from there.
    context_modules=("attngen.families.snippets",),
    summary="q_len 1..8 against a KV cache (contiguous or paged), GQA-packed, split-KV with an LSE merge",
    tuning="attngen.families.decode.tuning",
    exports={"decode": decode, "DecodeSpec": DecodeSpec, "Variant": Variant},
    bench="attngen.families.decode.bench",
))
