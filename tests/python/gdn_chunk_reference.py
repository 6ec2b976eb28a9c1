"""Float64 reference of every stage of the fused Gated DeltaNet forward, per chunk.

The stage decomposition of plugins/gated_delta_net/csrc/gdn_fused/gdn_fused.h written plainly in
float64 PyTorch over the plan's chunk tables (the tuple of tests/python/test_gdn_chunked.py's
``chunk_tables`` or TreePlan.chunk_tables: gather, scatter, seg_chunk_offsets, parents, root_index,
level_segments, level_offsets, child_offsets, children), the tree state pass included (a plain loop
over segments, parents first). Shapes (chunk-major, NC chunks, C = 64):

  rq, rk  (T, HK)          rsqrt(sum x^2 + 1e-6) of q and k (1 without l2norm)
  G       (NC, HV, C)      chunk-local cumsum of g (pad rows g = 0)
  A       (NC, HV, C, C)   beta_i exp(G_i - G_j) <k^_i, k^_j>, j < i
  Ainv    (NC, HV, C, C)   (I + A)^-1
  w, kd   (NC, HV, C, K)   Ainv (beta exp(G) k^), exp(G_last - G) k^
  u       (NC, HV, C, V)   Ainv (beta v)
  decay   (NC, HV)         exp(G_last)
  h       (NC, HV, K, V)   state entering each chunk
  v_new   (NC, HV, C, V)   u - w h
  o_chunk (NC, HV, C, V)   exp(G_i) q^_i h + sum_{j<=i} exp(G_i - G_j) <q^_i, k^_j> v_new_j
  o       (T, HV, V)       o_chunk at the tokens (gather)
  final_state (S, HV, K, V) state leaving each segment

``round_to`` (optional dtype) rounds w, u, kd, h and v_new where the kernels store them in the input
type before they are used by the next stage (as the fused kernels and the state pass do), so a
comparison of a later stage against this reference sees only that stage's own error. Left None:
exact float64 throughout.
"""

from __future__ import annotations

import math

import torch


def _chunks(t, gather):
    """(T, H, ...) -> (NC, H, C, ...) through gather; pad rows (-1) are zeros."""
    T = t.shape[0]
    padded = torch.cat([t, torch.zeros_like(t[:1])], 0)
    idx = torch.where(gather < 0, torch.full_like(gather, T), gather)
    out = padded[idx]  # (NC, C, H, ...)
    return out.transpose(1, 2).contiguous()


def state_pass(w, u, kd, decay, tables, initial_state=None, round_to=None):
    """The tree state pass in float64 (segments in parents-first order): h (NC, H, K, V) entering each
    chunk, v_new = u - w h, and the final state of each segment (S, H, K, V). round_to rounds h and
    v_new (as the kernels store them) before they are used."""
    f = torch.float64
    w, u, kd, decay = (t.detach().to(f) for t in (w, u, kd, decay))
    dev = w.device
    rnd = (lambda x: x.to(round_to).to(f)) if round_to is not None else (lambda x: x)
    _gather, _scatter, sco, parents, root_index = tables[:5]
    NC, HV, C, K = w.shape
    V = u.shape[-1]
    sco_l = [int(x) for x in sco.tolist()]
    par_l = [int(x) for x in parents.tolist()]
    ri_l = [int(x) for x in root_index.tolist()]
    S = len(par_l)
    h = torch.zeros(NC, HV, K, V, dtype=f, device=dev)
    v_new = torch.zeros(NC, HV, C, V, dtype=f, device=dev)
    final = torch.zeros(S, HV, K, V, dtype=f, device=dev)
    h0 = None
    if initial_state is not None:
        h0 = initial_state.detach().to(device=dev, dtype=f)
        if h0.dim() == 4 and h0.shape[0] == 1:
            h0 = h0[0]
    for s in range(S):
        if par_l[s] >= 0:
            state = final[par_l[s]].clone()
        elif h0 is None:
            state = torch.zeros(HV, K, V, dtype=f, device=dev)
        else:
            state = (h0 if h0.dim() == 3 else h0[ri_l[s]]).clone()
        for c in range(sco_l[s], sco_l[s + 1]):
            hc = rnd(state)
            h[c] = hc
            vn = rnd(u[c] - w[c] @ hc)
            v_new[c] = vn
            state = decay[c].view(HV, 1, 1) * state + kd[c].transpose(-1, -2) @ vn
        final[s] = state
    return h, v_new, final


