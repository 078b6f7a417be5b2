"""The MLA decode family: DeepSeek-V2/V3's absorbed multi-head latent attention against one shared
compressed cache, contiguous or paged, split-KV with an LSE merge."""

from ...family import Family, register
from .choose import reachable
from .defaults import candidates
from .op import mla_decode
from .spec import MlaDecodeSpec, QkShard

FAMILY = register(Family(
    name="mla_decode",
    spec=MlaDecodeSpec,
    candidates=candidates,
    reachable=reachable,
    template="mla_decode/mla_decode.cu.jinja",
    summary="MLA decode: q_len 1..4, heads 1..128 against one ckv+kpe cache (contiguous or paged), "
            "qk_shard, split-KV",
    exports={"mla_decode": mla_decode, "MlaDecodeSpec": MlaDecodeSpec, "QkShard": QkShard},
    bench="attngen.families.mla_decode.bench",
))
