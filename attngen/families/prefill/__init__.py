"""The prefill family: a FlashAttention-2-style forward pass (mma.sync everywhere, wgmma on sm_90a)."""

from ...family import Family, register
from .choose import reachable
from .defaults import candidates
from .masks import MaskPlan
from .op import mask_plan, prefill
from .spec import MaskMode, Mma, Persistent, Pipeline, PrefillSpec, Schedule
from .varlen import prefill_varlen

FAMILY = register(Family(
    name="prefill",
    spec=PrefillSpec,
    candidates=candidates,
    reachable=reachable,
    template="prefill/prefill.cu.jinja",
    # The snippets' code (ModArgs, the accessors, the two functions) is pasted into the source from there; fp8.py
    # and rows.py compute template context (fp8 rows' widths and formats, every tile's row widths).
    context_modules=("attngen.families.snippets", "attngen.families.prefill.fp8", "attngen.families.prefill.rows"),
    summary="attention forward: dense, varlen or paged; causal, sliding window, custom masks (live-tile lists), GQA",
    tuning="attngen.families.prefill.tuning",
    exports={"prefill": prefill, "prefill_varlen": prefill_varlen, "mask_plan": mask_plan, "MaskPlan": MaskPlan,
             "PrefillSpec": PrefillSpec, "MaskMode": MaskMode, "Mma": Mma, "Pipeline": Pipeline,
             "Schedule": Schedule, "Persistent": Persistent},
    bench="attngen.families.prefill.bench",
))
