"""Mamba2-family models on tree-packed rows, against every sample run alone.

For tiny real transformers models of every Mamba2-family type (mamba2, nemotron_h, bamba,
granitemoehybrid, falcon_h1, zamba2), TRL's packer folds a forest of samples into one row; the row
is forwarded once with the tree kwargs, and every token of every sample must get the logits it
gets when the sample runs alone, and the gradient of every parameter (A_log, dt_bias, D, conv1d
weight and bias included) must equal the sum of the samples' gradients. Each strategy runs
separately (the native tree SSD scan + tree conv; rescan over transformers' torch reference;
rescan over tree_recurrence.stand_ins' mamba-ssm / causal-conv1d stand-ins bound the way
transformers binds the libraries), with gradient checkpointing on and off.

Also here: the oracle op (ssd_token_scan) against transformers' torch ``mamba2_chunk_scan`` (the semantics it
implements), the mamba-ssm reference functions, the fused seam's decline, install()'s answer for
every model type, and proof that the comparison fails on an unpatched model.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import family_harness as H
import models as M
import tree_recurrence as tr
from tree_recurrence import driver, plugins, stand_ins

CONV, SCAN, FUSED = "causal_conv1d_fn", "mamba2_chunk_scan", "mamba2_split_conv1d_scan_combined"

_B = dict(vocab_size=M.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
# docs/transformers-seams.md section 5; chunk size 8, so rows cross chunk boundaries.
MAMBA2 = H.Family(
    "mamba2",
    configs={
        "mamba2": dict(vocab_size=M.VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32, expand=2,
                       state_size=16, n_groups=2, chunk_size=8),
        "nemotron_h": dict(vocab_size=M.VOCAB, hidden_size=64, intermediate_size=128,
                           layers_block_type=["linear_attention", "full_attention", "mlp"], num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=16,
                           n_groups=2, chunk_size=8),
        "bamba": dict(**_B, num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4,
                      mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8),
        "granitemoehybrid": dict(**_B, num_attention_heads=4, num_key_value_heads=2,
                                 layer_types=["linear_attention", "full_attention"], num_local_experts=4,
                                 num_experts_per_tok=2, shared_intermediate_size=64, mamba_n_heads=4, mamba_d_head=32,
                                 mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8),
        "falcon_h1": dict(**_B, num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_d_ssm=128,
                          mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8),
        "zamba2": dict(**_B, layers_block_type=["linear_attention", "hybrid"], num_attention_heads=4,
                       num_key_value_heads=4, n_mamba_heads=4, mamba_d_state=16, mamba_ngroups=2, chunk_size=8,
                       adapter_rank=8),
    },
    mixers={"mamba2": "Mamba2Mixer", "nemotron_h": "NemotronHMamba2Mixer", "bamba": "BambaMixer",
            "granitemoehybrid": "GraniteMoeHybridMambaLayer", "falcon_h1": "FalconH1Mixer", "zamba2": "Zamba2MambaMixer"},
    # Mamba2ForCausalLM drops **kwargs on the way to its backbone: the manifest's plan carrier
    carriers={"mamba2": ("Mamba2ForCausalLM",)},
    seams=(CONV, SCAN, FUSED),
    # A_log, dt_bias, D and the conv bias re-drawn so every head differs and every parameter matters
    redraw=H.SSM_REDRAW + (((".D",), 0.5, 1.5), (("conv1d.bias",), -0.3, 0.3)),
    no_attention=frozenset({"mamba2"}))  # transformers refuses an attention implementation for it
FAMILY, MODEL_TYPES = MAMBA2.name, MAMBA2.model_types
MODULES = {t: MAMBA2.module_name(t) for t in MODEL_TYPES}
make_model, alone_reference, _module = MAMBA2.make_model, MAMBA2.alone, MAMBA2.module
# The config key of the SSM group count (the mixers' n_groups).
GROUPS_KEY = {"mamba2": "n_groups", "nemotron_h": "n_groups", "bamba": "mamba_n_groups",
              "granitemoehybrid": "mamba_n_groups", "falcon_h1": "mamba_n_groups", "zamba2": "mamba_ngroups"}


def mixer_paths(model, model_type) -> list[str]:
    return MAMBA2.mixer_paths(model, model_type)


def ssm_parameter_names(model) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.endswith(("A_log", "dt_bias", ".D", "conv1d.weight", "conv1d.bias"))]


# (strategy, binding): native = the family's tree kernels (backend auto); rescan = every path as a
# row of a padded batch through whatever transformers bound (backend kernel): its torch reference,
# or the mamba-ssm + causal-conv1d stand-ins (seams of the split path; the fused seam is tested on
# its own below).
BINDINGS = {"torch": None, "mamba_ssm": [CONV, SCAN], "mamba_ssm+fused": [CONV, SCAN, FUSED]}
CASES = [pytest.param("native", "torch", id="native"),
         pytest.param("rescan", "torch", id="rescan-torch"),
         pytest.param("rescan", "mamba_ssm", id="rescan-mamba_ssm")]


def check_tree_run(model_type, forest, strategy, binding, env, decisions, checkpointing=False, overrides=None,
                   fmt="trl"):
    bind = (lambda: env.bind(_module(model_type), BINDINGS[binding])) if BINDINGS[binding] else None
    run = H.run_case(MAMBA2, model_type, forest, strategy, install=env.install, alone=alone_reference,
                     decisions=decisions, bind=bind, checkpointing=checkpointing, overrides=overrides, fmt=fmt,
                     what=f"{model_type}/{forest}/{strategy}/{binding}/ckpt={checkpointing}")
    implementation, _, is_library = driver.bound_implementation(run.bound[SCAN])
    assert is_library == (binding != "torch")
    if is_library:
        assert implementation is stand_ins.mamba_chunk_scan_combined
    for name in ssm_parameter_names(run.model):
        assert float(run.alone.grads[name].abs().max()) > 0, f"{name}: no gradient reaches it"
    assert any(n.endswith(".D") for n in ssm_parameter_names(run.model))

    # every mixer declined the fused seam and ran conv + scan with the intended strategy, once per
    # forward (again in every checkpoint replay)
    got = run.decided
    runs = got.count((FUSED, "decline"))
    assert runs >= len(run.layers) and (runs > len(run.layers)) == checkpointing, got
    conv = "native" if strategy == "native" else "rescan"
    assert sorted(got) == sorted([(FUSED, "decline")] * runs + [(CONV, conv)] * runs + [(SCAN, strategy)] * runs), got


# ------------------------------------------------------------------------------------------------
# every model type x every strategy, one mixed forest, checkpointing on and off
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
@pytest.mark.parametrize("strategy,binding", CASES)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_model_strategy(model_type, strategy, binding, checkpointing, env, decisions):
    check_tree_run(model_type, "mixed", strategy, binding, env, decisions, checkpointing=checkpointing)


# ------------------------------------------------------------------------------------------------
# every forest shape, on mamba2 (whose CausalLM head drops the kwargs) and nemotron_h
# ------------------------------------------------------------------------------------------------

SHAPE_CASES = [pytest.param("native", "torch", False, "trl", id="native"),
               pytest.param("native", "torch", True, "rich", id="native-ckpt-rich"),
               pytest.param("rescan", "torch", True, "trl", id="rescan-torch-ckpt"),
               pytest.param("rescan", "mamba_ssm", False, "minimal", id="rescan-mamba_ssm-minimal")]


@pytest.mark.parametrize("strategy,binding,checkpointing,fmt", SHAPE_CASES)
@pytest.mark.parametrize("forest", [f for f in M.FOREST_NAMES if f != "mixed"])
@pytest.mark.parametrize("model_type", ["mamba2", "nemotron_h"])
def test_forest_shapes(model_type, forest, strategy, binding, checkpointing, fmt, env, decisions):
    check_tree_run(model_type, forest, strategy, binding, env, decisions, checkpointing=checkpointing, fmt=fmt)


def test_fork_is_native_only(env):
    """The bound kernels take initial states per batch row only and padding cannot leave an SSD
    state alone, so forcing fork over them is refused with a clear error (the native op forks)."""
    tree = M.pack_forest("fan")
    model = make_model("mamba2")
    env.install(model, policy=tr.Policy(strategy="fork"), backends={FAMILY: "kernel"})
    with pytest.raises(ValueError, match="fork"):
        model(input_ids=tree.input_ids, use_cache=False, **tree.trl_kwargs())


# ------------------------------------------------------------------------------------------------
# the fused seam: declined with a tree, the original without one
# ------------------------------------------------------------------------------------------------


class _Spy:
    def __init__(self, fn):
        import functools

        self.calls = 0

        @functools.wraps(fn)
        def spy(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)

        self.fn = spy


@pytest.mark.parametrize("model_type", ["mamba2", "zamba2"])
def test_fused_seam_rescanned_with_tree_original_without(model_type, env, decisions, monkeypatch):
    """With mamba-ssm's fused kernel bound and backend 'kernel': a tree row runs it over every path
    (a padded batch; the split seams not at all); an ordinary batch calls it as it is."""
    fused = _Spy(stand_ins.mamba_split_conv1d_scan_combined)
    scan = _Spy(stand_ins.mamba_chunk_scan_combined)
    monkeypatch.setattr(stand_ins.family_stand_ins(FAMILY), "mamba_split_conv1d_scan_combined", fused.fn)
    monkeypatch.setattr(stand_ins.family_stand_ins(FAMILY), "mamba_chunk_scan_combined", scan.fn)
    env.bind(_module(model_type), [CONV, SCAN, FUSED])
    _, params, is_library = driver.bound_implementation(getattr(_module(model_type), FUSED))
    assert is_library and "seq_idx" in params
    model = make_model(model_type)
    env.install(model, policy=tr.Policy(strategy="rescan"), backends={FAMILY: "kernel"})
    layers = len(mixer_paths(model, model_type))

    ids = torch.randint(2, M.VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    decisions.clear()
    model(input_ids=ids, use_cache=False).logits.sum().backward()
    # the fused stand-in ran in every layer (it calls the scan stand-in inside), no hook decided
    assert fused.calls == layers and scan.calls == layers and not decisions

    tree = M.pack_forest("fan")
    decisions.clear()
    model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False, **tree.trl_kwargs())
    assert fused.calls == 2 * layers and scan.calls == 2 * layers  # the fused stand-in once more per layer
    assert [(d[1], d[2]) for d in decisions] == [(FUSED, "rescan")] * layers


@pytest.mark.parametrize("backend,strategy", [("auto", "native"), ("kernel", "rescan")])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fused_seam_follows_the_tree(model_type, backend, strategy, env, decisions):
    """All three library seams bound (conv, scan, fused: the mamba-ssm / causal-conv1d stand-ins).
    Samples alone take the fused kernel; the tree row runs the same fused semantics over the trie
    (plugins/mamba2/python/adapters.py: tree conv, chunked SSD tree scan, the fused path's own gated
    RMSNorm per group, out_proj), or with backend 'kernel' the bound fused kernel over every path;
    logits and every gradient equal. n_groups is 2, where the split path's norm (over all channels)
    differs from the fused one (next test): declining would fail."""
    tree = M.pack_forest("mixed")
    env.bind(_module(model_type), [CONV, SCAN, FUSED])
    model = make_model(model_type)
    assert model.config.to_dict()[GROUPS_KEY[model_type]] == 2
    alone = M.run_alone(model, tree.samples, M.loss_weights(tree.samples))  # fused, every sample
    env.install(model, policy=tr.Policy(strategy=strategy), backends={FAMILY: backend})
    decisions.clear()
    M.assert_matches(M.run_tree(model, tree, M.loss_weights(tree.samples), tree.trl_kwargs()), alone, model,
                     what=f"{model_type} fused on the tree ({backend})")
    got = [(d[1], d[2]) for d in decisions if d[0] == FAMILY]
    assert got == [(FUSED, strategy)] * len(mixer_paths(model, model_type)), got


@pytest.mark.parametrize("model_type", ["mamba2", "bamba", "granitemoehybrid"])
def test_transformers_fused_and_split_paths_differ_with_groups(model_type, env):
    """Not a tree matter, a transformers one that trees expose: with n_groups > 1 these mixers'
    split path normalises the gated output over all channels (``*RMSNormGated``), while mamba-ssm's
    fused kernel normalises per group (group_size = dim // ngroups, as mamba-ssm's Mamba2 does).
    Declining the fused kernel on a tree row therefore equals transformers' split path (what it
    computes without mamba-ssm, in eval and with a cache), not its fused training path. An
    ordinary batch shows the gap; with n_groups == 1 it closes."""
    ids = torch.randint(2, M.VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    for groups, differs in ((2, True), (1, False)):
        model = make_model(model_type, **{GROUPS_KEY[model_type]: groups})
        split = model(input_ids=ids, use_cache=False).logits
        restore = stand_ins.bind_stand_ins(_module(model_type), seams=[CONV, SCAN, FUSED])
        try:
            fused = model(input_ids=ids, use_cache=False).logits
        finally:
            restore()
        err = float((split - fused).detach().abs().max())
        assert (err > 1e-4) == differs, (groups, err)


# ------------------------------------------------------------------------------------------------
# install(): every model type answers "tree", with the right layers
# ------------------------------------------------------------------------------------------------


def test_install_answers_tree_for_every_layer_type(env):
    expected_types = {
        "mamba2": {"linear_attention"}, "nemotron_h": {"linear_attention", "full_attention", "mlp", "moe"},
        "bamba": {"linear_attention", "full_attention"}, "granitemoehybrid": {"linear_attention", "full_attention"},
        "falcon_h1": {"hybrid"}, "zamba2": {"linear_attention", "hybrid"},
    }
    extra = {"nemotron_h": dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
                                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                moe_shared_expert_intermediate_size=32, n_group=1, topk_group=1)}
    for model_type in MODEL_TYPES:
        model = make_model(model_type, **extra.get(model_type, {}))
        config = model.config
        assert config.model_type == model_type
        from tree_recurrence.install import _layer_types

        assert set(_layer_types(config)) == expected_types[model_type]
        support = env.install(model)
        assert support.mode == "tree", (model_type, support.reason)
        assert support.families == {FAMILY: "auto"}
        assert [layer.path for layer in support.layers] == mixer_paths(model, model_type)
        assert {layer.modeling_module for layer in support.layers} == {MODULES[model_type]}


# ------------------------------------------------------------------------------------------------
# the comparison can fail; hooks are transparent without a tree; uninstall restores everything
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_unpatched_model_fails_the_comparison(model_type):
    """SSM state and conv inputs leak from one segment into the next in the packed row."""
    tree = M.pack_forest("mixed")
    H.check_unpatched_model_fails(MAMBA2, model_type, tree, alone_reference(model_type, "mixed", tree),
                                  logits_factor=10, grad_suffix="A_log", grad_factor=10)


@pytest.mark.parametrize("model_type", ["mamba2", "falcon_h1"])
def test_uninstall_restores_module_by_identity(model_type):
    H.check_uninstall_restores_by_identity(MAMBA2, model_type)


@pytest.mark.parametrize("model_type", ["mamba2", "bamba"])
def test_installed_model_is_bit_identical_without_tree(model_type, env):
    H.check_bit_identical_without_tree(make_model(model_type), env.install)


def test_causal_lm_carrier_hands_tree_kwargs_to_backbone_only_for_its_forward(env):
    """Mamba2ForCausalLM drops **kwargs on the way to its backbone; the carrier hook gives the
    backbone the tree kwargs during the head's forward, and is gone afterwards."""
    model = make_model("mamba2")
    env.install(model)
    seen = []
    handle = model.backbone.layers[0].register_forward_pre_hook(lambda m, a, kw: seen.append(sorted(kw)), with_kwargs=True)
    try:
        tree = M.pack_forest("fan")
        model(input_ids=tree.input_ids, use_cache=False, **tree.trl_kwargs())
        model(input_ids=tree.input_ids[:, :5], use_cache=False)
    finally:
        handle.remove()
    assert {"tree_cu_seqlens_q", "tree_cu_seqlens_k", "tree_kv_index"} <= set(seen[0])
    assert not any(k.startswith("tree_") for k in seen[1])
    assert not model.backbone._forward_pre_hooks_with_kwargs


