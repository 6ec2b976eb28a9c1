"""Float64 per-stage reference of the fused SSD (Mamba2) forward over a plan's chunk tables
(plugins/mamba2/csrc/ssd_fused/ssd_fused.h), tree state pass included. Plain torch ops, so autograd
derives every gradient (the fused backward's stage reference too).

Stages (NC chunks of L = gather.shape[1] tokens; chunk-major like the kernels' buffers):
  dt            (NC, H, L)     clamp(softplus?(dt_raw + dt_bias), dt_limit); 0 on pad rows
  Lam           (NC, H, L)     chunk-local cumsum of dt * A
  chunk_states  (NC, H, P, N)  S_c = sum_j exp(Lam_last - Lam_j) dt_j x_j^T B_j   (from zero)
  states        (NC, H, P, N)  the state entering each chunk (tree pass)
  final         (S, H, P, N)   the state each segment ends in
  y             (T, H, P)      before the z gate (D x included)
  out           (T, H, P)      y * silu(z) when z is given, else y

Use ``stages(...)`` with tensors of any float dtype: they are widened to float64 (so the reference
sees exactly the values the kernels read). ``tables`` is a mapping or object with TreePlan.chunk_tables'
fields (gather, scatter, seg_chunk_offsets, parents, root_index, level_segments, level_offsets,
child_offsets, children); tensors may live on any device (they are read on the host).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

F64 = torch.float64


def _get(tables, name):
    return tables[name] if isinstance(tables, dict) else getattr(tables, name)


def prepare_dt(dt, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    """(T, H) float64: bias, softplus (threshold 20, as mamba-ssm and torch), clamp."""
    d = dt.to(F64)
    if dt_bias is not None:
        d = d + dt_bias.to(F64)
    if dt_softplus:
        d = F.softplus(d, beta=1, threshold=20)
    return d.clamp(float(dt_limit[0]), float(dt_limit[1]))


def stages(x, dt, B, C, A, tables, D=None, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf")), z=None,
           initial_state=None):
    dev = x.device
    gather = _get(tables, "gather").to(dev)
    scatter = _get(tables, "scatter").to(dev)
    sco = [int(v) for v in _get(tables, "seg_chunk_offsets").tolist()]
    parents = [int(v) for v in _get(tables, "parents").tolist()]
    root_index = [int(v) for v in _get(tables, "root_index").tolist()]
    order = [int(v) for v in _get(tables, "level_segments").tolist()]
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    NC, L = gather.shape
    head_group = torch.arange(H, device=dev) // (H // G)

    d = prepare_dt(dt, dt_bias, dt_softplus, dt_limit)                          # (T, H)
    flat = gather.reshape(-1)
    valid = (flat >= 0).to(F64)                                                 # (NC*L)
    idx = flat.clamp_min(0)
    dtc = (d.index_select(0, idx) * valid[:, None]).view(NC, L, H).permute(0, 2, 1)   # (NC, H, L)
    Lam = torch.cumsum(dtc * A.to(F64).view(1, H, 1), -1)                       # (NC, H, L)
    xc = (x.to(F64).index_select(0, idx) * valid[:, None, None]).view(NC, L, H, P)
    Bc = (B.to(F64).index_select(0, idx) * valid[:, None, None]).view(NC, L, G, N)[:, :, head_group]  # (NC, L, H, N)
    Cc = (C.to(F64).index_select(0, idx) * valid[:, None, None]).view(NC, L, G, N)[:, :, head_group]
    last = Lam[..., -1:]                                                        # (NC, H, 1)
    w = torch.exp(last - Lam) * dtc                                             # (NC, H, L)
    chunk_states = torch.einsum("chj,cjhp,cjhn->chpn", w, xc, Bc)               # (NC, H, P, N)

    # the tree pass: a segment starts from its parent's final state, a root from its initial state
    h0 = None
    if initial_state is not None:
        h0 = initial_state.to(F64)
        if h0.dim() == 4 and h0.shape[0] == 1:
            h0 = h0[0]
    decay = torch.exp(last[..., 0])                                             # (NC, H)
    states = [None] * NC
    final = [None] * len(parents)
    for s in order:
        par = parents[s]
        if par >= 0:
            cur = final[par]
        elif h0 is None:
            cur = torch.zeros(H, P, N, dtype=F64, device=dev)
        else:
            cur = h0 if h0.dim() == 3 else h0[root_index[s]]
        for c in range(sco[s], sco[s + 1]):
            states[c] = cur
            cur = decay[c].view(H, 1, 1) * cur + chunk_states[c]
        final[s] = cur
    states_t = torch.stack(states) if NC else chunk_states.new_zeros(0, H, P, N)
    final_t = torch.stack(final) if final else chunk_states.new_zeros(0, H, P, N)

    # chunk outputs: the entering state's part and the chunk's own tokens' part
    y_state = torch.einsum("cihn,chpn->cihp", Cc, states_t) * torch.exp(Lam).permute(0, 2, 1)[..., None]
    causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
    diff = Lam[..., :, None] - Lam[..., None, :]                                # (NC, H, L(i), L(j))
    decays = torch.exp(torch.where(causal, diff, torch.full_like(diff, -float("inf"))))
    cb = torch.einsum("cihn,cjhn->chij", Cc, Bc)
    scores = cb * decays * dtc[:, :, None, :]
    y_own = torch.einsum("chij,cjhp->cihp", scores, xc)
    y = (y_state + y_own).reshape(NC * L, H, P).index_select(0, scatter)        # (T, H, P)
    if D is not None:
        Dd = D.to(F64)
        y = y + (Dd.view(H, 1) if Dd.dim() == 1 else Dd) * x.to(F64)
    out = y * F.silu(z.to(F64)) if z is not None else y
    return dict(dt=dtc, Lam=Lam, chunk_states=chunk_states, states=states_t, final=final_t, y=y, out=out)


def out_only(*args, **kwargs):
    return stages(*args, **kwargs)["out"]