def outputs(q, k, G, h, v_new, tables, scale=0.0, use_qk_l2norm=True, value_heads=None):
    """o (T, HV, V) in float64 from q, k and the stages G, h, v_new (the output stage alone)."""
    f = torch.float64
    q, k, G, h, v_new = (t.detach().to(f) for t in (q, k, G, h, v_new))
    gather, scatter = tables[0].to(q.device), tables[1].to(q.device)
    T, HK, K = q.shape
    NC, HV, C, V = v_new.shape
    groups = HV // HK
    sc = scale if scale > 0 else 1.0 / math.sqrt(K)
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    rep = lambda t: t.repeat_interleave(groups, dim=1)  # noqa: E731
    qc, kc = _chunks(rep(q * sc), gather), _chunks(rep(k), gather)
    lower_eq = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    E = torch.exp((G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~lower_eq, -math.inf))
    o_chunk = (qc * torch.exp(G).unsqueeze(-1)) @ h + ((qc @ kc.transpose(-1, -2)) * E) @ v_new
    return o_chunk.transpose(1, 2).reshape(NC * C, HV, V)[scatter]


def stages(q, k, v, g, beta, tables, initial_state=None, scale=0.0, use_qk_l2norm=True, round_to=None):
    """Every stage of the forward in float64 (see the module docstring). Returns a dict."""
    gather, scatter, sco, parents, root_index, _level_segments, _level_offsets, _child_offsets, _children = tables
    f = torch.float64
    dev = q.device
    q, k, v, g, beta = (t.detach().to(f) for t in (q, k, v, g, beta))
    gather = gather.to(dev)
    T, HK, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    groups = HV // HK
    NC, C = gather.shape
    sc = scale if scale > 0 else 1.0 / math.sqrt(K)
    rnd = (lambda x: x.to(round_to).to(f)) if round_to is not None else (lambda x: x)

    if use_qk_l2norm:
        rq = torch.rsqrt((q * q).sum(-1) + 1e-6)
        rk = torch.rsqrt((k * k).sum(-1) + 1e-6)
    else:
        rq = torch.ones(T, HK, dtype=f, device=dev)
        rk = torch.ones(T, HK, dtype=f, device=dev)
    qh = q * rq.unsqueeze(-1) * sc
    kh = k * rk.unsqueeze(-1)

    # key heads repeated to value heads (only here, in the reference)
    rep = lambda t: t.repeat_interleave(groups, dim=1)  # noqa: E731
    qc, kc = _chunks(rep(qh), gather), _chunks(rep(kh), gather)  # (NC, HV, C, K)
    vc = _chunks(v, gather)  # (NC, HV, C, V)
    gc, bc = _chunks(g, gather), _chunks(beta, gather)  # (NC, HV, C)

    G = torch.cumsum(gc, -1)
    diff = G.unsqueeze(-1) - G.unsqueeze(-2)  # G_i - G_j
    lower_eq = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    strict = torch.ones(C, C, dtype=torch.bool, device=dev).tril(-1)
    E = torch.exp(diff.masked_fill(~lower_eq, -math.inf))
    A = (bc.unsqueeze(-1) * E * (kc @ kc.transpose(-1, -2))).masked_fill(~strict, 0.0)
    eye = torch.eye(C, dtype=f, device=dev)
    Ainv = torch.linalg.solve_triangular(eye + A, eye.expand(NC, HV, C, C), upper=False, unitriangular=True)
    w = rnd(Ainv @ (kc * (bc * torch.exp(G)).unsqueeze(-1)))
    u = rnd(Ainv @ (vc * bc.unsqueeze(-1)))
    Glast = G[..., -1:]
    kd = rnd(kc * torch.exp(Glast - G).unsqueeze(-1))
    decay = torch.exp(G[..., -1])

    h, v_new, final = state_pass(w, u, kd, decay, tables, initial_state, round_to)

    scores = (qc @ kc.transpose(-1, -2)) * E
    o_chunk = (qc * torch.exp(G).unsqueeze(-1)) @ h + scores @ v_new
    flat = o_chunk.transpose(1, 2).reshape(NC * C, HV, V)
    o = flat[scatter.to(dev)]
    return dict(rq=rq, rk=rk, G=G, A=A, Ainv=Ainv, w=w, u=u, kd=kd, decay=decay, h=h, v_new=v_new, o_chunk=o_chunk,
                o=o, final_state=final)
