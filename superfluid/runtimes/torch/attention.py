"""Attention over the paged KV pool for one packed step.

A step packs every feed's new tokens into T rows. ``StepMeta`` says where each feed's
rows are, where its new K/V cells go (slots) and which cells hold all of its keys.

Two kernels:
- ``attend`` (fast): 1-token feeds (decodes) run as one padded batch [B, H, 1, L] with
  a mask; each longer feed (a prefill chunk) runs its own SDPA over its keys with a
  causal mask offset by what the sequence already held.
- ``attend_fixed`` (batch-invariant): online softmax over fixed blocks of KEY_BLOCK keys
  at fixed absolute positions, queries in blocks of QUERY_BLOCK rows, every matmul of one
  fixed per-item shape, so a query row's result depends on its own keys and nothing else —
  not on B, on how many queries share the step, nor on how the prompt was chunked. Blocks
  past a query's position are fully masked and leave its running (max, sum, acc) bit-identical.

Both take ``window`` (sliding-window attention, Mistral): a query at position p sees keys at
positions p - window < pos <= p, as transformers' sliding_window_causal_mask_function
(kv_idx > q_idx - window). Older keys stay in the pool; they are only masked. In
``attend_fixed`` blocks wholly before a query's window are fully masked too and, coming
first, leave its running state at its initial (-inf, 0, 0) — so invariance still holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KEY_BLOCK = 64
QUERY_BLOCK = 16


@dataclass
class StepMeta:
    q_lens: list[int]  # new tokens of each feed; rows of feed i are [offsets[i], offsets[i] + q_lens[i])
    offsets: list[int]
    starts: list[int]  # tokens each feed's sequence held before this step
    slots: torch.Tensor  # [T] int64: cell of each new token
    key_slots: list[torch.Tensor]  # per feed [starts[i] + q_lens[i]] int64: cells of all its keys
    positions: torch.Tensor  # [T] int64: position of each new token
    # Padded views of all feeds (built once per step, used by the batched paths):
    gather: torch.Tensor | None = None  # [B, L] int64 key cells (padding points at cell 0)
    key_valid: torch.Tensor | None = None  # [B, L] bool
    native_keys: dict | None = None  # window -> native attention's (gather, first, lens), once per step

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for n in self.q_lens)


def build_meta(q_lens, starts, slots, key_slots, device, pad_keys_to: int = 1) -> StepMeta:
    offsets, o = [], 0
    for n in q_lens:
        offsets.append(o)
        o += n
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens)])
    L = max(len(k) for k in key_slots)
    L = -(-L // pad_keys_to) * pad_keys_to
    gather = torch.zeros(len(q_lens), L, dtype=torch.int64)
    valid = torch.zeros(len(q_lens), L, dtype=torch.bool)
    for i, ks in enumerate(key_slots):
        gather[i, : len(ks)] = ks
        valid[i, : len(ks)] = True
    return StepMeta(list(q_lens), offsets, list(starts), slots.to(device), [k.to(device) for k in key_slots],
                    positions.to(device), gather.to(device), valid.to(device))


def cells(cache: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """cache [S, Hkv, d] at idx [...] -> [..., Hkv, d] (index_select: far faster than cache[idx])."""
    return cache.index_select(0, idx.reshape(-1)).view(*idx.shape, *cache.shape[1:])


def _cap(s: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Attention-score soft-capping (Gemma 2): softcap * tanh(s / softcap), before the mask."""
    return s if softcap is None else torch.tanh(s / softcap) * softcap


def _decodes(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, gather, valid, qpos, window,
             softcap: float | None = None) -> torch.Tensor:
    # q: [B, H, d] one query per sequence; kc, vc: [S, Hkv, d]; gather/valid: [B, L] (column l
    # holds the key at position l); qpos: [B] position of each query.
    # Query head h reads kv head h // group (transformers' repeat_kv order), so q views as
    # [B, Hkv, group, d] and each kv head serves its group in one matmul.
    B, H, d = q.shape
    Hkv = kc.shape[1]
    k = cells(kc, gather).permute(0, 2, 3, 1)  # [B, Hkv, d, L]
    v = cells(vc, gather).transpose(1, 2)  # [B, Hkv, L, d]
    s = _cap(torch.matmul(q.view(B, Hkv, H // Hkv, d), k) * (d ** -0.5), softcap)  # [B, Hkv, group, L]
    if window is not None:
        kpos = torch.arange(gather.shape[1], device=q.device)
        valid = valid & (kpos[None, :] > qpos[:, None] - window)
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.matmul(p, v).view(B, H, d)  # [B, H, d]


def _masked(qi: torch.Tensor, ki: torch.Tensor, vi: torch.Tensor, mask: torch.Tensor | None,
            softcap: float | None) -> torch.Tensor:
    """One feed's attention [H, n, d] over its keys [Hkv, L, d]: SDPA, or with soft-capping
    (which SDPA has no place for) the same product written out."""
    if softcap is None:
        if mask is None:
            return F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, enable_gqa=True)
    H, n, d = qi.shape
    group = H // ki.shape[0]
    ki, vi = ki.repeat_interleave(group, 0), vi.repeat_interleave(group, 0)
    s = _cap(torch.matmul(qi, ki.transpose(1, 2)) * (d ** -0.5), softcap)  # [H, n, L]
    if mask is None:
        mask = torch.ones(n, ki.shape[1], dtype=torch.bool, device=qi.device).tril()
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s.float(), dim=-1).to(qi.dtype), vi)


