"""CPU check of the tolerances of the Half route's bf16 / fp16 post kernel (ssd_post_bwd.cu): its rounding points emulated in
float64 (dy, e^Lam dy, dS, M = cb e^{Lam_i - Lam_j}, wlast dt x and sum_h dCB rounded once to the input type,
every product and sum exact) against the float64 stage reference. Measured (MIXED trie): bf16 q 1.3e-3,
v 1.1e-3, ddt_direct 2.2e-3, d_dtA 1.7e-3, dx 2.9e-3, dB / dC 2.4e-3 (P 64, N 128); fp16 ~8x smaller. The GPU
tests (test_ssd_post_bwd_gpu.py) allow 2e-2 / 5e-3 per stage, so a failure there is a kernel bug, not rounding.
e^Lam dy is emulated from the rounded dy, rounded again; the kernel rounds it once from the fp32 dy (one rounding
closer, so this bound covers it).
ds in the input type: ds_local rounded to the input type by the local kernel (from e^Lam dy rounded once), the state
pass on those values (fp32 there, exact here), ds_leave rounded, ddecay from the unrounded carry. Measured (bf16,
P 64, N 128, MIXED / DEEP): ds_leave 2.8e-3 / 2.6e-3 relative, v 2.1e-3 / 2.7e-3, d_dtA 2.0e-3 / 2.4e-3, dx / dB /
dC 2.3e-3 .. 2.9e-3; fp16 about 8x smaller.
"""

import torch

import ssd_bwd_reference as ref
from ssd_bwd_reference import state_pass
from test_ssd_fused_bwd_gpu import MIXED, make, rel_rms


def emu(seg, par, dtype, H, P, G, N, chunk=64, seed=0):
    T = seg[-1]; roots = sum(p < 0 for p in par)
    d = make(T, H, P, G, N, roots, True, seed)
    for k in ("x","B","C","z","dout"): d[k] = d[k].to(dtype).double()
    A = -torch.exp(d["A_log"]).float().double()
    tabs = ref.chunk_tables(seg, par, chunk)
    opt = dict(D=d["D"], dt_bias=d["dt_bias"], z=d["z"], initial_state=d["h0"], dt_softplus=True)
    sv = ref.forward(d["x"], d["dt"], d["B"], d["C"], A, tabs, states_dtype=dtype, **opt)
    saved = dict(dt=sv["dt"].float().double(), Lam=sv["Lam"].float().double(), states=sv["states"], y=sv["y"].to(dtype).double())
    w = ref.backward(d["dout"], d["x"], d["dt"], d["B"], d["C"], A, tabs, saved, **opt)
    rd = lambda t: t.to(dtype).double()
    hpg = H // G; gather = tabs["gather"]; NC, L = gather.shape
    dt, Lam, states = saved["dt"], saved["Lam"], saved["states"]
    xc = ref._chunks(d["x"], gather).permute(0, 2, 1, 3)
    dyc = rd(ref._chunks(w["dy"], gather).permute(0, 2, 1, 3))
    Bc, Cc = ref._heads(ref._chunks(d["B"], gather), hpg), ref._heads(ref._chunks(d["C"], gather), hpg)
    eL = torch.exp(Lam); last = Lam[..., -1:]
    # the local kernel rounds e^Lam dy (from the unrounded dy) and its fp32 result once each, the state pass carries
    # the rounded locals exactly (fp32 there) and rounds ds_leave; ddecay comes from the unrounded carry
    dyu = ref._chunks(w["dy"], gather).permute(0, 2, 1, 3)
    local = rd(torch.einsum("chip,chin->chpn", rd(torch.exp(Lam).unsqueeze(-1) * dyu), Cc))
    leave, w_ddecay, _ = state_pass(local, Lam, states, tabs)
    dS = rd(leave)
    Mdec = ref._decay_matrix(Lam)
    CB = torch.einsum("chin,chjn->chij", Cc, Bc)
    Mmat = rd(CB * Mdec)
    wlast = torch.exp(last - Lam)
    dSB = torch.einsum("chpn,chjn->chjp", dS, Bc)
    g = torch.einsum("chij,chip->chjp", Mmat, dyc) + wlast.unsqueeze(-1) * dSB
    ddt_direct = (xc * g).sum(-1)
    dyx = torch.einsum("chip,chjp->chij", dyc, xc)
    dCB = Mdec * dt.unsqueeze(-2) * dyx
    W = CB * dCB
    Wex = torch.cumsum(W, -1) - W
    d_pairs = (Wex * torch.ones(L, L, dtype=torch.bool).tril()).sum(-2)
    Q = eL * (dyc * torch.einsum("chin,chpn->chip", Cc, states)).sum(-1)
    d_Q = torch.flip(torch.cumsum(torch.flip(Q, [-1]), -1), [-1])
    V = dt * wlast * (xc * dSB).sum(-1)
    d_V = torch.cumsum(V, -1) - V
    d_dtA = d_pairs + d_Q + d_V + (torch.exp(last.squeeze(-1)) * w_ddecay).unsqueeze(-1)
    edy = rd(eL.unsqueeze(-1) * dyc); xw = rd((wlast * dt).unsqueeze(-1) * xc)
    sd = rd(dCB.view(NC, G, hpg, L, L).sum(2))
    dCg = torch.einsum("chip,chpn->chin", edy, states).view(NC, G, hpg, L, N).sum(2) + torch.einsum("cgij,cgjn->cgin", sd, Bc[:, ::hpg])
    dBg = torch.einsum("cgij,cgin->cgjn", sd, Cc[:, ::hpg]) + torch.einsum("chjp,chpn->chjn", xw, dS).view(NC, G, hpg, L, N).sum(2)
    sc = tabs["scatter"]
    dCt = dCg.permute(0, 2, 1, 3).reshape(NC * L, G, N)[sc]; dBt = dBg.permute(0, 2, 1, 3).reshape(NC * L, G, N)[sc]
    Dv = d["D"].view(1, H, 1, P)
    dxc = dt.unsqueeze(-1) * g + Dv * dyc
    dx = rd(dxc.permute(0, 2, 1, 3).reshape(NC * L, H, P)[sc])
    e = dict(q=rel_rms(Q, w["q"]), v=rel_rms(V, w["v"]), ddt_direct=rel_rms(ddt_direct, w["ddt_direct"]), d_dtA=rel_rms(d_dtA, w["d_dtA"]),
             dx=rel_rms(dx, w["dx"]), dB=rel_rms(dBt, w["dB"]), dC=rel_rms(dCt, w["dC"]), ds_leave=rel_rms(dS, w["ds_leave"]))
    print(dtype, H, P, G, N, " ".join(f"{k}={v:.2e}" for k, v in e.items()))
    return e


def test_post_rounding_bf16_fp16():
    e = emu(*MIXED, torch.bfloat16, 4, 16, 2, 16)
    assert max(e.values()) <= 5e-3, e
    e = emu(*MIXED, torch.float16, 4, 16, 2, 16)
    assert max(e.values()) <= 1e-3, e