def test_tree_row_with_cache_is_refused(env):
    H.check_tree_row_with_cache_is_refused(make_model("nemotron_h"), env.install)


# ------------------------------------------------------------------------------------------------
# the tree SSD oracle op (ssd_token_scan) against transformers' torch mamba2_chunk_scan
# ------------------------------------------------------------------------------------------------

_hf_scan = importlib.import_module(MODULES["mamba2"]).mamba2_chunk_scan.__wrapped__


def _ssd_inputs(T=19, H=4, P=6, G=2, N=5, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, T, H, P, generator=g).to(dtype)
    dt = torch.randn(1, T, H, generator=g).to(dtype)
    A = -torch.rand(H, generator=g) * 2 - 0.1
    B = torch.randn(1, T, G, N, generator=g).to(dtype)
    C = torch.randn(1, T, G, N, generator=g).to(dtype)
    D = torch.randn(H, generator=g).to(dtype)
    dt_bias = torch.randn(H, generator=g).to(dtype)
    return x, dt, A, B, C, D, dt_bias


def _op():
    # the token-by-token oracle (ssd_token_scan); the chunked ssd_tree_scan is checked against it in
    # test_ssd_chunked.py, and runs every "native" model test here
    return plugins.ops(FAMILY).ssd_token_scan


@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.05, 0.8)], ids=["nolimit", "limit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_op_matches_transformers_on_a_chain(dtype, dt_limit):
    x, dt, A, B, C, D, dt_bias = _ssd_inputs(dtype=dtype)
    h0 = torch.randn(1, 4, 6, 5)
    ins = [t.requires_grad_() for t in (x, dt, B, C, D, dt_bias, h0)]
    want = _hf_scan(x, dt, A, B, C, chunk_size=8, D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=dt_limit,
                    initial_states=h0)
    got = _op()(x[0], dt[0], B[0], C[0], torch.tensor([0, x.shape[1]]), torch.tensor([-1]), h0[0], A=A,
                dt_limit=list(dt_limit), D=D, dt_bias=dt_bias, dt_softplus=True)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want[0], atol=2e-5, rtol=1e-5)
    w = torch.randn_like(got)
    g_want = torch.autograd.grad((want[0] * w).sum(), ins)
    g_got = torch.autograd.grad((got * w).sum(), ins)
    for a, b in zip(g_got, g_want):
        # bf16 inputs get bf16 gradients: one rounding (2^-8 relative) apart at most
        torch.testing.assert_close(a.float(), b.float(), atol=5e-4 if dtype == torch.bfloat16 else 5e-5,
                                   rtol=2e-2 if dtype == torch.bfloat16 else 1e-4)