def attend(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: StepMeta, window: int | None = None,
           softcap: float | None = None) -> torch.Tensor:
    """q: [T, H, d] (RoPE applied); kc, vc: [S, Hkv, d] with this step's K/V written. -> [T, H, d]"""
    if meta.decode_only:
        return _decodes(q, kc, vc, meta.gather, meta.key_valid, meta.positions, window, softcap)
    out = torch.empty_like(q)
    dec = [i for i, n in enumerate(meta.q_lens) if n == 1]
    if dec:
        rows = torch.tensor([meta.offsets[i] for i in dec], device=q.device)
        idx = torch.tensor(dec, device=q.device)
        out[rows] = _decodes(q[rows], kc, vc, meta.gather[idx], meta.key_valid[idx], meta.positions[rows], window,
                             softcap)
    for i, n in enumerate(meta.q_lens):
        if n == 1:
            continue
        o, start, ks = meta.offsets[i], meta.starts[i], meta.key_slots[i]
        # Keys before `first` are outside every query's window: not even gathered.
        first = max(0, start - window + 1) if window is not None else 0
        qi = q[o: o + n].transpose(0, 1)  # [H, n, d]
        ks = ks[first:]
        ki, vi = cells(kc, ks).transpose(0, 1), cells(vc, ks).transpose(0, 1)  # [Hkv, start + n - first, d]
        if start == 0 and (window is None or window >= n):
            oi = _masked(qi, ki, vi, None, softcap)
        else:  # query j sits at position start + j and sees keys 0..start + j (those in its window)
            qpos = torch.arange(start, start + n, device=q.device)[:, None]
            kpos = torch.arange(first, start + n, device=q.device)[None, :]
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
            oi = _masked(qi, ki, vi, mask, softcap)
        out[o: o + n] = oi.transpose(0, 1)
    return out


def attend_fixed(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: StepMeta, window: int | None = None,
                 softcap: float | None = None) -> torch.Tensor:
    """Batch-invariant attention (see module doc). q: [T, H, d] -> [T, H, d].

    Every product is a batched matmul whose per-item shape never changes: [QUERY_BLOCK, d] x
    [d, KEY_BLOCK] for scores and [QUERY_BLOCK, KEY_BLOCK] x [KEY_BLOCK, d] for values, so BLAS
    runs the same kernel (and reduction order) on a query row whatever shares its block."""
    T, H, d = q.shape
    Hkv = kc.shape[1]
    group = H // Hkv
    QB = QUERY_BLOCK
    # Queries per feed padded to QB rows: Q [B, nb, QB, H, d]; qpos [B, nb, QB] (padding: -1).
    B, nq = len(meta.q_lens), -(-max(meta.q_lens) // QB) * QB
    nb = nq // QB
    rows = torch.full((B, nq), T, dtype=torch.int64, device=q.device)
    for i, (o, n) in enumerate(zip(meta.offsets, meta.q_lens)):
        rows[i, :n] = torch.arange(o, o + n, device=q.device)
    qf = torch.cat([q.float(), q.new_zeros(1, H, d, dtype=torch.float32)]).index_select(0, rows.view(-1))
    qf = qf.view(B, nb, QB, Hkv, group, d).permute(0, 3, 1, 4, 2, 5)  # [B, Hkv, nb, group, QB, d]
    qf = (qf * (d ** -0.5)).contiguous()
    qpos = torch.cat([meta.positions, meta.positions.new_full((1,), -1)])[rows].view(B, 1, nb, 1, QB)
    m = torch.full((B, Hkv, nb, group, QB), float("-inf"), device=q.device)
    l = torch.zeros(B, Hkv, nb, group, QB, device=q.device)
    acc = torch.zeros(B, Hkv, nb, group, QB, d, device=q.device)
    L = meta.gather.shape[1]
    for j in range(0, L, KEY_BLOCK):
        blk = meta.gather[:, j: j + KEY_BLOCK]  # [B, KB] (L is padded to KEY_BLOCK)
        kb = cells(kc, blk).float().permute(0, 2, 3, 1)[:, :, None, None]  # [B, Hkv, 1, 1, d, KB]
        vb = cells(vc, blk).float().transpose(1, 2)[:, :, None, None]  # [B, Hkv, 1, 1, KB, d]
        s = _cap(torch.matmul(qf, kb.expand(B, Hkv, nb, group, d, KEY_BLOCK)), softcap)  # [B, Hkv, nb, group, QB, KB]
        kpos = torch.arange(j, j + KEY_BLOCK, device=q.device)
        visible = (kpos <= qpos[..., None]) & meta.key_valid[:, None, None, None, None, j: j + KEY_BLOCK]
        if window is not None:
            visible &= kpos > qpos[..., None] - window
        s = s.masked_fill(~visible, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - safe)
        p = torch.exp(s - safe[..., None])
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.matmul(p, vb.expand(B, Hkv, nb, group, KEY_BLOCK, d))
        m = m_new
    out = acc / l.clamp_min(1e-30)[..., None]  # [B, Hkv, nb, group, QB, d]
    out = out.permute(0, 2, 4, 1, 3, 5).reshape(B, nq, H, d)
    res = torch.empty(T, H, d, dtype=torch.float32, device=q.device)
    for i, (o, n) in enumerate(zip(meta.offsets, meta.q_lens)):
        res[o: o + n] = out[i, :n]
    return res.to(q.dtype)
