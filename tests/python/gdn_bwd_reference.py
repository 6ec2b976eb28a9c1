"""Float64 reference of every stage of the fused Gated DeltaNet backward, per chunk.

The stage decomposition of plugins/gated_delta_net/csrc/gdn_fused/gdn_fused_bwd.cpp written plainly
in float64 PyTorch. Each stage is a function of explicit inputs, so a GPU test can feed a stage the
GPU's own outputs of the previous stage and see that stage's error alone. Forward quantities come
from tests/python/gdn_chunk_reference.py's ``stages`` (G, Ainv, w, kd, h, v_new, rq, rk).

Per chunk c and value head (C = 64; q^ = scale * l2norm(q), k^ = l2norm(k); E_ij = exp(G_i - G_j)
for j <= i, else 0; M = E without the diagonal mask of A, i.e. A uses j < i):
  a.  dv_local = (E * q^ k^T)^T dO,  q_g = exp(G) q^
  pass (reverse, children before parents; dS = gradient of the state leaving the chunk):
      gso[c] = dS; dv_total = dv_local + kd dS; dS <- decay dS + q_g^T dO - w^T dv_total
  b.  dP = E * (dO v_new^T)
      dq^ = exp(G) (dO h^T) + dP k^
      dk^ = dP^T q^ + exp(G_last - G) (v_new dS^T)
      dG, directly (no O(1) parts that cancel; L = the chunk's last row holding a token, C - 1 when none;
      D = strictly lower part of dP * (q^ k^T); T_j = <exp(G_last - G_j)(v_new dS^T)_j, k^_j>):
      dG_i = <exp(G_i)(dO h^T)_i, q^_i> + rowsum(D)_i - colsum(D)_i - [i != L] T_i
             + [i == L] (decay <h, dS> + sum_{j != L} T_j)
      (formula="identity": FLA's dG = <dq^, q^> - <dk^, k^>, dG_{C-1} += decay <h, dS> + sum_j T_j, equal in
      exact arithmetic at the tokens, but the difference of two O(1) terms: it loses dG under extreme decays)
  c.  (WY) dw = -dv_total h^T, du = dv_total, kb = beta exp(G) k^, vb = beta v, u = Ainv vb
      dkb = Ainv^T dw, dvb = Ainv^T du, dA = -(dkb w^T + dvb u^T) strictly lower
      W2 = dA * E * (k^ k^T)  (strictly lower),  dKK = beta * dA * E
      dk^ += beta exp(G) dkb + dKK k^ + dKK^T k^
      dv   = beta dvb
      dbeta = <dvb, v> + exp(G) <dkb, k^> + rowsum(W2)
      dG  += beta exp(G) <dkb, k^> + beta rowsum(W2) - colsum(beta W2)
  d.  dg = reverse cumsum of dG in each chunk; at the tokens (scatter); dq, dk: the value heads of
      a key head summed in order, times scale (dq), through l2norm's backward
      (y = x r: dx = r (dy - y <y, dy>)); d_initial_state: per root, summed when shared.
"""

from __future__ import annotations

import math

import torch

from gdn_chunk_reference import _chunks

f64 = torch.float64


def _masks(C, dev):
    lower_eq = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    strict = torch.ones(C, C, dtype=torch.bool, device=dev).tril(-1)
    return lower_eq, strict


def _E(G, mask):
    diff = G.unsqueeze(-1) - G.unsqueeze(-2)
    return torch.exp(diff.masked_fill(~mask, -math.inf))


def inputs(grad_o, q, k, v, g, beta, tables, scale=0.0, use_qk_l2norm=True):
    """Chunk-major float64 inputs (value heads repeated for q^, k^ in the reference only)."""
    gather = tables[0]
    q, k, v, g, beta, grad_o = (t.detach().to(f64) for t in (q, k, v, g, beta, grad_o))
    T, HK, K = q.shape
    HV = v.shape[1]
    groups = HV // HK
    sc = scale if scale > 0 else 1.0 / math.sqrt(K)
    if use_qk_l2norm:
        rq = torch.rsqrt((q * q).sum(-1) + 1e-6)
        rk = torch.rsqrt((k * k).sum(-1) + 1e-6)
    else:
        rq = torch.ones(T, HK, dtype=f64, device=q.device)
        rk = torch.ones(T, HK, dtype=f64, device=q.device)
    rep = lambda t: t.repeat_interleave(groups, dim=1)  # noqa: E731
    gather = gather.to(q.device)
    return dict(
        qc=_chunks(rep(q * rq.unsqueeze(-1) * sc), gather), kc=_chunks(rep(k * rk.unsqueeze(-1)), gather), valid=gather >= 0,
        vc=_chunks(v, gather), bc=_chunks(beta, gather), dOc=_chunks(grad_o, gather), rq=rq, rk=rk, scale=sc,
        groups=groups, q=q, k=k, use_qk_l2norm=use_qk_l2norm)


