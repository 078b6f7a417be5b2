"""FlashAttention's entry points refuse what attngen does not do, clearly and before touching a tensor."""

from __future__ import annotations

import pytest

import attngen
from attngen import LaunchError


@pytest.mark.parametrize("kw,needle", [
    ({"dropout_p": 0.1}, "dropout_p=0.1 is not supported"),
    ({"return_attn_probs": True}, "return_attn_probs=True is not supported"),
])
def test_flash_attn_func_refuses(kw, needle):
    with pytest.raises(LaunchError, match=needle):
        attngen.flash_attn_func(None, None, None, **kw)


@pytest.mark.parametrize("kw,needle", [
    ({"rotary_cos": 1}, "rotary_cos is not supported"),
    ({"cache_leftpad": 1}, "cache_leftpad is not supported"),
    ({"window_size": (128, 0), "cache_seqlens": 1}, r"window_size=\(128, 0\) is not supported"),
    ({}, "cache_seqlens is required"),
    ({"cache_seqlens": 1, "k": 1}, "k and v go together"),
])
def test_flash_attn_with_kvcache_refuses(kw, needle):
    with pytest.raises(LaunchError, match=needle):
        attngen.flash_attn_with_kvcache(None, None, None, **kw)


def test_score_modifiers_are_spec_fields_in_the_key():
    a = attngen.parse_spec("prefill:head_dim=128,softcap=true")
    b = attngen.parse_spec("decode:head_dim=128,alibi=true")
    assert a.softcap and not a.alibi and b.alibi and not b.softcap
    assert a.kernel_name != attngen.PrefillSpec(head_dim=128).kernel_name
    src = attngen.render(attngen.resolve(a, "sm_90a"))
    assert "constexpr bool SOFTCAP = true;" in src and "constexpr bool ALIBI = false;" in src
