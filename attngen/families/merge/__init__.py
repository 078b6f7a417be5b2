"""The merge family: partial attention results (values and their LSE) combined into one, as split-KV, a
shared prefix or context-parallel attention need."""

from ...family import Family, register
from .choose import reachable
from .defaults import candidates
from .op import merge_state, merge_states
from .spec import MergeSpec

FAMILY = register(Family(
    name="merge",
    spec=MergeSpec,
    candidates=candidates,
    reachable=reachable,
    template="merge/merge.cu.jinja",
    summary="merge partial attention states (values + LSE) through their LSE: two tensors or a states dim",
    exports={"merge_state": merge_state, "merge_states": merge_states, "MergeSpec": MergeSpec},
))
