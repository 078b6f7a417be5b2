"""attngen.BatchAttention's checks that need no GPU (the GPU tests: tests/test_gpu_serving.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import attngen  # noqa: E402


@pytest.mark.parametrize("args,kw,field", [
    ((32, 5, 128, 16), {}, "num_kv_heads"),
    ((32, 8, 128, 0), {}, "page_size"),
    ((32, 8, 300, 16), {}, "head_dim"),
    ((32, 8, 128, 16), {"max_decode_q_len": 33}, "max_decode_q_len"),
    ((32, 8, 128, 16), {"max_decode_q_len": 0}, "max_decode_q_len"),
    ((32, 8, 128, 16), {"dtype": torch.float32}, "dtype"),
    ((32, 8, 128, 16), {"window": (1, 2, 3)}, "window"),
    ((True, 8, 128, 16), {}, "num_heads"),
    ((32, 8, 128, 16), {"kv_dtype": torch.int8}, "kv_dtype"),
    ((32, 8, 128, 16), {"kv_dtype": "fp8"}, "kv_dtype"),
    ((32, 8, 128, 16), {"kv_dtype": torch.float8_e4m3fnuz}, "kv_dtype"),
])
def test_bad_construction_names_the_field(args, kw, field):
    with pytest.raises(attngen.LaunchError, match=field):
        attngen.BatchAttention(*args, **kw)


@pytest.mark.parametrize("page", [1, 2, 3, 8, 24, 16, 64, 256])
def test_any_page_size_is_taken(page):
    assert attngen.BatchAttention(32, 8, 128, page).page_size == page


@pytest.mark.parametrize("given,fmt", [(None, None), (torch.float8_e4m3fn, "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2"),
                                       (torch.float8_e5m2, "fp8_e5m2")])
def test_kv_dtype_names_the_cache_format(given, fmt):
    kv = attngen.BatchAttention(32, 8, 128, 16, kv_dtype=given).kv
    assert (kv and kv.value) == fmt


def test_the_decode_bound_follows_the_group():
    assert attngen.BatchAttention(8, 8, 64, 16, max_decode_q_len=128).max_decode_q_len == 128
    assert attngen.BatchAttention(32, 8, 128, 16).max_decode_q_len == 8


def test_plan_refuses_host_lengths_and_mismatched_batches():
    ba = attngen.BatchAttention(32, 8, 128, 16)
    cu = torch.zeros(5, dtype=torch.int32)
    with pytest.raises(attngen.LaunchError, match="cu_seqlens_q must be an int32 CUDA tensor"):
        ba.plan(cu, torch.zeros(4, dtype=torch.int32), torch.zeros(4, 2, dtype=torch.int32), total_q=4)
    with pytest.raises(attngen.LaunchError, match="total_q"):
        ba.plan(cu, cu, cu, total_q=-1)


def test_run_before_plan_is_refused():
    ba = attngen.BatchAttention(32, 8, 128, 16)
    q = torch.zeros(4, 32, 128, dtype=torch.bfloat16)
    with pytest.raises(attngen.LaunchError, match="before plan"):
        ba.run(q, q, q)


def test_bench_step_is_a_command():
    from attngen.bench import build_parser

    args = build_parser().parse_args(["step", "--decode", "4"])
    assert args.decode == 4 and args.func.__name__ == "cmd_step" and args.kv_dtype == "bf16"
    assert build_parser().parse_args(["step", "--kv-dtype", "fp8_e4m3"]).kv_dtype == "fp8_e4m3"


def test_plan_refuses_more_requests_than_it_sorts():
    from attngen.serving import MAX_PLAN_BATCH

    ba = attngen.BatchAttention(32, 8, 128, 16)
    b = MAX_PLAN_BATCH + 1
    cu, lens, table = torch.zeros(b + 1, dtype=torch.int32), torch.zeros(b, dtype=torch.int32), torch.zeros(
        b, 2, dtype=torch.int32)
    with pytest.raises(attngen.LaunchError, match=f"cache_seqlens has {b} requests; .* at most {MAX_PLAN_BATCH}"):
        ba.plan(cu, lens, table, total_q=b)
    assert MAX_PLAN_BATCH == 4096


def test_an_fp8_cache_with_sinks_is_refused_before_any_launch():
    """BatchAttention.run resolves the fp8 cache's prefill kernel with sinks before launching (fp8_op.cache_route):
    that kernel has no sinks form, so the call names sinks; without sinks it resolves."""
    from attngen.families.decode.spec import KVDType
    from attngen.families.prefill.fp8_op import cache_route

    with pytest.raises(attngen.SpecError, match="sinks"):
        cache_route(128, "bf16", KVDType.FP8_E4M3, True, 1, False, False, True, "sm_90a")
    assert cache_route(128, "bf16", KVDType.FP8_E4M3, True, 1, False, False, False, "sm_90a").kv_dtype == "fp8_e4m3"