def stage_a(qc, kc, G, dOc):
    C = G.shape[-1]
    lower_eq, _ = _masks(C, G.device)
    P = (qc @ kc.transpose(-1, -2)) * _E(G, lower_eq)
    return dict(dv_local=P.transpose(-1, -2) @ dOc, q_g=qc * torch.exp(G).unsqueeze(-1))


def stage_pass(dv_local, q_g, dOc, w, kd, G, tables, initial_state=None, round_to=None):
    """Reverse tree state pass (what chunk_state_pass_tc_backward computes), float64."""
    _g, _s, sco, parents, root_index, _ls, _lo, child_offsets, children = tables
    rnd = (lambda x: x.to(round_to).to(f64)) if round_to is not None else (lambda x: x)
    NC, HV, C, V = dv_local.shape
    K = w.shape[-1]
    dev = dv_local.device
    decay = torch.exp(G[..., -1])
    sco_l, par_l = [int(x) for x in sco.tolist()], [int(x) for x in parents.tolist()]
    co_l, ch_l = [int(x) for x in child_offsets.tolist()], [int(x) for x in children.tolist()]
    ri_l = [int(x) for x in root_index.tolist()]
    S = len(par_l)
    R = sum(1 for p in par_l if p < 0)
    gso = torch.zeros(NC, HV, K, V, dtype=f64, device=dev)
    dvt = torch.zeros(NC, HV, C, V, dtype=f64, device=dev)
    ginit = [None] * S
    d_root = torch.zeros(R, HV, K, V, dtype=f64, device=dev)
    for s in reversed(range(S)):
        dS = torch.zeros(HV, K, V, dtype=f64, device=dev)
        for c in ch_l[co_l[s]:co_l[s + 1]]:
            dS = dS + ginit[c]
        for c in reversed(range(sco_l[s], sco_l[s + 1])):
            gso[c] = rnd(dS)
            dvt[c] = rnd(dv_local[c] + kd[c] @ dS)
            dS = decay[c].view(HV, 1, 1) * dS + q_g[c].transpose(-1, -2) @ dOc[c] - w[c].transpose(-1, -2) @ dvt[c]
        ginit[s] = dS
        if par_l[s] < 0:
            d_root[ri_l[s]] = dS
    d_init = None
    if initial_state is not None:
        shared = initial_state.dim() == 3 or (initial_state.dim() == 4 and initial_state.shape[0] == 1 and R != 1)
        if initial_state.dim() == 3:
            d_init = d_root.sum(0)
        elif shared:
            d_init = d_root.sum(0, keepdim=True)
        else:
            d_init = d_root
    return dict(grad_state_out=gso, dv_total=dvt, d_root=d_root, d_initial_state=d_init)


def last_rows(valid, C, dev):
    """(NC,) index of each chunk's last row holding a token (C - 1 when none or when valid is None)."""
    if valid is None:
        return None
    valid = valid.to(dev)
    idx = torch.arange(C, device=dev).expand_as(valid)
    last = torch.where(valid, idx, torch.full_like(idx, -1)).amax(-1)
    return torch.where(last < 0, torch.full_like(last, C - 1), last)


def stage_b(qc, kc, G, dOc, h, v_new, gso, valid=None, formula="direct"):
    """valid: (NC, C) bool, rows holding a token (None: all). formula: "direct" (the kernels') or "identity"."""
    NC, HV, C = G.shape
    lower_eq, strict = _masks(C, G.device)
    E = _E(G, lower_eq)
    dP = E * (dOc @ v_new.transpose(-1, -2))
    eG = torch.exp(G).unsqueeze(-1)
    dq_inter = eG * (dOc @ h.transpose(-1, -2))
    dq = dq_inter + dP @ kc
    to_last = torch.exp(G[..., -1:] - G).unsqueeze(-1)
    dk_kd = to_last * (v_new @ gso.transpose(-1, -2))
    dk = dP.transpose(-1, -2) @ qc + dk_kd
    decay_term = torch.exp(G[..., -1]) * (h * gso).sum((-1, -2))
    if formula == "identity":
        dG = (dq * qc).sum(-1) - (dk * kc).sum(-1)
        dG = dG.clone()
        dG[..., -1] += decay_term + (dk_kd * kc).sum((-1, -2))
        return dict(dq_hv=dq, dk_b=dk, dG_b=dG)
    L = last_rows(valid, C, G.device)
    if L is None:
        L = torch.full((NC,), C - 1, dtype=torch.int64, device=G.device)
    D = (dP * (qc @ kc.transpose(-1, -2))).masked_fill(~strict, 0.0)
    Tj = (dk_kd * kc).sum(-1)  # (NC, HV, C)
    at_last = torch.nn.functional.one_hot(L, C).to(torch.bool).unsqueeze(1)  # (NC, 1, C)
    Tj = Tj.masked_fill(at_last, 0.0)
    dG = (dq_inter * qc).sum(-1) + D.sum(-1) - D.sum(-2) - Tj
    dG = dG + at_last.to(dG.dtype) * (decay_term + Tj.sum(-1)).unsqueeze(-1)
    return dict(dq_hv=dq, dk_b=dk, dG_b=dG)


