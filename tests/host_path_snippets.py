"""Run by tests/test_snippets.py in a process of its own: score_mod / mask_mod snippets and their aux tensors through
every prefill entry point on the stub driver (an sm_90 device, so the choice takes the TMA kernels where it would).

Each entry point is called with a snippet reading two aux tensors: the kernel launched must carry the snippets
(spec score_mod / mask_mod / aux) and its parameters must end with ModArgs: the aux tensors' pointers in name order,
then each one's element strides (params.cuh). A missing, extra or mistyped aux is a LaunchError naming it, and
nothing is launched. Exits non-zero on the first failure; prints "ok" at the end.
"""

import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import fake_cuda  # noqa: E402

MOD_ARGS = struct.Struct("<4Q16q")
POOL = struct.Struct("<2Q")  # prefill's: after ModArgs (params.cuh)
SCORE = "return score + bias(h, kv_idx) * 0.5f;"
MASK = "return doc(q_idx) == doc(kv_idx);"


def main():
    wrap, rand, i32 = fake_cuda.stub_session("attngen-snippets-", propagate=True)

    import torch

    import attngen
    from attngen import runtime

    launched = []  # (entry, spec, layout size) of each launch, in order
    grids = []  # and its grid
    launch_struct = runtime.Kernel.launch_struct

    def recording(self, layout, grid, stream, *values, entry="", **kw):
        launched.append((entry, self.spec, layout.size))
        grids.append(tuple(grid))
        return launch_struct(self, layout, grid, stream, *values, entry=entry, **kw)

    runtime.Kernel.launch_struct = recording
    loaded = []  # the spec of each kernel loaded (built or read from the cache), in order
    load = runtime.load

    def loading(*args, **kw):
        kern = load(*args, **kw)
        loaded.append(kern.spec)
        return kern

    runtime.load = loading

    b, h, hk, d = 2, 4, 2, 64
    sq, sk = 37, 90
    q, k, v = rand(b, sq, h, d), rand(b, sk, hk, d), rand(b, sk, hk, d)
    mask = wrap(torch.rand(sq, sk) > 0.3)
    cu_q, cu_k = i32([0, 30, 37]), i32([0, 50, 90])
    vq, vk, vv = rand(37, h, d), rand(90, hk, d), rand(90, hk, d)
    pk, pv = rand(6, 16, hk, d), rand(6, 16, hk, d)
    table = i32([[0, 2, 4], [1, 3, 5]])
    bias = wrap(torch.randn(h, 2 * sk))[:, ::2]  # a strided view: its strides are packed as they are
    doc = wrap(torch.zeros(128, dtype=torch.int32))
    aux = {"doc": doc, "bias": bias}

    calls = [
        ("attngen.prefill", lambda **m: attngen.prefill(q, k, v, causal=True, **m)),
        ("attngen.prefill sinks lse", lambda **m: attngen.prefill(q, k, v, return_lse=True,
                                                                   sinks=wrap(torch.randn(h)), **m)),
        ("attngen.prefill pinned sync", lambda **m: attngen.prefill(
            q, k, v, spec=m.pop("spec", "prefill:head_dim=64,pipeline=sync,cta_tile_q=64,cta_tile_kv=64,num_warps=4,"
                                "num_stages=2"), **m)),
        ("attngen.prefill mask", lambda **m: attngen.prefill(q, k, v, mask=mask, **m)),
        ("attngen.prefill_varlen", lambda **m: attngen.prefill_varlen(vq, vk, vv, cu_q, cu_k, 30, 50, **m)),
        ("attngen.prefill_varlen paged", lambda **m: attngen.prefill_varlen(vq, pk, pv, cu_q, cu_k, 30, 50,
                                                                            block_table=table, **m)),
        ("flash_attn_func", lambda **m: attngen.flash_attn_func(q, k, v, causal=True, **m)),
        ("flash_attn_varlen_func", lambda **m: attngen.flash_attn_varlen_func(vq, vk, vv, cu_q, cu_k, 30, 50, **m)),
    ]
    want = MOD_ARGS.pack(bias.data_ptr(), doc.data_ptr(), 0, 0, *bias.stride(), 0, 0, 1, 0, 0, 0, *[0] * 8)
    for name, call in calls:
        del launched[:]
        try:
            call(score_mod=SCORE, mask_mod=MASK, aux=aux)
        except Exception as e:
            raise AssertionError(f"{name} with snippets: {type(e).__name__}: {e}") from e
        mains = [(spec, size) for entry, spec, size in launched if entry == ""]
        assert len(mains) == 1, (name, launched)
        spec, size = mains[0]
        assert (spec.score_mod, spec.mask_mod, spec.aux) == (SCORE, MASK, "bias:fp32:2;doc:int32:1"), (name, spec)
        # ModArgs, then a mask_mod plan's pool and slots (both null, or both set where the call walked such a plan)
        raw = fake_cuda.last_params(size)
        got = raw[size - POOL.size - MOD_ARGS.size:size - POOL.size]
        assert got == want, f"{name}: ModArgs packed {MOD_ARGS.unpack(got)}, expected {MOD_ARGS.unpack(want)}"
        pool = POOL.unpack(raw[size - POOL.size:])
        assert pool == (0, 0) or all(pool), (name, pool)
        if name == "attngen.prefill":  # a mask_mod and no mask tensor: its block plan, with a pool
            assert all(pool), (name, pool)
            # which holds every tile's bits at this size: the kernel's mod_bits form, the only one built
            assert spec.mod_bits and [s for s in loaded if s.mask_mod] == [spec], (name, loaded)
        elif "mask" in name or "varlen" in name:  # a mask tensor's plan, or none
            assert pool == (0, 0), (name, pool)
        if name == "attngen.prefill mask":  # the tensor's plan: built by the spec without snippets (its _mtiles)
            built = [s for e, s, _ in launched if e == "_mtiles"]  # (nor q_scaled, which serves a score_mod)
            assert built == [spec.replace(score_mod="", mask_mod="", aux="", q_scaled=False)], (name, launched)
        # without snippets, the kernel has none
        del launched[:]
        call()
        assert not [s for e, s, _ in launched if e == "" and (s.score_mod or s.mask_mod or s.aux)], (name, launched)
    # A mask_mod without a mask tensor walks its block plan (a custom-mask kernel; its tile states evaluated over the
    # batch only where the snippet names b, over the heads only where it names h) unless mask_plan='off'.
    qs = rand(b, sk, h, d)  # (seqlen_q = seqlen_k: the doc ids index both)
    for snippet, mod_aux, z in ((MASK, {"doc": doc}, 1), ("return doc2(b, kv_idx) >= h;", {"doc2": wrap(
            torch.zeros(b, sk, dtype=torch.int32))}, b * h)):
        del launched[:], grids[:]
        attngen.prefill(qs, k, v, causal=True, mask_mod=snippet, aux=mod_aux)
        assert [e for e, _, _ in launched] == ["_modtiles", "_mlists", "_order", ""], launched
        assert launched[-1][1].custom_mask and launched[0][1] == launched[-1][1]
        tiles = launched[-1][1].cta_tile_q, launched[-1][1].cta_tile_kv
        assert grids[0] == (-(-sk // tiles[1]), -(-sk // tiles[0]), z), grids
        del launched[:]
        attngen.prefill(qs, k, v, causal=True, mask_mod=snippet, aux=mod_aux, mask_plan="off")
        assert [e for e, _, _ in launched] == [""] and not launched[0][1].custom_mask, launched
    # A caller's spec with no custom-mask form (persistent): mask_mod on every pair, and a plan of the caller's refused
    pers = "prefill:head_dim=64,persistent=true"
    del launched[:]
    attngen.prefill(qs, k, v, causal=True, mask_mod=MASK, aux={"doc": doc}, spec=pers)
    assert [e for e, _, _ in launched] == [""] and launched[0][1].is_persistent, launched
    mp = attngen.mask_plan(None, qs, k, causal=True, mask_mod=MASK, aux={"doc": doc})
    assert (mp.units_b, mp.units_h) == (1, 1)
    fake_cuda.refused(lambda: attngen.prefill(qs, k, v, causal=True, mask_mod=MASK, aux={"doc": doc}, spec=pers,
                                              mask_plan=mp), "no custom-mask form", error="LaunchError")
    fake_cuda.refused(lambda: attngen.prefill(qs, k, v, mask_mod=MASK, aux={"doc": doc}, mask_plan=mp),
                      "other causal/window", error="LaunchError")
    fake_cuda.refused(lambda: attngen.prefill(qs, k, v, mask_mod=MASK, aux={"doc": doc}, mask_plan="on"),
                      "mask_plan='on' is not allowed", error="LaunchError")
    fake_cuda.refused(lambda: attngen.mask_plan(None, qs, k), "a mask_mod", error="LaunchError")
    # The aux checks name the tensor, and launch nothing.
    spec_aux = attngen.PrefillSpec(head_dim=64, score_mod=SCORE, aux="bias:fp32:2")
    wrong = (
        (dict(score_mod=SCORE, aux={"bias": bias, "doc": doc}), "aux['doc'] is not read"),
        (dict(score_mod=SCORE, aux={"bias": bias.to(torch.float64)}), "aux['bias'] has dtype"),
        (dict(score_mod=SCORE, aux={"bias": torch.randn(h, sk)}), "aux['bias'] is on cpu"),
        (dict(score_mod=SCORE, aux={"bias": [1.0]}), "aux['bias']"),
        (dict(score_mod=SCORE, aux={"if": bias}), "aux name 'if'"),
        (dict(aux={"bias": bias}), "without a score_mod or mask_mod"),
        (dict(score_mod=SCORE, aux={"bias": wrap(torch.randn(h * sk))}, spec=spec_aux),
         "aux['bias'] is fp32 with 1 dims; the spec's aux says fp32 with 2 dims"),
        (dict(score_mod=SCORE, spec=spec_aux), "aux['bias'] is missing"),
    )
    for name, call in calls:
        for kw, text in wrong:
            if "spec" in kw and "pinned" not in name:
                continue  # (a spec of the caller's: the entry that takes one from its keywords)
            fake_cuda.refused(lambda: call(**kw), text, error="LaunchError")
    # score_mod "return score;" twice gives one kernel; other text, another
    a = attngen.prefill(q, k, v, score_mod="return score;")
    del launched[:]
    attngen.prefill(q, k, v, score_mod="return score;")
    first = launched[-1][1]
    attngen.prefill(q, k, v, score_mod="return score * 1.0f;")
    assert launched[-1][1].kernel_name != first.kernel_name and "smod" in first.kernel_name
    del a
    # The chunked kernel (head dims past 256) refuses snippets by name, before anything is compiled or launched
    q512, k512, v512 = rand(1, 20, h, 512), rand(1, 30, hk, 512), rand(1, 30, hk, 512)
    fake_cuda.refused(lambda: attngen.prefill(q512, k512, v512, score_mod=SCORE, aux={"bias": bias}), "score_mod",
                      "chunked kernel", error="SpecError")
    # A caller's spec with another snippet is refused by name
    fake_cuda.refused(lambda: attngen.prefill(q, k, v, spec=attngen.PrefillSpec(head_dim=64, score_mod="return 0.f;"),
                                              score_mod=SCORE, aux={"bias": bias}), "score_mod: the spec has",
                      error="LaunchError")
    print("ok")


if __name__ == "__main__":
    main()
