"""Checks of the library stand-ins (tree_recurrence.stand_ins' generic causal conv and the
gated_delta_net family's chunk_gated_delta_rule, plugins/gated_delta_net/python/stand_ins.py).

They must agree with transformers' own torch fallbacks (the code path every CPU run takes) and,
for packed inputs (cu_seqlens / seq_idx), with running each sequence on its own, gradients
included.
"""

import types

import pytest
import torch
import torch.nn.functional as F

from tree_recurrence import stand_ins as _generic

# The generic conv and the family's stand-in, as the engine finds them (the family's manifest names it).
ref = types.SimpleNamespace(causal_conv1d_fn=_generic.causal_conv1d_fn,
                            chunk_gated_delta_rule=_generic.family_stand_ins("gated_delta_net").chunk_gated_delta_rule)

qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
# The module-level names are seam wrappers (functools.wraps keeps the torch function in
# __wrapped__); call the torch reference directly so an installed fla/causal-conv1d cannot
# change what we compare against.
hf_chunk_gdr = qwen.torch_chunk_gated_delta_rule.__wrapped__
hf_recurrent_gdr = qwen.torch_recurrent_gated_delta_rule.__wrapped__
hf_conv = qwen.causal_conv1d_fn.__wrapped__

ATOL = 1e-5


def _gdn_inputs(B, T, H, HV, K, V, seed=0, dtype=torch.float32, normalise_k=False):
    g_ = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g_)
    k = torch.randn(B, T, H, K, generator=g_)
    if normalise_k:
        k = F.normalize(k, dim=-1)
    v = torch.randn(B, T, HV, V, generator=g_)
    g = F.logsigmoid(torch.randn(B, T, HV, generator=g_) + 2.0)
    beta = torch.rand(B, T, HV, generator=g_)
    h0 = torch.randn(B, HV, K, V, generator=g_) * 0.5
    return [x.to(dtype) for x in (q, k, v, g, beta)] + [h0]


def _maxerr(a, b):
    return (a.float() - b.float()).abs().max().item()


# ------------------------------------------------------------------ gated delta rule


@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("T", [1, 37, 130])
def test_gdr_matches_transformers_torch_chunk(l2norm, with_h0, T):
    q, k, v, g, beta, h0 = _gdn_inputs(3, T, 4, 4, 16, 8, seed=T, normalise_k=not l2norm)
    init = h0 if with_h0 else None
    o_hf, s_hf = hf_chunk_gdr(
        q, k, v, g=g, beta=beta, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=l2norm
    )
    o, s = ref.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=l2norm
    )
    assert o.shape == o_hf.shape and s.shape == s_hf.shape
    assert _maxerr(o, o_hf) < ATOL
    assert _maxerr(s, s_hf) < ATOL
    # and the token-by-token transformers reference
    o_r, s_r = hf_recurrent_gdr(
        q, k, v, g=g, beta=beta, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=l2norm
    )
    assert _maxerr(o, o_r) < ATOL and _maxerr(s, s_r) < ATOL


def test_gdr_no_final_state_and_dtypes():
    q, k, v, g, beta, h0 = _gdn_inputs(2, 9, 2, 2, 8, 8, dtype=torch.bfloat16)
    o, s = ref.chunk_gated_delta_rule(q, k, v, g.float(), beta, use_qk_l2norm_in_kernel=True)
    assert s is None and o.dtype == torch.bfloat16 and o.shape == (2, 9, 2, 8)
    o, s = ref.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0.bfloat16(), output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert s.dtype == torch.float32 and s.shape == (2, 2, 8, 8)


