"""The spec-field table the key and render tests vary one field at a time.

Every value each field may take. A field added to PrefillSpec must be added here, or the tests
that use this table fail: that is the point (FlashInfer's "every codegen arg feeds the name").
"""

from attngen.spec import DType
from attngen import MaskMode, Mma, Persistent, Pipeline, PrefillSpec, Schedule

FIELD_VALUES = {
    "head_dim": PrefillSpec.HEAD_DIMS,
    "dtype": tuple(DType),
    "mask": tuple(MaskMode),
    "return_lse": (False, True),
    "cta_tile_q": PrefillSpec.CTA_TILE_Q,
    "cta_tile_kv": PrefillSpec.CTA_TILE_KV,
    "num_warps": PrefillSpec.NUM_WARPS,
    "num_stages": PrefillSpec.NUM_STAGES,
    "mma": tuple(Mma),
    "softcap": (False, True),
    "alibi": (False, True),
    "sinks": (False, True),
    "custom_mask": (False, True),
    "varlen": (False, True),
    "paged": (False, True),  # alone it is refused (paged needs varlen): tests skip what does not fit
    "page_rows": (False, True),  # alone it is refused too (it needs paged): the paged base below varies it
    "head_dim_v": PrefillSpec.HEAD_DIM_V,
    "head_dim_chunk": PrefillSpec.HEAD_DIM_CHUNK,
    "pipeline": tuple(Pipeline),
    "schedule": tuple(Schedule),
    "persistent": tuple(Persistent),
    # a user's variant (attngen/families/snippets.py): source text and the aux tensors' signature
    "score_mod": ("", "return score * 0.5f;"),
    "mask_mod": ("", "return kv_idx <= q_idx;"),
    "aux": ("", "t:fp32:1"),
    # (custom_mask with a mask_mod) the keep bits of every partial tile read from the block plan's pool
    "mod_bits": (False, True),
    # (a score_mod on wgmma) Q's tile times sm_scale in registers
    "q_scaled": (False, True),
    # q, k and v in fp8 (attngen/families/prefill/fp8.py)
    "qkv_dtype": ("", "fp8_e4m3"),
    # an fp8 cache under a 16-bit q (varlen), widened in shared memory
    "kv_dtype": ("", "fp8_e4m3", "fp8_e5m2"),
}
# A resolved spec from which every field can change alone and still fit sm_90.
BASE = PrefillSpec(head_dim=64, dtype=DType.BF16, mask=MaskMode.NONE, return_lse=False,
                   cta_tile_q=128, cta_tile_kv=32, num_warps=4, num_stages=2, mma=Mma.SYNC,
                   pipeline=Pipeline.SYNC)
# (base, arch) pairs the resolve-based tests vary from: between them every field changes alone
# (mma=wgmma needs sm_90a and cta_tile_q = 16 x num_warps, so the second base exists for it).
# A third, varlen, lets paged (which needs varlen) change alone; a fourth, the chunked kernel
# (head_dim 512), its chunk width and head_dim_v; a fifth, on wgmma, pipeline (tma runs on wgmma only);
# a sixth, the TMA pipeline with two consumer warpgroups, schedule (pingpong takes turns between two) and
# persistent (the TMA pipeline only); a seventh, paged, page_rows; an eighth, fp8's tiles (head_dim 128, 128x128 on
# two consumer warpgroups, one CTA a tile), qkv_dtype; a ninth, a custom mask with a mask_mod that reads aux,
# mod_bits; a tenth, a score_mod on the TMA pipeline, q_scaled.
CHUNKED_BASE = PrefillSpec(head_dim=512, dtype=DType.BF16, cta_tile_q=64, cta_tile_kv=64, num_warps=8, num_stages=2,
                           mma=Mma.SYNC, head_dim_chunk=64, pipeline=Pipeline.SYNC)
BASES = ((BASE, "sm_90"), (BASE.replace(cta_tile_q=64), "sm_90a"), (BASE.replace(varlen=True), "sm_90"),
         (CHUNKED_BASE, "sm_90"), (BASE.replace(cta_tile_q=64, mma=Mma.WGMMA), "sm_90a"),
         (BASE.replace(cta_tile_q=128, num_warps=8, mma=Mma.WGMMA, pipeline=Pipeline.TMA), "sm_90a"),
         (BASE.replace(varlen=True, paged=True), "sm_90"),
         (BASE.replace(head_dim=128, cta_tile_q=128, cta_tile_kv=128, num_warps=8, mma=Mma.WGMMA, pipeline=Pipeline.TMA,
                       schedule=Schedule.SERIAL, persistent=Persistent.OFF), "sm_90a"),
         (BASE.replace(custom_mask=True, mask_mod="return kv_idx <= q_idx + t(0);", aux="t:int32:1"), "sm_90"),
         (BASE.replace(cta_tile_q=128, num_warps=8, mma=Mma.WGMMA, pipeline=Pipeline.TMA,
                       score_mod="return score * 0.5f;"), "sm_90a"))