def test_native_op_forks_every_segment_from_its_parent():
    """Segments in DFS order: each starts from its parent's final state (roots from per-root
    initial states); equal to transformers' scan over every root-to-leaf path alone."""
    x, dt, A, B, C, D, dt_bias = _ssd_inputs(T=17)
    offsets = torch.tensor([0, 4, 5, 9, 10, 13, 17])
    parents = torch.tensor([-1, 0, 1, 0, -1, 4])
    h0 = torch.randn(2, 4, 6, 5)
    D2 = torch.randn(4, 6)  # mamba-ssm's per-channel D
    y = _op()(x[0], dt[0], B[0], C[0], offsets, parents, h0, A=A, dt_limit=[0.0, float("inf")], D=D2,
              dt_bias=dt_bias, dt_softplus=True)
    paths = {2: [0, 1, 2], 3: [0, 3], 5: [4, 5]}
    for leaf, segs in paths.items():
        tokens = torch.cat([torch.arange(int(offsets[s]), int(offsets[s + 1])) for s in segs])
        root = 0 if segs[0] == 0 else 1
        want = stand_ins.mamba_chunk_scan_combined(x[:, tokens], dt[:, tokens], A, B[:, tokens], C[:, tokens], 8,
                                                   D=D2, dt_bias=dt_bias, initial_states=h0[root:root + 1],
                                                   dt_softplus=True)
        torch.testing.assert_close(y[tokens], want[0], atol=2e-5, rtol=1e-5)


