"""The fp32 reference attention the GPU tests (and the benchmark's spot checks) compare against."""

from __future__ import annotations


def reference_attention(q, k, v, *, causal=False, window=(-1, -1), sm_scale=None):
    """softmax(q k^T * scale) v in fp32 with the same masks as attngen.prefill.

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