def test_gdr_grouped_value_heads_equal_repeated_qk():
    q, k, v, g, beta, _ = _gdn_inputs(2, 20, 2, 6, 8, 4, seed=3)
    o, s = ref.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    qr, kr = (x.repeat_interleave(3, dim=2) for x in (q, k))
    o2, s2 = ref.chunk_gated_delta_rule(qr, kr, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert _maxerr(o, o2) < ATOL and _maxerr(s, s2) < ATOL
    o3, s3 = hf_chunk_gdr(qr, kr, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert _maxerr(o, o3) < ATOL and _maxerr(s, s3) < ATOL


def test_gdr_scale_and_gate_in_kernel_and_state_v_first():
    q, k, v, g, beta, h0 = _gdn_inputs(1, 11, 2, 2, 8, 4, seed=5)
    o1, _ = ref.chunk_gated_delta_rule(q, k, v, g, beta, scale=0.3, use_qk_l2norm_in_kernel=True)
    # scale multiplies the output linearly
    o_half, _ = ref.chunk_gated_delta_rule(q, k, v, g, beta, scale=0.15, use_qk_l2norm_in_kernel=True)
    assert _maxerr(o1, 2 * o_half) < ATOL
    # use_gate_in_kernel: g raw, A_log, dt_bias
    raw = torch.randn(1, 11, 2)
    A_log = torch.randn(2)
    dt_bias = torch.randn(2)
    gate = -A_log.exp() * F.softplus(raw + dt_bias)
    a, _ = ref.chunk_gated_delta_rule(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True)
    b, _ = ref.chunk_gated_delta_rule(
        q, k, v, raw, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias
    )
    assert _maxerr(a, b) < ATOL
    # state_v_first: states transposed
    _, s = ref.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    _, s_t = ref.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0.transpose(-1, -2), output_final_state=True, state_v_first=True
    )
    assert _maxerr(s, s_t.transpose(-1, -2)) < ATOL


def _packed(lengths, H, HV, K, V, seed):
    q, k, v, g, beta, _ = _gdn_inputs(1, sum(lengths), H, HV, K, V, seed=seed)
    h0 = torch.randn(len(lengths), HV, K, V, generator=torch.Generator().manual_seed(seed + 1)) * 0.5
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.long)
    return q, k, v, g, beta, h0, cu


@pytest.mark.parametrize("with_h0", [False, True])
def test_gdr_cu_seqlens_equals_separate_runs_with_grads(with_h0):
    lengths = [5, 1, 17, 9]
    q, k, v, g, beta, h0, cu = _packed(lengths, 2, 4, 8, 4, seed=11)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    q, k, v, g, beta, h0 = leaves
    init = h0 if with_h0 else None
    o, s = ref.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu
    )
    assert o.shape == v.shape and s.shape == (4, 4, 8, 4)

    outs, finals = [], []
    for n in range(len(lengths)):
        a, b = int(cu[n]), int(cu[n + 1])
        o_n, s_n = ref.chunk_gated_delta_rule(
            q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
            initial_state=h0[n : n + 1] if with_h0 else None,
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )
        # and against transformers' own reference on the same sequence
        o_hf, s_hf = hf_chunk_gdr(
            q[:, a:b].repeat_interleave(2, dim=2), k[:, a:b].repeat_interleave(2, dim=2), v[:, a:b],
            g=g[:, a:b], beta=beta[:, a:b], initial_state=h0[n : n + 1] if with_h0 else None,
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )
        assert _maxerr(o_n, o_hf) < ATOL and _maxerr(s_n, s_hf) < ATOL
        outs.append(o_n)
        finals.append(s_n)
    o_sep, s_sep = torch.cat(outs, dim=1), torch.cat(finals, dim=0)
    assert _maxerr(o, o_sep) < ATOL and _maxerr(s, s_sep) < ATOL

    gen = torch.Generator().manual_seed(99)
    do, ds = torch.randn(o.shape, generator=gen), torch.randn(s.shape, generator=gen)
    inputs = [q, k, v, g, beta] + ([h0] if with_h0 else [])
    grads = torch.autograd.grad((o * do).sum() + (s * ds).sum(), inputs)
    grads_sep = torch.autograd.grad((o_sep * do).sum() + (s_sep * ds).sum(), inputs)
    for a, b in zip(grads, grads_sep):
        assert _maxerr(a, b) < ATOL


