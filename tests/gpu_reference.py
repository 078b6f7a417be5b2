"""The fp32 reference attention the GPU tests (and the benchmark's spot checks) compare against."""

from __future__ import annotations


def _score_mods(s, softcap, alibi, dist):
    """FlashAttention's order: cap the scaled logits, then add -slope * |distance| (per head).
    ``s`` [..., H, rows, keys] (or [B, H, rows, keys]); ``alibi`` [H] or [B, H] fp32; ``dist``
    [rows, keys] (query position - key position)."""
    import torch

    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        sl = alibi.float()
        sl = sl[..., None, None] if sl.dim() == 2 else sl[:, None, None]
        s = s - sl * dist.abs().float()
    return s


def reference_attention(q, k, v, *, causal=False, window=(-1, -1), sm_scale=None, softcap=0.0, alibi_slopes=None):
    """softmax(q k^T * scale) v in fp32 with the same masks as attngen.prefill (and its softcap
    and ALiBi, applied before the mask).

    q [B, Sq, H, D], k/v [B, Sk, Hkv, D] (torch). Returns (out fp32 [B, Sq, H, D], lse fp32
    [B, H, Sq]); rows that see no key give zeros and LSE -inf.
    """
    import torch

    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if sm_scale is None else sm_scale
    qf = q.float().transpose(1, 2)
    kf = k.float().transpose(1, 2).repeat_interleave(h // hk, dim=1)
    vf = v.float().transpose(1, 2).repeat_interleave(h // hk, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=q.device)[None, :]
    s = _score_mods(s, softcap, alibi_slopes, i - j)
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        keep &= j <= i + right
    if left >= 0:
        keep &= j >= i - left
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    out = torch.matmul(p, vf).transpose(1, 2).contiguous()
    return out, lse


def _lengths(cache_seqlens, batch):
    """cache_seqlens (int, or an int tensor/array of [batch]) as a list of Python ints."""
    if isinstance(cache_seqlens, int):
        return [int(cache_seqlens)] * batch
    if hasattr(cache_seqlens, "tolist"):
        vals = cache_seqlens.tolist()
    else:
        vals = list(cache_seqlens)
    if len(vals) != batch:
        raise ValueError(f"cache_seqlens has {len(vals)} entries for batch {batch}")
    return [int(x) for x in vals]


def reference_decode(q, k_cache, v_cache, cache_seqlens, cache_batch_idx=None, block_table=None, sm_scale=None,
                     softcap=0.0, alibi_slopes=None, causal=True, window=(-1, -1), cache_leftpad=None, sinks=None):
    """fp32 reference for attngen.decode (torch tensors on any device).

    q ``[B, q_len, H, D]``. Contiguous cache: k/v ``[cache_batch, max_seqlen, Hkv, D]``, row b reads
    cache row ``cache_batch_idx[b]`` (else b). Paged (``block_table`` ``[B, max_blocks]``): k/v
    ``[num_blocks, block_size, Hkv, D]``, key j of row b at ``[block_table[b, j // bs], j % bs]``.
    Row b has ``L = cache_seqlens[b]`` keys (the q_len new ones included); query i sits at
    position ``L - q_len + i`` and sees keys ``0 .. L - q_len + i``. Only keys ``< L`` are ever
    read, so a cache poisoned past L leaves the reference finite. Query head h uses KV head
    ``h // (H // Hkv)``. Returns (out fp32 ``[B, q_len, H, D]``, lse fp32 ``[B, H, q_len]``);
    a query that sees no key gives zeros and LSE -inf.

    FlashAttention's bounds: ``window=(left, right)`` keeps keys ``i' - left .. i' + right`` of the
    query at position i' (-1: that side unbounded); ``causal`` (the default) sets right to 0, and
    ``causal=False`` with right -1 lets every query see every key below L. ``cache_leftpad`` (a list or
    int tensor [B]) is each row's first key: keys before it are neither read nor seen.

    ``sinks`` (fp32 ``[H]``): attention sinks, one more logit column per query head in the softmax whose
    probability is dropped (it adds no value); the LSE includes it, and a query that sees no key gives zeros
    and LSE = its head's sink.
    """
    import torch

    b, ql, h, d = q.shape
    hk = k_cache.shape[2]
    g = h // hk
    scale = d ** -0.5 if sm_scale is None else sm_scale
    lengths = _lengths(cache_seqlens, b)
    pads = _lengths(cache_leftpad, b) if cache_leftpad is not None else [0] * b
    left, right = window
    if causal:
        right = 0
    rows = _lengths(cache_batch_idx, b) if cache_batch_idx is not None else list(range(b))
    table = block_table.tolist() if block_table is not None else None
    out = torch.zeros(b, ql, h, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, ql), float("-inf"), dtype=torch.float32, device=q.device)
    if sinks is not None:
        lse[:] = sinks.float().to(q.device)[None, :, None]
    for i in range(b):
        n, lo = lengths[i], max(pads[i], 0)
        if n - lo <= 0:
            continue
        if table is not None:
            bs = k_cache.shape[1]
            blocks = torch.tensor(table[i][: (n + bs - 1) // bs], dtype=torch.long, device=k_cache.device)
            kk = k_cache[blocks].reshape(-1, hk, d)[lo:n]
            vv = v_cache[blocks].reshape(-1, hk, d)[lo:n]
        else:
            kk = k_cache[rows[i], lo:n]
            vv = v_cache[rows[i], lo:n]
        key = torch.arange(lo, n, device=q.device)[None, :]                # the keys' positions
        n_keys = n - lo
        kf = kk.float().permute(1, 0, 2)                                     # [Hkv, L, D]
        vf = vv.float().permute(1, 0, 2)
        # [q_len, H, D] -> [Hkv, g * q_len, D]: the g query heads of one KV head share its keys.
        qf = q[i].float().reshape(ql, hk, g, d).permute(1, 2, 0, 3).reshape(hk, g * ql, d)
        s = torch.matmul(qf, kf.transpose(-1, -2)).reshape(hk, g, ql, n_keys) * scale
        pos = torch.arange(ql, device=q.device)[:, None] + (n - ql)
        if softcap or alibi_slopes is not None:
            sl = None
            if alibi_slopes is not None:
                sl = (alibi_slopes[i] if alibi_slopes.dim() == 2 else alibi_slopes).reshape(hk, g)
            s = _score_mods(s, softcap, sl, pos - key)
        keep = torch.ones(ql, n_keys, dtype=torch.bool, device=q.device)    # [q_len, keys]
        if right >= 0:
            keep &= key <= pos + right
        if left >= 0:
            keep &= key >= pos - left
        s = s.masked_fill(~keep, float("-inf"))
        if sinks is not None:  # the sink's column, dropped after the softmax
            sink = sinks.float().to(q.device).reshape(hk, g, 1, 1).expand(hk, g, ql, 1)
            s = torch.cat((s, sink), dim=-1)
        row_lse = torch.logsumexp(s, dim=-1)                                 # [Hkv, g, q_len]
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)[..., :n_keys]
        o = torch.matmul(p.reshape(hk, g * ql, n_keys), vf).reshape(hk, g, ql, d)
        out[i] = o.permute(2, 0, 1, 3).reshape(ql, h, d)
        lse[i] = row_lse.reshape(h, ql)
    return out, lse


def reference_rotary(x, cos, sin, pos, interleaved: bool):
    """x [B, S, H, D] with its first rotary_dim = 2 * cos.shape[1] features rotated in fp32 by the angles
    of positions ``pos`` [B, S] (GPT-J pairs (0, 1), (2, 3)... when ``interleaved``, else GPT-NeoX
    halves); returns fp32."""
    import torch

    half = cos.shape[1]
    xf = x.float()
    c, s = cos.float()[pos.long()][:, :, None, :], sin.float()[pos.long()][:, :, None, :]
    if interleaved:
        a, b = xf[..., 0:2 * half:2], xf[..., 1:2 * half:2]
        rot = torch.stack((a * c - b * s, a * s + b * c), dim=-1).reshape(*x.shape[:3], 2 * half)
    else:
        a, b = xf[..., :half], xf[..., half:2 * half]
        rot = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((rot, xf[..., 2 * half:]), dim=-1)


def fresh_generator():
    """A CUDA generator seeded from the OS: fresh inputs every run."""
    import torch

    g = torch.Generator(device="cuda")
    g.seed()
    return g


def check_output_and_lse(o, lse, ref_o, ref_l, tol: float) -> float:
    """The checks every attention test makes once the output is known finite: relative L2 error of
    ``o`` under ``tol``; rows the reference gives no key (LSE -inf) are zeros; the LSE is finite
    exactly where the reference's is, and within 2e-2 there. ``lse``/``ref_l`` are [b, h, rows],
    ``o`` [b, rows, h, d]. Returns the error."""
    import torch

    err = (torch.linalg.vector_norm(o.float() - ref_o) / torch.linalg.vector_norm(ref_o).clamp_min(1e-30)).item()
    assert err < tol, f"rel L2 error {err:.3e}"
    empty = torch.isinf(ref_l).transpose(1, 2)
    if empty.any():
        assert (o[empty] == 0).all()
    fin = torch.isfinite(ref_l)
    assert torch.equal(torch.isfinite(lse), fin)
    if fin.any():
        assert (lse[fin] - ref_l[fin]).abs().max().item() < 2e-2
    return err


def rel(a, b) -> float:
    """Relative L2 error of ``a`` against ``b``, both taken as fp32."""
    import torch

    a, b = a.float(), b.float()
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30)).item()


