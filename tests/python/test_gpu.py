"""GPU tests (skipped without CUDA): the CUDA tree conv op against the CPU op in float64, and a
tiny Qwen3.5 in bf16 on a tree-packed row against its samples run alone (relative RMS error
<= 5e-3 for outputs, <= 2e-2 for gradients, SPEC.md's bf16 bar)."""

from __future__ import annotations

import importlib

import pytest
import torch

import tree_recurrence
from tree_recurrence import driver, plugins
from tree_recurrence.attention import register_tree_attention
from tree_recurrence.stand_ins import bind_stand_ins

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")

CONV = "gated_delta_net"


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt().clamp(min=1e-30)).item()


def random_tree_kwargs(generator: torch.Generator, segments: int, max_len: int, device) -> dict:
    lengths = torch.randint(1, max_len + 1, (segments,), generator=generator)
    parents = [-1] + [int(torch.randint(-1, s, (1,), generator=generator)) for s in range(1, segments)]
    offsets = torch.zeros(segments + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    return {"tree_cu_seqlens_q": offsets.to(device), "tree_segment_parents": torch.tensor(parents).to(device)}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("channels", [96, 98], ids=["vector", "scalar"])  # 98: not a multiple of the vector width
def test_cuda_tree_conv_matches_cpu(dtype, tol, width, channels):
    g = torch.Generator().manual_seed(width)
    kwargs = random_tree_kwargs(g, 300, 9, "cuda")
    plan = tree_recurrence.tree_plan(kwargs)
    n, c = plan.num_tokens, channels
    x = torch.randn(1, c, n, generator=g, dtype=torch.float64)
    w = torch.randn(c, width, generator=g, dtype=torch.float64)
    b = torch.randn(c, generator=g, dtype=torch.float64)
    gy = torch.randn(1, c, n, generator=g, dtype=torch.float64)
    results = {}
    for device, dt in (("cpu", torch.float64), ("cuda", dtype)):
        xs, ws, bs = (t.detach().to(device, dt).clone().requires_grad_() for t in (x, w, b))
        y = driver.tree_conv(CONV, xs, ws, bs, "silu", plan)
        y.backward(gy.to(device, dt))
        results[device] = [t.detach().cpu() for t in (y, xs.grad, ws.grad, bs.grad)]
    for got, want, name in zip(results["cuda"], results["cpu"], ("y", "grad_x", "grad_weight", "grad_bias")):
        assert rel_rms(got, want) <= tol, name


def tiny_qwen(dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "linear_attention", "full_attention"])
    return AutoModelForCausalLM.from_config(config, attn_implementation=register_tree_attention()).to("cuda", dtype)


def trl_row(generator):
    from trl.experimental.async_grpo.packing import TreeRow

    row = TreeRow()
    prompt = torch.randint(0, 256, (48,), generator=generator)
    for n in (1, 3, 17, 30):  # a 1-token completion and some shorter than the conv width
        ids = torch.cat([prompt, torch.randint(0, 256, (n,), generator=generator)])
        row.add({"input_ids": ids, "completion_mask": torch.ones_like(ids), "old_log_probs": torch.zeros(len(ids)),
                 "advantage": 1.0, "group_id": 0})
    return row.pack()


