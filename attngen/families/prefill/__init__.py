"""The prefill family: a FlashAttention-2-style forward pass (mma.sync everywhere, wgmma on sm_90a)."""

from ...family import Family, register
from .defaults import candidates
from .op import prefill
from .spec import MaskMode, Mma, PrefillSpec

FAMILY = register(Family(
    name="prefill",
    spec=PrefillSpec,
    candidates=candidates,
    template="prefill.cu.jinja",
    summary="attention forward over [batch, seqlen, heads, head_dim]: causal, sliding window, GQA, LSE",
    tuning="attngen.families.prefill.tuning",
    exports={"prefill": prefill, "PrefillSpec": PrefillSpec, "MaskMode": MaskMode, "Mma": Mma},
    bench="attngen.families.prefill.bench",
))