def stage_c(kc, vc, bc, G, Ainv, w, h, dv_total, dk_b, dG_b):
    C = G.shape[-1]
    _, strict = _masks(C, G.device)
    E = _E(G, strict)
    eG = torch.exp(G)
    dw = -dv_total @ h.transpose(-1, -2)
    AinvT = Ainv.transpose(-1, -2)
    dkb = AinvT @ dw
    dvb = AinvT @ dv_total
    u = Ainv @ (vc * bc.unsqueeze(-1))
    dA = -(dkb @ w.transpose(-1, -2) + dvb @ u.transpose(-1, -2))
    dAE = (dA * E).masked_fill(~strict, 0.0)
    KK = kc @ kc.transpose(-1, -2)
    W2 = dAE * KK
    dKK = bc.unsqueeze(-1) * dAE
    dk = dk_b + (bc * eG).unsqueeze(-1) * dkb + dKK @ kc + dKK.transpose(-1, -2) @ kc
    dv = bc.unsqueeze(-1) * dvb
    kbdot = (dkb * kc).sum(-1)
    dbeta = (dvb * vc).sum(-1) + eG * kbdot + W2.sum(-1)
    BW2 = bc.unsqueeze(-1) * W2
    dG = dG_b + bc * eG * kbdot + BW2.sum(-1) - BW2.sum(-2)
    return dict(dw=dw, dkb=dkb, dvb=dvb, u=u, dA=dA.masked_fill(~strict, 0.0), dk_hv=dk, dv_c=dv, dbeta_c=dbeta, dG=dG)


def _tokens(x, scatter):
    """(NC, H, C, ...) chunk-major -> (T, H, ...) at the tokens."""
    NC, H, C = x.shape[:3]
    flat = x.transpose(1, 2).reshape(NC * C, H, *x.shape[3:])
    return flat[scatter.to(x.device)]


def stage_d(dq_hv, dk_hv, dG, dv_c, dbeta_c, scatter, inp):
    dg_c = torch.flip(torch.cumsum(torch.flip(dG, [-1]), -1), [-1])
    HV = dq_hv.shape[1]
    groups = inp["groups"]
    HK = HV // groups
    dqh = _tokens(dq_hv, scatter)  # (T, HV, K)
    dkh = _tokens(dk_hv, scatter)
    T, _, K = dqh.shape
    dqh = dqh.reshape(T, HK, groups, K).sum(2) * inp["scale"]
    dkh = dkh.reshape(T, HK, groups, K).sum(2)

    def l2back(x, r, dy):
        y = x * r.unsqueeze(-1)
        return r.unsqueeze(-1) * (dy - y * (y * dy).sum(-1, keepdim=True))

    if inp["use_qk_l2norm"]:
        dq = l2back(inp["q"], inp["rq"], dqh)
        dk = l2back(inp["k"], inp["rk"], dkh)
    else:
        dq, dk = dqh, dkh
    return dict(dg_c=dg_c, dq=dq, dk=dk, dg=_tokens(dg_c, scatter), dbeta=_tokens(dbeta_c, scatter),
                dv=_tokens(dv_c, scatter))


def backward(grad_o, q, k, v, g, beta, tables, fwd, initial_state=None, scale=0.0, use_qk_l2norm=True, round_to=None):
    """Every stage of the backward in float64 from the forward reference's dict ``fwd``."""
    inp = inputs(grad_o, q, k, v, g, beta, tables, scale, use_qk_l2norm)
    G, Ainv, w, kd, h, v_new = (fwd[n].to(f64) for n in ("G", "Ainv", "w", "kd", "h", "v_new"))
    out = {}
    out.update(stage_a(inp["qc"], inp["kc"], G, inp["dOc"]))
    out.update(stage_pass(out["dv_local"], out["q_g"], inp["dOc"], w, kd, G, tables, initial_state, round_to))
    out.update(stage_b(inp["qc"], inp["kc"], G, inp["dOc"], h, v_new, out["grad_state_out"], inp["valid"]))
    out.update(stage_c(inp["kc"], inp["vc"], inp["bc"], G, Ainv, w, h, out["dv_total"], out["dk_b"], out["dG_b"]))
    out.update(stage_d(out["dq_hv"], out["dk_hv"], out["dG"], out["dv_c"], out["dbeta_c"], tables[1], inp))
    out["dOc"] = inp["dOc"]
    return out