def test_fp32_qwen3_5_tree_equals_samples_alone_on_gpu():
    """The exactness check on the GPU: fp32 tree row (CUDA tree conv, scan forked/rescanned over
    the bound kernel) against the samples alone, logits and every gradient."""
    pytest.importorskip("trl")
    torch.manual_seed(0)
    model = tiny_qwen(torch.float32).train()
    modeling = importlib.import_module(type(model).__module__)
    restore = bind_stand_ins(modeling, seams=["torch_chunk_gated_delta_rule"])
    packed = trl_row(torch.Generator().manual_seed(1))
    kw = {k: packed[k].cuda() for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
    ids = packed["input_ids"].cuda()
    try:
        tree_recurrence.install(model)
        plan = tree_recurrence.tree_plan(kw)
        offsets = plan.array("path_offsets").tolist()
        paths = [plan.array("path_tokens")[a:b].cuda() for a, b in zip(offsets[:-1], offsets[1:])]
        weights = torch.randn(plan.max_path_length, 256, device="cuda")
        logits = model(input_ids=ids[None], position_ids=packed["position_ids"].cuda()[None], use_cache=False, **kw).logits[0]
        sum((logits[p] * weights[: len(p)]).sum() for p in paths).backward()
        tree_grads = {n: q.grad.clone() for n, q in model.named_parameters()}
        model.zero_grad()
        for p in paths:
            alone = model(input_ids=ids[p][None], use_cache=False).logits[0]
            assert (alone - logits[p]).abs().max().item() <= 1e-4 * max(1.0, alone.abs().max().item())
            (alone * weights[: len(p)]).sum().backward()
        for name, param in model.named_parameters():
            assert rel_rms(tree_grads[name], param.grad) <= 1e-4, name
    finally:
        tree_recurrence.uninstall(model)
        restore()


def test_bf16_qwen3_5_tree_matches_samples_alone():
    """bf16 tree row vs the samples run alone, both measured against the fp32 model run alone
    (FLA's way of judging bf16 kernels): the tree must meet SPEC.md's bar (5e-3 outputs, 2e-2
    gradients, relative RMS) or stay within the model's own bf16 noise on the samples. The A_log /
    dt_bias gradients of this tiny random model are sums of cancelling terms, so bf16 alone already
    misses them by 1-13% (CPU sweep over seeds, tests/python notes); across seeds the tree and the
    per-sample path each came out up to ~3.5x worse than the other, hence the 4x noise band."""
    pytest.importorskip("trl")
    torch.manual_seed(0)
    model = tiny_qwen(torch.float32).train()
    modeling = importlib.import_module(type(model).__module__)
    restore = bind_stand_ins(modeling, seams=["torch_chunk_gated_delta_rule"])  # fwd+bwd on any GPU
    packed = trl_row(torch.Generator().manual_seed(1))
    kw = {k: packed[k].cuda() for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
    ids = packed["input_ids"].cuda()
    try:
        support = tree_recurrence.install(model)
        assert support.mode == "tree"
        plan = tree_recurrence.tree_plan(kw)
        offsets = plan.array("path_offsets").tolist()
        paths = [plan.array("path_tokens")[a:b].cuda() for a, b in zip(offsets[:-1], offsets[1:])]
        weights = torch.randn(plan.max_path_length, 256, device="cuda")

        def alone(m):
            outs = []
            for p in paths:
                out = m(input_ids=ids[p][None], use_cache=False).logits[0]
                (out.float() * weights[: len(p)]).sum().backward()
                outs.append(out.detach().float())
            grads = {n: q.grad.float().clone() for n, q in m.named_parameters()}
            m.zero_grad()
            return outs, grads

        ref_logits, ref_grads = alone(model)  # fp32, samples alone
        model.to(torch.bfloat16)
        bf16_logits, bf16_grads = alone(model)
        logits = model(input_ids=ids[None], position_ids=packed["position_ids"].cuda()[None], use_cache=False, **kw).logits[0]
        assert ("gated_delta_net", "causal_conv1d_fn", "native", "native tree conv") in driver.decisions
        sum((logits[p].float() * weights[: len(p)]).sum() for p in paths).backward()
        tree_err = max(rel_rms(logits[p], r) for p, r in zip(paths, ref_logits))
        alone_err = max(rel_rms(b, r) for b, r in zip(bf16_logits, ref_logits))
        print(f"logits rel RMS vs fp32 alone: tree {tree_err:.2e}, bf16 alone {alone_err:.2e}")
        assert tree_err <= max(5e-3, 1.5 * alone_err)
        for name, param in model.named_parameters():
            tree_g, alone_g = rel_rms(param.grad, ref_grads[name]), rel_rms(bf16_grads[name], ref_grads[name])
            assert tree_g <= max(2e-2, 4 * alone_g), (name, tree_g, alone_g)
    finally:
        tree_recurrence.uninstall(model)
        restore()


def test_fla_forward_tree_matches_samples_alone():
    """With FLA bound by transformers (installed on the device), the GDN core forks over FLA's
    varlen kernel; forward only (FLA's backward refuses Hopper with Triton < 3.7.1)."""
    pytest.importorskip("fla")
    pytest.importorskip("trl")
    torch.manual_seed(0)
    model = tiny_qwen(torch.bfloat16).eval()
    modeling = importlib.import_module(type(model).__module__)
    assert driver.bound_implementation(modeling.torch_chunk_gated_delta_rule)[2], "FLA is importable but not bound"
    tree_recurrence.install(model, policy=tree_recurrence.Policy(fork_min_saved_tokens=0), backends={"gated_delta_net": "kernel"})
    try:
        packed = trl_row(torch.Generator().manual_seed(2))
        kw = {k: packed[k].cuda() for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
        plan = tree_recurrence.tree_plan(kw)
        ids = packed["input_ids"].cuda()
        with torch.no_grad():
            logits = model(input_ids=ids[None], position_ids=packed["position_ids"].cuda()[None], use_cache=False, **kw).logits[0]
            assert driver.decisions[-1][2] == "fork"
            offsets = plan.array("path_offsets").tolist()
            for a, b in zip(offsets[:-1], offsets[1:]):
                p = plan.array("path_tokens")[a:b].cuda()
                assert rel_rms(logits[p], model(input_ids=ids[p][None], use_cache=False).logits[0]) <= 5e-3
    finally:
        tree_recurrence.uninstall(model)


@pytest.mark.parametrize("window", [None, 40])
def test_tree_flex_kernel_matches_tree_sdpa_on_gpu(window):
    """tree_flex's compiled FlexAttention kernel (forward and backward, fp32 so that a mask error
    cannot hide in rounding, 16 query heads on 4 KV heads of 128, a row over several 128-token
    blocks) against the dense-mask reference tree_sdpa.

    (fp32, not bf16: bf16 gradients against an fp32-compute reference at 2e-2 are too tight a bound
    to tell a mask error from rounding.)"""
    from tree_recurrence import attention as A

    g = torch.Generator().manual_seed(3)
    kwargs = random_tree_kwargs(g, 120, 9, "cuda")
    plan = tree_recurrence.tree_plan(kwargs)
    n = plan.num_tokens
    if window is not None:
        kwargs["sliding_window"] = window
    base = [torch.randn(1, h, n, 128, generator=g) for h in (16, 4, 4)]
    gy = torch.randn(1, n, 16, 128, generator=g).cuda()
    results = {}
    for fn in (A.tree_flex_attention, A.tree_sdpa_attention):
        q, k, v = (t.cuda().requires_grad_() for t in base)
        out, _ = fn(torch.nn.Module().train(), q, k, v, None, **kwargs)
        out.backward(gy)
        results[fn.__name__] = [out.detach(), q.grad, k.grad, v.grad]
    for got, want, name in zip(results["tree_flex_attention"], results["tree_sdpa_attention"], ("out", "dq", "dk", "dv")):
        assert rel_rms(got, want) <= 1e-3, f"{name}: relative RMS error {rel_rms(got, want):.2e}"


def _capture(fn):
    """Warms ``fn`` up on a side stream (plans, routes and device tables are built there), captures one
    call in a CUDA graph and returns (graph, its static output). A host sync or a device-to-host copy
    inside a seam call makes the capture raise."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@torch.no_grad()
def test_native_seam_calls_capture_in_a_cuda_graph():
    """The native-op convention: with a fixed plan, the tree conv and the GDN native scan take the plan's
    device tensors and do no host work on the device: a CUDA graph captures them, and its replay on new
    inputs equals an eager call."""
    from tree_recurrence import components

    if not plugins.has_kernel(plugins.families()[CONV], "gdn_tree_scan", torch.device("cuda")):
        pytest.skip("this build has no CUDA gdn_tree_scan")
    g = torch.Generator().manual_seed(3)
    kwargs = random_tree_kwargs(g, 40, 20, "cuda")
    plan = tree_recurrence.tree_plan(kwargs)
    n = plan.num_tokens
    x = torch.randn(1, 64, n, generator=g).cuda()
    w = torch.randn(64, 4, generator=g).cuda()
    q, k = (torch.randn(1, n, 2, 32, generator=g).cuda() for _ in range(2))
    v = torch.randn(1, n, 4, 32, generator=g).cuda()
    decay, beta = (-torch.rand(1, n, 4, generator=g)).cuda(), torch.rand(1, n, 4, generator=g).cuda()

    def step():
        y = components.tree_conv(x, w, None, "silu", plan=plan)
        o = components.scan(CONV, "torch_chunk_gated_delta_rule", q, k, v, decay, beta, plan=plan,
                            use_qk_l2norm_in_kernel=True, backend="native")
        return y, o

    graph, (y_graph, o_graph) = _capture(step)
    for t in (x, q, k, v, decay, beta):  # new inputs, same plan
        t.copy_(torch.randn_like(t) if t is not decay else -torch.rand_like(t))
    graph.replay()
    torch.cuda.synchronize()
    y_eager, o_eager = step()
    assert rel_rms(y_graph, y_eager) <= 1e-6 and rel_rms(o_graph, o_eager) <= 1e-6


@torch.no_grad()
def test_tree_forward_with_a_fixed_plan_captures_in_a_cuda_graph():
    """A whole tiny Qwen3.5 forward on a tree-packed row (native seams), captured in a CUDA graph once its
    plan exists: the replay on new token ids equals the eager forward."""
    if not plugins.has_kernel(plugins.families()[CONV], "gdn_tree_scan", torch.device("cuda")):
        pytest.skip("this build has no CUDA gdn_tree_scan")
    torch.manual_seed(0)
    model = tiny_qwen(torch.float32).eval()
    gen = torch.Generator().manual_seed(4)
    kwargs = random_tree_kwargs(gen, 12, 16, "cuda")
    n = int(kwargs["tree_cu_seqlens_q"][-1])
    ids = torch.randint(0, 256, (1, n), generator=gen).cuda()
    tree_recurrence.install(model, policy=tree_recurrence.Policy(strategy="native"))
    try:
        forward = lambda: model(input_ids=ids, use_cache=False, **kwargs).logits  # noqa: E731
        graph, logits_graph = _capture(forward)
        ids.copy_(torch.randint(0, 256, (1, n), generator=gen).cuda())
        graph.replay()
        torch.cuda.synchronize()
        assert rel_rms(logits_graph, forward()) <= 1e-5
    finally:
        tree_recurrence.uninstall(model)