def test_gdr_grads_match_transformers_reference():
    q, k, v, g, beta, h0 = _gdn_inputs(2, 70, 2, 2, 8, 8, seed=21)
    inputs = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o, s = ref.chunk_gated_delta_rule(*inputs[:5], initial_state=inputs[5], output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
    o2, s2 = hf_chunk_gdr(*inputs[:3], g=inputs[3], beta=inputs[4], initial_state=inputs[5],
                          output_final_state=True, use_qk_l2norm_in_kernel=True)
    do, ds = torch.randn_like(o), torch.randn_like(s)
    ga = torch.autograd.grad((o * do).sum() + (s * ds).sum(), inputs)
    gb = torch.autograd.grad((o2 * do).sum() + (s2 * ds).sum(), inputs)
    for a, b in zip(ga, gb):
        assert _maxerr(a, b) < 1e-4 * max(1.0, b.abs().max().item())


def test_gdr_api_errors():
    q, k, v, g, beta, h0, cu = _packed([3, 4], 2, 2, 8, 4, seed=1)
    with pytest.raises(ValueError):  # batch must be 1 with cu_seqlens
        ref.chunk_gated_delta_rule(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
                                   g.expand(2, -1, -1), beta.expand(2, -1, -1), cu_seqlens=cu)
    with pytest.raises(ValueError):  # one initial state per sequence
        ref.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0[:1], cu_seqlens=cu)
    with pytest.raises(ValueError):  # HV % H != 0
        ref.chunk_gated_delta_rule(q, k, v[:, :, :1].expand(-1, -1, 3, -1), g[..., :1].expand(-1, -1, 3),
                                   beta[..., :1].expand(-1, -1, 3))
    with pytest.raises(ValueError):
        ref.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=128)


# ------------------------------------------------------------------ causal conv1d


def _conv_inputs(B, D, L, W, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, D, L, generator=gen)
    w = torch.randn(D, W, generator=gen)
    b = torch.randn(D, generator=gen) if bias else None
    return x, w, b


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("activation", [None, "silu", "swish"])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_matches_transformers_fallback(W, activation, bias):
    x, w, b = _conv_inputs(3, 12, 19, W, seed=W, bias=bias)
    out = ref.causal_conv1d_fn(x, w, b, activation=activation)
    hf_act = None if activation is None else "silu"
    assert _maxerr(out, hf_conv(x, w, b, activation=hf_act)) < ATOL
    # the mixer's nn.Conv1d module (padding W-1, trimmed) + SiLU
    conv = torch.nn.Conv1d(12, 12, W, groups=12, padding=W - 1, bias=bias)
    with torch.no_grad():
        conv.weight.copy_(w.unsqueeze(1))
        if bias:
            conv.bias.copy_(b)
    y = conv(x)[..., :19]
    if activation is not None:
        y = F.silu(y)
    assert _maxerr(out, y) < ATOL


def test_conv_mixer_call_and_dtype():
    # The GDN mixer's call: causal_conv1d_fn(x, conv1d.weight.squeeze(1), conv1d.bias, activation="silu")
    x, w, _ = _conv_inputs(2, 8, 7, 4)
    out = ref.causal_conv1d_fn(x.bfloat16(), w, None, activation="silu")
    assert out.dtype == torch.bfloat16
    assert _maxerr(out, hf_conv(x.bfloat16(), w, None, activation="silu")) < 1e-2
    with pytest.raises(NotImplementedError):
        ref.causal_conv1d_fn(x, w, activation="gelu")