def reference_mla(q_nope, q_pe, ckv, kpe, seqlens, sm_scale):
    """MLA decode in fp32: output [b, q_len, h, rank] and LSE [b, h, q_len]; a token sees keys 0..L - q_len + i.
    ``seqlens``: a list or an int32 tensor [b]."""
    import torch

    seqlens = [int(x) for x in seqlens]
    b, q_len, h, rank = q_nope.shape
    outs, lses = [], []
    for i in range(b):
        n = seqlens[i]
        qn, qp = q_nope[i].float(), q_pe[i].float()
        c, p = ckv[i, :n].float().nan_to_num(), kpe[i, :n].float().nan_to_num()
        s = (torch.einsum("thd,nd->thn", qn, c) + torch.einsum("thd,nd->thn", qp, p)) * sm_scale
        key = torch.arange(n, device="cuda")
        lim = (n - q_len + torch.arange(q_len, device="cuda")).view(q_len, 1, 1)
        s = s.masked_fill(key.view(1, 1, n) > lim, float("-inf"))
        lse = torch.logsumexp(s, dim=-1) if n else torch.full((q_len, h), float("-inf"), device="cuda")
        pr = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
        outs.append(torch.einsum("thn,nd->thd", pr, c))
        lses.append(lse.transpose(0, 1))
    return torch.stack(outs), torch.stack(lses)
