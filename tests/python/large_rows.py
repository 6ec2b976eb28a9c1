"""What the 2^31-element row tests share (test_gdn_fused_large_gpu.py, test_ssd_fused_large_gpu.py).

Both lay the big row out as the same forest (``SPEC`` below, scaled per family) so its last segments sit
past 2^31 elements and start from a state that comes through the tree:
  seg 0  A   root (root index 0)
  seg 1  B1  child of A
  seg 2  B2  child of B1
  seg 3  B3  child of A
  seg 4  P   root (root index 1)   <- past 2^31 elements from here on
  seg 5  P2  child of P
  seg 6  C   child of P2           (its start state: P -> P2 -> C, two levels of the tree)
  seg 7  X   child of A            (its start state: A's end state, half the row back)
and checks them against two small rows holding a segment's whole path, from the same initial state:
R1 = [P, P2, C] (init h0[1], also against the float64 token oracle) and R2 = [A, X] (init h0[0]).
A family's test gives its op (``run(x, seg_offsets, parents, init)``), its token and parameter input
names, and its oracle; everything else is here.
"""

from __future__ import annotations

import pytest
import torch
from tree_recurrence import settings

from tries import trie


def spec(a, b1, b2):
    """The forest above with A, B1, B2 of the given lengths (B3 100, P 130, P2 70, C 200, X 200 tokens)."""
    return [(-1, a), (0, b1), (1, b2), (0, 100), (-1, 130), (4, 70), (5, 200), (0, 200)]


def _large_ok(min_free_gib):
    if not settings.get("TREE_RECURRENCE_LARGE_TESTS"):
        return False, "set TREE_RECURRENCE_LARGE_TESTS=1 to run the 2^31-element rows"
    if not torch.cuda.is_available():
        return False, "needs CUDA"
    free, _ = torch.cuda.mem_get_info()
    if free < min_free_gib * 2**30:
        return False, f"needs >= {min_free_gib} GiB free GPU memory, {free / 2**30:.1f} GiB free"
    return True, ""


def large_mark(module_name, min_free_gib=80):
    """The module's pytestmark: runs only with TREE_RECURRENCE_LARGE_TESTS=1 on a GPU with >= min_free_gib GiB free."""
    ok, why = _large_ok(min_free_gib)
    if not ok and settings.get("TREE_RECURRENCE_LARGE_TESTS"):
        print(f"\n{module_name}: skipped: {why}")  # (the device log shows why)
    return pytest.mark.skipif(not ok, reason=why)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_gib():
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def reset_peak():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def rel_rms(got, want, step=1 << 26):
    """Relative RMS on the GPU in float64, in slices (the big tensors do not go to the host)."""
    a, b = got.detach().reshape(-1), want.detach().reshape(-1)
    assert a.numel() == b.numel(), (got.shape, want.shape)
    num = torch.zeros((), dtype=torch.float64, device=a.device)
    den = torch.zeros((), dtype=torch.float64, device=a.device)
    for i in range(0, a.numel(), step):
        x, y = a[i:i + step].double(), b[i:i + step].to(a.device).double()
        assert torch.isfinite(x).all(), "non-finite values"
        num += (x - y).pow(2).sum()
        den += y.pow(2).sum()
    return float((num / den.clamp_min(1e-300)).sqrt())


def sub_row(x, ranges, tokens, params=()):
    """The token slices `ranges` of every per-token input `tokens`, concatenated (a new, small row);
    the `params` inputs kept whole."""
    out = {n: torch.cat([x[n][lo:hi] for lo, hi in ranges]) for n in tokens}
    out.update({n: x[n] for n in params})
    return out


def make_big(spec_, make_inputs, elements_per_token, device):
    """The big row: inputs from ``make_inputs(T, roots=2)``, its seg_offsets / parents from ``spec_``."""
    so, par = trie(spec_)
    T = so[-1]
    assert device != "cuda" or so[4] * elements_per_token >= 2**31, "the P chain must start past 2^31 elements"
    return dict(x=make_inputs(T, roots=2), so=so, par=par, T=T)


def small_rows(so):
    """R1 = [P, P2, C] and R2 = [A, X] as (token ranges in the big row, seg_offsets, parents)."""
    n_a = so[1] - so[0]
    r1 = ([(so[4], so[7])], [0, so[5] - so[4], so[6] - so[4], so[7] - so[4]], [-1, 0, 1])
    r2 = ([(so[0], so[1]), (so[7], so[8])], [0, n_a, n_a + so[8] - so[7]], [-1, 0])
    return r1, r2