def test_native_op_z_gate_and_errors():
    x, dt, A, B, C, D, dt_bias = _ssd_inputs(T=7)
    z = torch.randn_like(x)
    off, par = torch.tensor([0, 7]), torch.tensor([-1])
    y = _op()(x[0], dt[0], B[0], C[0], off, par, None, A=A, dt_limit=[0.0, 1e9], D=D, dt_bias=dt_bias, dt_softplus=True,
              z=z)
    want = stand_ins.mamba_chunk_scan_combined(x, dt, A, B, C, 8, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
    torch.testing.assert_close(y, want[0], atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="B and C"):
        _op()(x[0], dt[0], B[0], C[0, :, :1], off, par, None, A=A, dt_limit=[0.0, 1.0])
    with pytest.raises(ValueError, match="multiple of groups"):
        _op()(x[0, :, :3], dt[0, :, :3], B[0], C[0], off, par, None, A=A[:3], dt_limit=[0.0, 1.0])
    with pytest.raises(ValueError, match="seg_offsets must end"):
        _op()(x[0], dt[0], B[0], C[0], torch.tensor([0, 6]), par, None, A=A, dt_limit=[0.0, 1.0])
    with pytest.raises(ValueError, match="contiguous int64 CPU"):  # a strided view: its raw elements are not [0, 7]
        _op()(x[0], dt[0], B[0], C[0], torch.tensor([0, 3, 7, 9])[::2], par, None, A=A, dt_limit=[0.0, 1.0])
    with pytest.raises(ValueError, match="initial_state"):
        _op()(x[0], dt[0], B[0], C[0], off, par, torch.zeros(2, 4, 6, 5), A=A, dt_limit=[0.0, 1.0])


# ------------------------------------------------------------------------------------------------
# tree_recurrence.stand_ins: mamba-ssm's APIs
# ------------------------------------------------------------------------------------------------


def test_stand_in_chunk_scan_matches_transformers_and_separates_seq_idx():
    x, dt, A, B, C, D, dt_bias = _ssd_inputs(T=21)
    h0 = torch.randn(1, 4, 6, 5)
    kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True)
    y, final = stand_ins.mamba_chunk_scan_combined(x, dt, A, B, C, 8, initial_states=h0, return_final_states=True, **kw)
    want, want_final = _hf_scan(x, dt, A, B, C, chunk_size=8, initial_states=h0, return_final_states=True, **kw)
    torch.testing.assert_close(y, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_final, atol=2e-5, rtol=1e-5)
    # three packed sequences: each starts from zeros (the first from the initial state)
    cu = [0, 5, 6, 21]
    seq_idx = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), torch.tensor(cu[1:]) - torch.tensor(cu[:-1]))[None]
    y, final, varlen = stand_ins.mamba_chunk_scan_combined(
        x, dt, A, B, C, 8, initial_states=h0, seq_idx=seq_idx, cu_seqlens=torch.tensor(cu), return_final_states=True,
        return_varlen_states=True, **kw)
    for i in range(3):
        s, e = cu[i], cu[i + 1]
        want, want_final = _hf_scan(x[:, s:e], dt[:, s:e], A, B[:, s:e], C[:, s:e], chunk_size=8,
                                    initial_states=h0 if i == 0 else None, return_final_states=True, **kw)
        torch.testing.assert_close(y[:, s:e], want, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(varlen[i:i + 1], want_final, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(final, varlen[-1:])
    with pytest.raises(AssertionError, match="cu_seqlens"):
        stand_ins.mamba_chunk_scan_combined(x, dt, A, B, C, 8, return_varlen_states=True)


def test_stand_in_split_conv1d_scan_matches_the_split_path_and_seq_idx():
    """The fused stand-in = conv (+silu) then scan then grouped gated RMSNorm then out_proj,
    computed step by step here; with seq_idx, packed sequences equal sequences run alone."""
    g = torch.Generator().manual_seed(4)
    H, P, G, N, W, T = 4, 6, 2, 5, 4, 13
    dim = H * P
    zxbcdt = torch.randn(1, T, 2 * dim + 2 * G * N + H, generator=g)
    conv_w, conv_b = torch.randn(dim + 2 * G * N, W, generator=g) * 0.5, torch.randn(dim + 2 * G * N, generator=g)
    dt_bias, A, D = torch.randn(H, generator=g), -torch.rand(H, generator=g) - 0.2, torch.randn(H, generator=g)
    norm_w, out_w = torch.randn(dim, generator=g), torch.randn(7, dim, generator=g)
    kw = dict(rmsnorm_weight=norm_w, rmsnorm_eps=1e-5, outproj_weight=out_w, headdim=P, ngroups=G, norm_before_gate=False)
    out = stand_ins.mamba_split_conv1d_scan_combined(zxbcdt, conv_w, conv_b, dt_bias, A, D, 8, **kw)
    z, xBC, dt = torch.split(zxbcdt, [dim, dim + 2 * G * N, H], dim=-1)
    xBC = F.silu(F.conv1d(xBC.transpose(1, 2), conv_w[:, None], conv_b, padding=W - 1, groups=xBC.shape[-1])[..., :T])
    x, B, C = torch.split(xBC.transpose(1, 2), [dim, G * N, G * N], dim=-1)
    y = _hf_scan(x.reshape(1, T, H, P), dt, A, B.reshape(1, T, G, N), C.reshape(1, T, G, N), chunk_size=8, D=D,
                 dt_bias=dt_bias, dt_softplus=True).reshape(1, T, dim)
    y = (y * F.silu(z)).reshape(1, T, G, dim // G)
    y = (y * torch.rsqrt(y.square().mean(-1, keepdim=True) + 1e-5)).reshape(1, T, dim) * norm_w
    torch.testing.assert_close(out, y @ out_w.T, atol=1e-4, rtol=1e-4)
    # packed: two sequences in one row, separated by seq_idx
    seq_idx = torch.tensor([[0] * 6 + [1] * 7], dtype=torch.int32)
    packed = stand_ins.mamba_split_conv1d_scan_combined(zxbcdt, conv_w, conv_b, dt_bias, A, D, 8, seq_idx=seq_idx, **kw)
    torch.testing.assert_close(packed[:, :6], out[:, :6])
    second = stand_ins.mamba_split_conv1d_scan_combined(zxbcdt[:, 6:], conv_w, conv_b, dt_bias, A, D, 8, **kw)
    torch.testing.assert_close(packed[:, 6:], second, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# GPU: the native kernels on CUDA (tree conv, chunked SSD tree scan over the CUDA state pass)
# ------------------------------------------------------------------------------------------------

GPU_MODELS = ["mamba2", "nemotron_h", "bamba", "granitemoehybrid"]


def _cuda_tree(tree):
    import dataclasses

    return dataclasses.replace(tree, input_ids=tree.input_ids.cuda(), position_ids=tree.position_ids.cuda(),
                               sample_positions=[p.cuda() for p in tree.sample_positions],
                               packed={k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in tree.packed.items()})


def _rel_rms(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).square().mean().sqrt() / b.square().mean().sqrt().clamp_min(1e-30))


def _gpu_case(model_type, seam, env):
    """The mixed forest on the GPU: (row on CUDA, fp32 CUDA model, loss weights, samples); for the
    fused seam the library stand-ins are bound (the samples alone take the fused reference)."""
    pytest.importorskip("trl")  # the forests are packed by TRL's TreeRow
    tree = M.pack_forest("mixed")
    if seam == "fused":
        env.bind(_module(model_type), [CONV, SCAN, FUSED])
    model = make_model(model_type).cuda()
    return _cuda_tree(tree), model, [w.cuda() for w in M.loss_weights(tree.samples)], [s.cuda() for s in tree.samples]


def _gpu_tree_run(model, gpu, weights, seam, env, decisions) -> M.Result:
    """Installs the native kernels, runs the row, checks which seams ran natively."""
    env.install(model, policy=tr.Policy(strategy="native"))
    decisions.clear()
    got = M.run_tree(model, gpu, weights, gpu.trl_kwargs())
    expected = {(FUSED, "native")} if seam == "fused" else {(FUSED, "decline"), (CONV, "native"), (SCAN, "native")}
    assert set(H.decided(decisions, FAMILY)) == expected
    return got


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seam", ["split", "fused"])
@pytest.mark.parametrize("model_type", GPU_MODELS)
def test_gpu_fp32_tree_equals_samples_alone(model_type, seam, env, decisions):
    """fp32 on the GPU, native kernels: the tree row equals the samples alone (logits and every
    gradient, 1e-4), through the split seams (conv + scan) or the fused seam (library stand-ins
    bound: the samples alone take the fused reference, the tree row the family's fused adapter)."""
    gpu, model, weights, samples = _gpu_case(model_type, seam, env)
    alone = M.run_alone(model, samples, weights)
    M.assert_matches(_gpu_tree_run(model, gpu, weights, seam, env, decisions), alone, model,
                     what=f"{model_type}/{seam}/cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seam", ["split", "fused"])
@pytest.mark.parametrize("model_type", GPU_MODELS)
def test_gpu_bf16_tree_matches_samples_alone(model_type, seam, env, decisions):
    """bf16 on the GPU: the tree row and the bf16 samples alone, both judged against the fp32 model
    alone (relative RMS): the tree within 5e-3 (logits) / 2e-2 (gradients; 5e-2 for A_log, dt_bias
    and D) or within the model's own bf16 noise on the samples (1.5x logits, 4x gradients; test_gpu.py's band)."""
    gpu, model, weights, samples = _gpu_case(model_type, seam, env)
    ref = M.run_alone(model, samples, weights)
    model.to(torch.bfloat16)
    bf16 = M.run_alone(model, samples, weights)
    got = _gpu_tree_run(model, gpu, weights, seam, env, decisions)
    tree_err = max(_rel_rms(t, r) for t, r in zip(got.logits, ref.logits))
    alone_err = max(_rel_rms(b, r) for b, r in zip(bf16.logits, ref.logits))
    assert tree_err <= max(5e-3, 1.5 * alone_err), (tree_err, alone_err)
    for name in ref.grads:
        if float(ref.grads[name].abs().max()) == 0:
            continue
        t, a = _rel_rms(got.grads[name], ref.grads[name]), _rel_rms(bf16.grads[name], ref.grads[name])
        # A_log, dt_bias, D: per-head sums of cancelling terms over every token; in bf16 the samples
        # alone already miss them by 0.5-5% (CPU runs of this test), the tree by up to 4%
        floor = 5e-2 if name.endswith(("A_log", "dt_bias", ".D")) else 2e-2
        assert t <= max(floor, 4 * a), (name, t, a)
