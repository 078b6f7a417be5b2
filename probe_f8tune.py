import torch, attngen, itertools
E4 = torch.float8_e4m3fn
def t(fn, n=15):
    for _ in range(3): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(n):
        a = torch.cuda.Event(enable_timing=True); z = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); z.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(z))
    ts.sort(); return ts[len(ts) // 2]
shapes = ((1, 4096, True), (1, 8192, False), (1, 8192, True), (8, 2048, True), (1, 16384, True))
print("config                       " + "  ".join(f"{b}x{s}{'c' if c else 'f'}" for b, s, c in shapes))
for d in (128, 256):
    data = {}
    for b, s, c in shapes:
        data[(b, s)] = [torch.randn(b, s, n, d, device="cuda").to(E4) for n in (32, 8, 8)]
    cfgs = [(sc, pe, st) for sc in ("pingpong", "overlap", "serial") for pe in ((False, True) if d == 128 else (False,)) for st in (2, 3)]
    for sc, pe, st in cfgs:
        spec = dict(family="prefill", head_dim=d, qkv_dtype="fp8_e4m3", cta_tile_q=128, cta_tile_kv=128, num_warps=8, num_stages=st, schedule=sc, mma="wgmma", pipeline="tma", persistent=pe)
        row = []
        for b, s, c in shapes:
            q8, k8, v8 = data[(b, s)]
            f = 4 * b * 32 * s * s * d / (2 if c else 1)
            try:
                row.append(f"{f / t(lambda: attngen.prefill(q8, k8, v8, causal=c, spec=spec)) / 1e9:7.0f}")
            except Exception as e:
                row.append(f"  ERR {str(e)[:30]}")
        print(f"d{d} {sc:8s} pers={int(pe)} s{st}   " + " ".join(row), flush=True)
    for b, s, c in shapes:
        pass
    row = []
    for b, s, c in shapes:
        q = torch.randn(b, s, 32, d, device="cuda", dtype=torch.bfloat16); k = torch.randn(b, s, 8, d, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
        f = 4 * b * 32 * s * s * d / (2 if c else 1)
        row.append(f"{f / t(lambda: attngen.prefill(q, k, v, causal=c)) / 1e9:7.0f}")
    print(f"d{d} bf16 default            " + " ".join(row), flush=True)