def check_last_segments(big, run, tokens, params, oracle, *, same_tol, oracle_tol, check_out, check_fused=None):
    """The big row's P, P2, C outputs against R1 alone (and R1 against ``oracle(r1, so1, par1, h0)``, the
    float64 token oracle), its A and X outputs against R2 alone. ``check_out(out)`` asserts the big
    row's output shape / dtype; ``check_fused(r1, so1, par1, h0, out1)`` (on CUDA) that R1 took the
    fused path."""
    x, so, par = big["x"], big["so"], big["par"]
    (rng1, so1, par1), (rng2, so2, par2) = small_rows(so)
    with torch.no_grad():
        out = run(x, so, par, x["h0"])
        sync()
        print(f"\nbig row: {big['T']} tokens, out {tuple(out.shape)} {out.dtype} = {out.numel() / 2**31:.2f} x 2^31 "
              f"elements, peak {peak_gib():.1f} GiB")
        check_out(out)

        r1, h0_1 = sub_row(x, rng1, tokens, params), x["h0"][1:2]
        out1 = run(r1, so1, par1, h0_1)
        if check_fused is not None and out1.is_cuda:
            check_fused(r1, so1, par1, h0_1, out1)
        want1 = oracle(r1, so1, par1, h0_1).to(out1.device)
        errs = {}
        for i, name in enumerate(("P", "P2", "C")):
            lo, hi, lo1, hi1 = so[4 + i], so[5 + i], so1[i], so1[i + 1]
            errs[name] = (rel_rms(out[lo:hi], out1[lo1:hi1]), torch.equal(out[lo:hi], out1[lo1:hi1]),
                          rel_rms(out[lo:hi], want1[lo1:hi1]))
        errs["R1"] = (0.0, True, rel_rms(out1, want1))

        out2 = run(sub_row(x, rng2, tokens, params), so2, par2, x["h0"][0:1])
        for name, (lo, hi), (lo2, hi2) in [("A", (so[0], so[1]), (so2[0], so2[1])), ("X", (so[7], so[8]), (so2[1], so2[2]))]:
            errs[name] = (rel_rms(out[lo:hi], out2[lo2:hi2]), torch.equal(out[lo:hi], out2[lo2:hi2]), float("nan"))
    print("  segment   vs path alone (rel RMS, bitwise)   vs float64 token oracle")
    for name, (e, bit, eo) in errs.items():
        print(f"  {name:6s}    {e:12.3e}  {str(bit):5s}                 {eo:12.3e}")
    bad = {n: e for n, e in errs.items() if not (e[0] <= same_tol) or (e[2] == e[2] and not (e[2] <= oracle_tol))}
    assert not bad, f"outputs past 2^31 elements differ from their paths run alone / the oracle: {bad}"


def check_p_chain_gradients(big, run, tokens, params, grad_out, tol):
    """Backward smoke: the big row's gradients (``tokens``, h0, ``params``) under ``grad_out`` are finite;
    the P tree alone (R1, its own h0[1], the same output gradient) gives the big row's per-token
    gradients and d h0[1] (the P tree is independent of the rest; ``params`` gradients sum over every
    token: finite only)."""
    reset_peak()
    so, par = big["so"], big["par"]
    names = tokens + ("h0",) + params
    x = {n: big["x"][n].detach().clone().requires_grad_(True) for n in names}
    try:
        out = run(x, so, par, x["h0"])
        grads = torch.autograd.grad(out, [x[n] for n in names], grad_out)
    except torch.OutOfMemoryError:
        msg = f"fused forward + backward of {big['T']} tokens does not fit: peak {peak_gib():.1f} GiB before the failure"
        print(f"\n{msg}")
        pytest.skip(msg)
    sync()
    print(f"\nbig row fwd+bwd peak {peak_gib():.1f} GiB")
    del out
    g = dict(zip(names, grads))
    for n in names:
        assert g[n] is not None and g[n].shape == x[n].shape, n
        assert all(torch.isfinite(g[n][i:i + 65536]).all() for i in range(0, g[n].shape[0], 65536)), f"d{n} not finite"

    lo, hi = so[4], so[7]
    r1 = {n: big["x"][n][lo:hi].detach().clone().requires_grad_(True) for n in tokens}
    r1.update({n: big["x"][n].detach().clone().requires_grad_(True) for n in params})
    r1["h0"] = big["x"]["h0"][1:2].detach().clone().requires_grad_(True)
    (_, so1, par1), _ = small_rows(so)
    out1 = run(r1, so1, par1, r1["h0"])
    chain = tokens + ("h0",)
    g1 = dict(zip(chain, torch.autograd.grad(out1, [r1[n] for n in chain], grad_out[lo:hi])))
    print("  P-chain gradient   big row vs alone (rel RMS, bitwise)")
    bad = {}
    for n in chain:
        got = g[n][1:2] if n == "h0" else g[n][lo:hi]
        e = rel_rms(got, g1[n])
        print(f"  d{n:5s}            {e:12.3e}  {torch.equal(got, g1[n])}")
        if not e <= tol:
            bad[n] = e
    assert not bad, f"P-chain gradients past 2^31 elements differ from the chain alone: {bad}"