@pytest.mark.parametrize("L", [1, 2, 10])
def test_conv_initial_and_final_states(L):
    W = 4
    x, w, b = _conv_inputs(2, 6, L, W, seed=L)
    init = torch.randn(2, 6, W - 1)
    out, fin = ref.causal_conv1d_fn(x, w, b, initial_states=init, return_final_states=True, activation="silu")
    full = ref.causal_conv1d_fn(torch.cat([init, x], -1), w, b, activation="silu")[..., W - 1 :]
    assert _maxerr(out, full) < ATOL
    assert _maxerr(fin, torch.cat([init, x], -1)[..., -(W - 1) :]) < ATOL
    # no initial states: final states are left-padded with zeros
    _, fin0 = ref.causal_conv1d_fn(x, w, b, return_final_states=True)
    assert _maxerr(fin0, F.pad(x, (W - 1, 0))[..., -(W - 1) :]) < ATOL
    buf = torch.empty(2, 6, W - 1)
    _, fin2 = ref.causal_conv1d_fn(x, w, b, initial_states=init, return_final_states=True, final_states_out=buf)
    assert fin2 is buf and _maxerr(buf, fin) < ATOL
    # chaining two halves with the states equals one pass
    if L > 1:
        h = L // 2
        o1, s1 = ref.causal_conv1d_fn(x[..., :h], w, b, return_final_states=True)
        o2 = ref.causal_conv1d_fn(x[..., h:], w, b, initial_states=s1)
        assert _maxerr(torch.cat([o1, o2], -1), ref.causal_conv1d_fn(x, w, b)) < ATOL


def test_conv_seq_idx_equals_separate_runs_with_grads():
    W = 4
    lengths = [[3, 1, 8, 4], [16]]
    x, w, b = _conv_inputs(2, 5, 16, W, seed=7)
    seq_idx = torch.tensor(
        [sum(([i] * n for i, n in enumerate(row)), []) for row in lengths], dtype=torch.int32
    )
    x, w, b = (t.clone().requires_grad_(True) for t in (x, w, b))
    out = ref.causal_conv1d_fn(x, w, b, seq_idx=seq_idx, activation="silu")
    pieces = []
    for r, row in enumerate(lengths):
        s = 0
        row_out = []
        for n in row:
            row_out.append(ref.causal_conv1d_fn(x[r : r + 1, :, s : s + n], w, b, activation="silu"))
            s += n
        pieces.append(torch.cat(row_out, -1))
    sep = torch.cat(pieces, 0)
    assert _maxerr(out, sep) < ATOL
    # also against transformers' fallback per sequence
    assert _maxerr(sep[:, :, :3], hf_conv(x[:, :, :3], w, b, activation="silu")) < ATOL
    dout = torch.randn_like(out)
    ga = torch.autograd.grad((out * dout).sum(), (x, w, b))
    gb = torch.autograd.grad((sep * dout).sum(), (x, w, b))
    for a, c in zip(ga, gb):
        assert _maxerr(a, c) < ATOL


def test_conv_seq_idx_padding_and_api_errors():
    x, w, b = _conv_inputs(1, 4, 6, 3)
    seq_idx = torch.tensor([[0, 0, 0, -1, -1, -1]], dtype=torch.int32)
    out = ref.causal_conv1d_fn(x, w, b, seq_idx=seq_idx, activation="silu")
    assert torch.all(out[..., 3:] == 0)
    assert _maxerr(out[..., :3], ref.causal_conv1d_fn(x[..., :3], w, b, activation="silu")) < ATOL
    with pytest.raises(AssertionError):
        ref.causal_conv1d_fn(x, w, b, seq_idx=seq_idx, initial_states=torch.zeros(1, 4, 2))
    with pytest.raises(AssertionError):
        ref.causal_conv1d_fn(x, w, b, seq_idx=seq_idx, return_final_states=True)
    with pytest.raises(TypeError):
        ref.causal_conv1d_fn(x, w, b, seq_idx=seq_idx.long())
    with pytest.raises(RuntimeError):  # the CUDA kernel supports widths 2..4 only
        ref.causal_conv1d_fn(x, torch.randn(4, 5), b)


def test_conv_initial_states_gradient():
    W = 3
    x, w, b = _conv_inputs(2, 4, 5, W, seed=2)
    init = torch.randn(2, 4, W - 1, requires_grad=True)
    x.requires_grad_(True)
    out = ref.causal_conv1d_fn(x, w, b, initial_states=init, activation="silu")
    full = ref.causal_conv1d_fn(torch.cat([init, x], -1), w, b, activation="silu")[..., W - 1 :]
    d = torch.randn_like(out)
    ga = torch.autograd.grad((out * d).sum(), (x, init))
    gb = torch.autograd.grad((full * d).sum(), (x, init))
    for a, c in zip(ga, gb):
        assert _maxerr(a, c) < ATOL
