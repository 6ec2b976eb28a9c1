"""Float64 PyTorch reference of the fused SSD backward's stage decomposition.

Every stage of plugins/mamba2/csrc/ssd_fused/ssd_fused_bwd.cpp is written here once, in the same
order and with the same formulas, so that a GPU test can compare each kernel's output against its
float64 twin, and a CPU test (test_ssd_bwd_reference.py) checks the decomposition itself against
torch.autograd through a float64 token-by-token recurrence (`token_scan`, independent of it).

Notation (ssd_fused.h): chunk c of the plan's gather table (NC, L), head h reading group h // (H/G),
tokens i, j of the chunk; pad rows have dt = 0 and x = B = C = dy = 0.
  Lam_i = sum_{m<=i} dt_m A,   M_ij = <C_i, B_j> exp(Lam_i - Lam_j) [j <= i]
  y_i = exp(Lam_i) C_i s^T + sum_j M_ij dt_j x_j + D x_i;  leaving = exp(Lam_last) s + S_c,
  S_c = sum_j exp(Lam_last - Lam_j) dt_j x_j^T B_j.
Backward, dS = ds_leave[c] (the gradient of chunk c's leaving state, = that of S_c):
  dy = dout silu(z), dz = dout y silu'(z)
  local[c]   = sum_i exp(Lam_i) dy_i^T C_i                                           (P x N)
  pass       : ds_leave(last chunk of s) = sum_{children k, in order} ds_enter(first chunk of k),
               ds_enter[c] = exp(Lam_last) ds_leave[c] + local[c], ddecay[c] = <s[c], ds_leave[c]>
  g_j        = sum_{i>=j} M_ij dy_i + exp(Lam_last - Lam_j) dS B_j                     (P)
  dx_j       = dt_j g_j + D dy_j,  ddt_j(direct) = <x_j, g_j>
  dCB_ij     = exp(Lam_i - Lam_j) dt_j <dy_i, x_j> [j <= i]
  dC_i       = exp(Lam_i) dy_i s + sum_j dCB_ij B_j
  dB_j       = sum_i dCB_ij C_i + exp(Lam_last - Lam_j) dt_j x_j dS
  d(dt A)_k  = sum_{i>=k, j<k} W_ij + sum_{m>=k} Q_m + sum_{j<k} V_j + E               (stable: no
               cancelling differences), W_ij = <C_i,B_j> dCB_ij, Q_m = exp(Lam_m) <dy_m, C_m s^T>,
               V_j = dt_j exp(Lam_last - Lam_j) <x_j, dS B_j>, E = exp(Lam_last) ddecay
  ddt        = ddt(direct) + A d(dt A),  dA = sum dt d(dt A), then clamp / softplus / bias.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tries


# ------------------------------------------------------------------------------------------------
# tables and the token oracle
# ------------------------------------------------------------------------------------------------


def chunk_tables(seg_offsets, parents, chunk, device="cpu"):
    """TreePlan.chunk_tables' contract from a trie's seg_offsets and parents, as a dict (tries.chunk_tables)."""
    return tries.chunk_tables(seg_offsets, parents, chunk, device)._asdict()


def prepare_dt(dt_raw, dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    dt = dt_raw.double()
    if dt_bias is not None:
        dt = dt + dt_bias.double()
    if dt_softplus:
        dt = F.softplus(dt, beta=1, threshold=20)
    return dt.clamp(dt_limit[0], dt_limit[1])


def _entry_state(s, par, done, initial_state, root_index, shape):
    """Segment ``s``'s state on entry: its parent's final state (from ``done``), else the initial state
    (shared, or the root's ``root_index(s)``-th), else zeros of ``shape``."""
    if par[s] >= 0:
        return done[par[s]]
    if initial_state is None:
        return torch.zeros(*shape, dtype=torch.float64)
    h0 = initial_state.double()
    return h0 if h0.dim() == 3 else h0[root_index(s)]


def token_scan(x, dt_raw, B, C, A, seg_offsets, parents, D=None, dt_bias=None, z=None, initial_state=None,
               dt_softplus=False, dt_limit=(0.0, float("inf"))):
    """Float64 token-by-token recurrence over the trie (differentiable): the oracle."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    hpg = H // G
    dt = prepare_dt(dt_raw, dt_bias, dt_softplus, dt_limit)
    x, B, C, A = x.double(), B.double().repeat_interleave(hpg, 1), C.double().repeat_interleave(hpg, 1), A.double()
    so, par = [int(v) for v in seg_offsets], [int(v) for v in parents]
    roots = [s for s in range(len(par)) if par[s] < 0]
    final = {}
    ys = [None] * T
    for s in range(len(par)):
        st = _entry_state(s, par, final, initial_state, roots.index, (H, P, N))
        for t in range(so[s], so[s + 1]):
            st = st * torch.exp(dt[t] * A).view(H, 1, 1) + (dt[t].view(H, 1) * x[t]).unsqueeze(-1) * B[t].unsqueeze(1)
            ys[t] = (st * C[t].unsqueeze(1)).sum(-1)
        final[s] = st
    y = torch.stack(ys)
    if D is not None:
        y = y + (D.double().view(H, 1) if D.dim() == 1 else D.double()) * x
    if z is not None:
        y = y * F.silu(z.double())
    return y


# ------------------------------------------------------------------------------------------------
# forward (the saved buffers of ssd_fused.h, float64)
# ------------------------------------------------------------------------------------------------


def _chunks(t, gather):
    """(T, ...) -> (NC, L, ...) with zeros on pad rows."""
    idx = gather.clamp_min(0)
    out = t[idx.reshape(-1)].view(*gather.shape, *t.shape[1:]).clone()
    out[gather < 0] = 0
    return out


def _heads(bc, hpg):  # (NC, L, G, N) -> (NC, H, L, N)
    return bc.permute(0, 2, 1, 3).repeat_interleave(hpg, 1)


def forward(x, dt_raw, B, C, A, tabs, D=None, dt_bias=None, z=None, initial_state=None, dt_softplus=False,
            dt_limit=(0.0, float("inf")), states_dtype=None):
    """Returns dict(out, dt, Lam, states, y, S_local): dt/Lam (NC, H, L), states (NC, H, P, N) entering each chunk,
    y (T, H, P) before the gate; all float64 (states rounded through states_dtype when given, as the kernels save)."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    hpg = H // G
    gather = tabs["gather"].cpu()
    NC, L = gather.shape
    dt_tok = prepare_dt(dt_raw, dt_bias, dt_softplus, dt_limit)
    dt = _chunks(dt_tok, gather).permute(0, 2, 1).contiguous()  # (NC, H, L)
    Lam = torch.cumsum(dt * A.double().view(1, H, 1), -1)
    xc = _chunks(x.double(), gather).permute(0, 2, 1, 3)  # (NC, H, L, P)
    Bc, Cc = _heads(_chunks(B.double(), gather), hpg), _heads(_chunks(C.double(), gather), hpg)
    last = Lam[..., -1:]
    S_local = torch.einsum("chj,chjp,chjn->chpn", torch.exp(last - Lam) * dt, xc, Bc)
    states = torch.zeros(NC, H, P, N, dtype=torch.float64)
    sco = tabs["seg_chunk_offsets"].cpu().tolist()
    par = tabs["parents"].cpu().tolist()
    ridx = tabs["root_index"].cpu().tolist()
    order = tabs["level_segments"].cpu().tolist()
    leave = {}
    for s in order:
        st = _entry_state(s, par, leave, initial_state, ridx.__getitem__, (H, P, N))
        for c in range(sco[s], sco[s + 1]):
            states[c] = st
            st = torch.exp(Lam[c, :, -1]).view(H, 1, 1) * st + S_local[c]
        leave[s] = st
    if states_dtype is not None:
        states = states.to(states_dtype).double()
    yc = _y_chunks(xc, Bc, Cc, dt, Lam, states)
    y = yc.permute(0, 2, 1, 3).reshape(NC * L, H, P)[tabs["scatter"].cpu()]
    if D is not None:
        y = y + (D.double().view(H, 1) if D.dim() == 1 else D.double()) * x.double()
    out = y * F.silu(z.double()) if z is not None else y
    return dict(out=out, dt=dt, Lam=Lam, states=states, y=y, S_local=S_local)


def _decay_matrix(Lam):
    L = Lam.shape[-1]
    diff = Lam.unsqueeze(-1) - Lam.unsqueeze(-2)
    mask = torch.ones(L, L, dtype=torch.bool).tril()
    return torch.where(mask, torch.exp(diff.clamp_max(0)), torch.zeros((), dtype=Lam.dtype))


def _y_chunks(xc, Bc, Cc, dt, Lam, states):
    Mmat = torch.einsum("chin,chjn->chij", Cc, Bc) * _decay_matrix(Lam)
    return (torch.exp(Lam).unsqueeze(-1) * torch.einsum("chin,chpn->chip", Cc, states)
            + torch.einsum("chij,chjp->chip", Mmat * dt.unsqueeze(-2), xc))


# ------------------------------------------------------------------------------------------------
# backward, stage by stage
# ------------------------------------------------------------------------------------------------


def backward(dout, x, dt_raw, B, C, A, tabs, saved, D=None, dt_bias=None, z=None, initial_state=None,
             dt_softplus=False, dt_limit=(0.0, float("inf"))):
    """Every intermediate and final gradient of the fused backward, float64, as a dict:
    dz, dy (T,H,P); cb (NC,G,L,L); local, ds_leave (NC,H,P,N); ddecay (NC,H); d_roots (R,H,P,N); d_initial_state;
    q, v, ddt_direct, d_dtA (NC,H,L);
    dx, ddt (T,H) (wrt prepared dt), ddt_raw, dB, dC, dA, dD, ddt_bias."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    hpg = H // G
    gather = tabs["gather"].cpu()
    NC, L = gather.shape
    dt, Lam, states = saved["dt"].double(), saved["Lam"].double(), saved["states"].double()
    A64 = A.double()
    dout = dout.double()
    r = {}
    # stage 1: the gate
    if z is not None:
        z64 = z.double()
        sg = torch.sigmoid(z64)
        r["dz"] = dout * saved["y"].double() * sg * (1 + z64 * (1 - sg))
        dy = dout * z64 * sg
    else:
        dy = dout
    r["dy"] = dy
    xc = _chunks(x.double(), gather).permute(0, 2, 1, 3)
    dyc = _chunks(dy, gather).permute(0, 2, 1, 3)
    Bc, Cc = _heads(_chunks(B.double(), gather), hpg), _heads(_chunks(C.double(), gather), hpg)
    eL = torch.exp(Lam)
    last = Lam[..., -1:]
    # stage 2: local entering-state gradient per chunk
    local = torch.einsum("chi,chip,chin->chpn", eL, dyc, Cc)
    r["local"] = local
    # stage 3: reverse tree state pass, deepest level first
    ds_leave, ddecay, d_roots = state_pass(local, Lam, states, tabs)
    r["ds_leave"], r["ddecay"], r["d_roots"] = ds_leave, ddecay, d_roots
    if initial_state is not None:
        r["d_initial_state"] = d_roots.sum(0) if initial_state.dim() == 3 else d_roots
    # stage 4: per chunk gradients
    dS = ds_leave
    Mdec = _decay_matrix(Lam)
    CB = torch.einsum("chin,chjn->chij", Cc, Bc)
    Mmat = CB * Mdec
    wlast = torch.exp(last - Lam)  # (NC, H, L)
    dSB = torch.einsum("chpn,chjn->chjp", dS, Bc)
    g = torch.einsum("chij,chip->chjp", Mmat, dyc) + wlast.unsqueeze(-1) * dSB
    Dv = None if D is None else (D.double().view(1, H, 1, 1) if D.dim() == 1 else D.double().view(1, H, 1, P))
    dxc = dt.unsqueeze(-1) * g + (0 if Dv is None else Dv * dyc)
    ddt_direct = (xc * g).sum(-1)
    dyx = torch.einsum("chip,chjp->chij", dyc, xc)
    dCB = Mdec * dt.unsqueeze(-2) * dyx
    dCh = eL.unsqueeze(-1) * torch.einsum("chip,chpn->chin", dyc, states) + torch.einsum("chij,chjn->chin", dCB, Bc)
    dBh = torch.einsum("chij,chin->chjn", dCB, Cc) + (wlast * dt).unsqueeze(-1) * torch.einsum("chjp,chpn->chjn", xc, dS)
    W = CB * dCB
    Wex = torch.cumsum(W, -1) - W  # Wex[i, k] = sum_{j<k} W_ij
    imask = torch.ones(L, L, dtype=torch.bool).tril()  # [i >= k]
    d_pairs = (Wex * imask).sum(-2)  # sum_{i >= k}
    Q = eL * (dyc * torch.einsum("chin,chpn->chip", Cc, states)).sum(-1)
    d_Q = torch.flip(torch.cumsum(torch.flip(Q, [-1]), -1), [-1])
    V = dt * wlast * (xc * dSB).sum(-1)
    d_V = torch.cumsum(V, -1) - V
    E = torch.exp(last.squeeze(-1)) * ddecay
    d_dtA = d_pairs + d_Q + d_V + E.unsqueeze(-1)
    r["ddt_direct"], r["d_dtA"], r["q"], r["v"] = ddt_direct, d_dtA, Q, V
    r["cb"] = CB[:, ::hpg] * torch.ones(L, L, dtype=torch.bool).tril()  # per group, lower triangle (NC, G, L, L)
    ddt_c = ddt_direct + A64.view(1, H, 1) * d_dtA
    r["dA"] = (dt * d_dtA).sum((0, 2))
    # scatter to tokens
    sc = tabs["scatter"].cpu()
    r["dx"] = dxc.permute(0, 2, 1, 3).reshape(NC * L, H, P)[sc]
    ddt = ddt_c.permute(0, 2, 1).reshape(NC * L, H)[sc]
    r["ddt"] = ddt
    dCg = dCh.view(NC, G, hpg, L, N).sum(2).permute(0, 2, 1, 3).reshape(NC * L, G, N)[sc]
    dBg = dBh.view(NC, G, hpg, L, N).sum(2).permute(0, 2, 1, 3).reshape(NC * L, G, N)[sc]
    r["dB"], r["dC"] = dBg, dCg
    if D is not None:
        xy = dy * x.double()
        r["dD"] = xy.sum((0, 2)) if D.dim() == 1 else xy.sum(0)
    # stage 5: dt preparation
    v = dt_raw.double() + (0 if dt_bias is None else dt_bias.double())
    pre = F.softplus(v, beta=1, threshold=20) if dt_softplus else v
    mask = ((pre >= dt_limit[0]) & (pre <= dt_limit[1])).double()
    dpre = ddt * mask
    dv = dpre * (torch.where(v > 20, torch.ones_like(v), torch.sigmoid(v)) if dt_softplus else 1.0)
    r["ddt_raw"] = dv
    if dt_bias is not None:
        r["ddt_bias"] = dv.sum(0)
    return r


def state_pass(local, Lam, states, tabs):
    """Stage 3 alone: the reverse tree state pass in float64 from given locals (deepest level first; a
    segment's last chunk starts from the sum of its children's carries in children order): ds_leave,
    ddecay (from the unrounded carry) and d_roots."""
    NC, H, P, N = local.shape
    local, Lam, states = local.double(), Lam.double(), states.double()
    sco = tabs["seg_chunk_offsets"].cpu().tolist()
    ridx = tabs["root_index"].cpu().tolist()
    order = tabs["level_segments"].cpu().tolist()
    co, kids = tabs["child_offsets"].cpu().tolist(), tabs["children"].cpu().tolist()
    lo = tabs["level_offsets"]
    ws = torch.zeros(len(ridx), H, P, N, dtype=torch.float64)
    ds_leave = torch.zeros(NC, H, P, N, dtype=torch.float64)
    ddecay = torch.zeros(NC, H, dtype=torch.float64)
    d_roots = torch.zeros(sum(1 for v in ridx if v >= 0), H, P, N, dtype=torch.float64)
    for lv in reversed(range(len(lo) - 1)):
        for s in order[lo[lv]:lo[lv + 1]]:
            carry = torch.zeros(H, P, N, dtype=torch.float64)
            for k in kids[co[s]:co[s + 1]]:
                carry = carry + ws[k]
            for c in reversed(range(sco[s], sco[s + 1])):
                ds_leave[c] = carry
                ddecay[c] = (states[c] * carry).sum((-1, -2))
                carry = torch.exp(Lam[c, :, -1]).view(H, 1, 1) * carry + local[c]
            ws[s] = carry
            if ridx[s] >= 0:
                d_roots[ridx[s]] = carry
    return ds_leave, ddecay, d_roots
