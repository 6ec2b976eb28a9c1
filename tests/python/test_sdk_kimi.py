"""The SDK and a third-party family: Kimi-Linear (KDA) built out of tree and loaded at run time.

The plugin of sdk/examples/kimi_linear is copied ALONE to a temporary folder and built there against the
SDK of the INSTALLED package (``python -m tree_recurrence sdk --cmake-dir``), once per session; then a
tiny real transformers kimi_linear model, tree-packed by TRL's own packer, must equal its samples run alone
(logits and every parameter's gradient), natively and over the bound kernels. Without the plugin, install
must refuse the model and name its KDA layers. Also: the Python SDK surface (components).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import models as M
from tree_recurrence import components

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "sdk" / "examples" / "kimi_linear"
KIMI_MODULE = "transformers.models.kimi_linear.modeling_kimi_linear"
KIMI_SEAMS = ("causal_conv1d_fn", "chunk_kimi_delta_attention")

# docs/transformers-seams.md section 5
KIMI_CONFIG = dict(vocab_size=M.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, layer_types=["linear_attention", "full_attention"], kv_lora_rank=16,
                   q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, moe_intermediate_size=32,
                   num_local_experts=4, num_experts_per_tok=2, linear_head_dim=16, linear_num_heads=4,
                   linear_conv_kernel_dim=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def make_kimi(seed: int = 0, dtype: torch.dtype = torch.float64):
    """A tiny kimi_linear CausalLM (float64: tree and alone then agree to rounding; its MoE runs the eager
    experts, grouped_mm has no float64), tree attention, train mode, every KDA decay parameter re-drawn so
    the channels decay differently."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("kimi_linear", **KIMI_CONFIG)
    config.use_cache = False
    for attr in ("attention_dropout", "hidden_dropout", "dropout"):
        if isinstance(getattr(config, attr, None), float):
            setattr(config, attr, 0.0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=M.tree_attention_name(),
                                             experts_implementation="eager").to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.0, generator=gen).to(p.dtype))
    return model.train()


# ------------------------------------------------------------------------------------------------
# the out-of-tree build (one per session)
# ------------------------------------------------------------------------------------------------


def _toolchain_missing() -> str | None:
    if shutil.which("cmake") is None:
        return "cmake"
    compilers = [os.environ["CXX"].split()[0]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    if not any(shutil.which(c) for c in compilers):
        return "a C++ compiler (" + " / ".join(compilers) + ")"
    if shutil.which("ninja") is None and shutil.which("make") is None:
        return "ninja or make"
    return None


def _run(command: list, what: str, **kw) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, **kw)
    assert result.returncode == 0, f"{what} failed ({result.returncode}): {' '.join(map(str, command))}\n" \
                                   f"--- stdout\n{result.stdout[-6000:]}\n--- stderr\n{result.stderr[-6000:]}"
    return result


def sdk_dir(kind: str) -> Path:
    return Path(_run([sys.executable, "-m", "tree_recurrence", "sdk", f"--{kind}-dir"], f"sdk --{kind}-dir").stdout.strip())


@pytest.fixture(scope="module")
def kimi_plugin_dir(tmp_path_factory) -> Path:
    """Copies only sdk/examples/kimi_linear to a fresh folder, configures it against the installed SDK,
    builds it, and returns the folder holding the plugin library and its manifest."""
    missing = _toolchain_missing()
    if missing:
        pytest.skip(f"building the out-of-tree Kimi-Linear plugin needs {missing}, which is not installed")
    root = tmp_path_factory.mktemp("kimi_linear_out_of_tree")
    source, build = root / "kimi_linear", root / "build"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "__pycache__"))
    configure = ["cmake", "-S", source, "-B", build, f"-DTreeRecurrenceSDK_DIR={sdk_dir('cmake')}",
                 f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release"]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    if shutil.which("ccache"):
        configure += ["-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
    _run(configure, "configuring the Kimi-Linear plugin against the installed SDK")
    _run(["cmake", "--build", build, "-j2"], "building the Kimi-Linear plugin")
    plugins = build / "plugins"
    assert (plugins / "kimi_linear.yaml").is_file() and (plugins / "libtree_recurrence_kimi_linear.so").is_file(), \
        sorted(p.name for p in plugins.iterdir())
    return plugins


@pytest.fixture(scope="module")
def kimi_family(kimi_plugin_dir) -> dict:
    """The plugin loaded into this process through add_plugin_path (plugins are never unloaded)."""
    import tree_recurrence as tr
    from tree_recurrence import plugins

    tr.add_plugin_path(kimi_plugin_dir)
    records = [r for r in plugins.discover() if r["family"] == "kimi_linear"]
    assert records and records[0]["loaded"], records
    return plugins.families()["kimi_linear"]


@pytest.fixture(autouse=True)
def kimi_hidden_unless_asked_for(request, monkeypatch):
    """A test that asks for neither kimi_family nor kimi_plugin_dir runs with the kimi_linear family switched
    off (TREE_RECURRENCE_DISABLE_FAMILIES: install and components then see no such family), as in a fresh
    process. Plugins are never unloaded, so without this a test that needs the plugin but does not ask for it
    would pass after an earlier test loaded it and fail alone."""
    if not {"kimi_family", "kimi_plugin_dir"} & set(request.fixturenames):
        from tree_recurrence import plugins

        already = os.environ.get(plugins.DISABLE_ENV, "")
        monkeypatch.setenv(plugins.DISABLE_ENV, ",".join(filter(None, [already, "kimi_linear"])))


@pytest.fixture(autouse=True)
def kimi_module_restored():
    """Every test leaves the kimi modeling module with transformers' own seams and unpatched."""
    from tree_recurrence import seams

    module = importlib.import_module(KIMI_MODULE)
    before = {s: getattr(module, s) for s in KIMI_SEAMS}
    yield
    leaks = [s for s in KIMI_SEAMS if getattr(module, s) is not before[s]] + [n for n in seams.owners if n == KIMI_MODULE]
    if KIMI_MODULE in seams.owners:
        seams.unpatch_module(KIMI_MODULE)
    for s, obj in before.items():
        setattr(module, s, obj)
    assert not leaks, f"test left {KIMI_MODULE} changed: {leaks}"


@contextlib.contextmanager
def installed(model, **kw):
    import tree_recurrence as tr

    support = tr.install(model, **kw)
    try:
        yield support
    finally:
        tr.uninstall(model)


@contextlib.contextmanager
def bound(binding: str):
    """'torch': transformers' own seams (torch references; KDA computes in fp32 inside). 'stand_ins':
    tree_recurrence.stand_ins' FLA chunk_kda (varlen, float64-exact) and causal-conv1d bound as
    transformers binds the libraries."""
    module = importlib.import_module(KIMI_MODULE)
    if binding == "torch":
        yield module
        return
    from tree_recurrence.stand_ins import bind_stand_ins

    restore = bind_stand_ins(module, seams=KIMI_SEAMS)
    try:
        yield module
    finally:
        restore()


# ------------------------------------------------------------------------------------------------
# the SDK as installed
# ------------------------------------------------------------------------------------------------


def test_sdk_cli_points_at_the_installed_sdk():
    import tree_recurrence

    cmake, include = sdk_dir("cmake"), sdk_dir("include")
    package = Path(tree_recurrence.__file__).resolve().parent
    assert cmake == package / "sdk" / "cmake" and include == package / "sdk" / "include"
    assert {"TreeRecurrenceSDKConfig.cmake", "TreeRecurrenceSDKConfigVersion.cmake",
            "TreeRecurrenceFamily.cmake"} <= {p.name for p in cmake.iterdir()}
    for header in ("abi.h", "family.h", "fingerprint.h", "op_library.h", "tree_conv_op.h", "chunk_state_op.h",
                   "shared_ops.h"):
        assert (include / "tree_recurrence" / "sdk" / header).is_file(), header
    assert (include / "tree_recurrence" / "kernels" / "tree_conv.h").is_file()
    assert (package / "sdk" / "lib" / "libtree_recurrence_kernels.a").is_file()
    assert (package / "sdk" / "lib" / "libtree_recurrence_ops.so").is_file()  # the shared ops library
    config = (cmake / "TreeRecurrenceSDKConfig.cmake").read_text()
    built_torch = tree_recurrence._core.core_fingerprint().split(",")[0].removeprefix("torch ").strip()
    assert f'set(TREE_RECURRENCE_SDK_TORCH_VERSION "{built_torch}")' in config


def test_plugin_loads_with_the_package_fingerprint(kimi_family, kimi_plugin_dir):
    from tree_recurrence import plugins

    assert Path(kimi_family.library_path).parent == kimi_plugin_dir
    gdn = plugins.families()["gated_delta_net"]
    assert kimi_family.fingerprint == gdn.fingerprint, "the SDK must stamp the package's own fingerprint"
    kernels = {(k, d): ok for k, d, ok in kimi_family.kernels}
    assert kernels[("kda_tree_scan", "cpu")] and kernels[("tree_conv", "cpu")]
    assert kernels[("tree_conv", "cuda")] == dict(((k, d), ok) for k, d, ok in gdn.kernels)[("tree_conv", "cuda")]
    manifest = kimi_family.manifest
    assert [m["mixers"] for m in manifest["models"] if m["model_type"] == "kimi_linear"] == [["KimiLinearDeltaAttention"]]
    assert set(manifest["seams"]) == set(KIMI_SEAMS)
    assert hasattr(torch.ops.tree_recurrence_kimi_linear, "kda_tree_scan")
    # its tree conv is the SDK's shared op, not a copy in its own namespace
    assert not torch._C._jit_get_schemas_for_operator("tree_recurrence_kimi_linear::tree_conv")
    assert torch._C._jit_get_schemas_for_operator("tree_recurrence::tree_conv")


# ------------------------------------------------------------------------------------------------
# the native op against the references
# ------------------------------------------------------------------------------------------------


def _kda_inputs(n: int, heads: int = 2, dim: int = 8, dtype=torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, heads, dim, generator=gen, dtype=dtype) for _ in range(3))
    g = -torch.rand(1, n, heads, dim, generator=gen, dtype=dtype) * 2  # log decay per key channel
    beta = torch.rand(1, n, heads, generator=gen, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def test_kda_op_matches_transformers_and_the_fla_stand_in_on_a_chain(kimi_family):
    from tree_recurrence import stand_ins

    module = importlib.import_module(KIMI_MODULE)
    torch_kda = getattr(module.chunk_kimi_delta_attention, "__wrapped__", module.chunk_kimi_delta_attention)
    q, k, v, g, beta = _kda_inputs(70)  # crosses the torch reference's 64-token chunks
    seg, parents = torch.tensor([0, 70]), torch.tensor([-1])
    ours = torch.ops.tree_recurrence_kimi_linear.kda_tree_scan(q[0], k[0], v[0], g[0], beta[0], seg, parents, None, 0.0, True)
    fla, _ = stand_ins.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert (ours - fla[0]).abs().max() < 1e-12
    theirs, _ = torch_kda(q.float(), k.float(), v.float(), g.float(), beta.float(), use_qk_l2norm_in_kernel=True)
    assert (ours.float() - theirs[0]).abs().max() < 1e-4
    # gradients reach every input, equal to the stand-in's
    w = torch.randn_like(ours)
    grads = torch.autograd.grad((ours * w).sum(), (q, k, v, g, beta))
    ref = torch.autograd.grad((fla[0] * w).sum(), (q, k, v, g, beta))
    for a, b in zip(grads, ref):
        assert (a - b).abs().max() < 1e-10


def test_kda_op_rejects_bad_input(kimi_family):
    op = torch.ops.tree_recurrence_kimi_linear.kda_tree_scan
    q, k, v, g, beta = (t.detach()[0] for t in _kda_inputs(5))
    seg, parents = torch.tensor([0, 5]), torch.tensor([-1])
    with pytest.raises(ValueError, match="one log decay per key channel"):
        op(q, k, v, g[..., 0], beta, seg, parents, None, 0.0, False)
    with pytest.raises(ValueError, match="seg_offsets"):
        op(q, k, v, g, beta, torch.tensor([0, 4]), parents, None, 0.0, False)
    with pytest.raises(ValueError, match="parent"):
        op(q, k, v, g, beta, torch.tensor([0, 2, 5]), torch.tensor([-1, 1]), None, 0.0, False)


@pytest.mark.parametrize("backend", ["native", "kernel"])
@pytest.mark.parametrize("forest", ["tiny", "groups"])
def test_kda_scan_component_equals_every_path_alone(kimi_family, backend, forest):
    """components.kda_scan over a TRL-packed trie == the stand-in chunk_kda on every sample alone (outputs and
    input gradients): native op, or fork / rescan over the stand-in."""
    import tree_recurrence as tr
    from tree_recurrence import components, driver, stand_ins

    tree = M.pack_forest(forest)
    plan = tr.tree_plan(tree.trl_kwargs())
    inputs = _kda_inputs(plan.num_tokens, seed=3)
    for strategy in (["native"] if backend == "native" else ["fork", "rescan"]):
        driver.decisions.clear()
        out = components.kda_scan(*inputs, plan=plan, use_qk_l2norm_in_kernel=True, backend=backend,
                                  policy=tr.Policy(strategy=strategy))
        assert {d[2] for d in driver.decisions} == {strategy}
        w = torch.randn_like(out)
        got = torch.autograd.grad((out * w).sum(), inputs)
        for pos in tree.sample_positions:  # every sample alone
            o, _ = stand_ins.chunk_kda(*(t[:, pos] for t in inputs), use_qk_l2norm_in_kernel=True)
            assert (o[0] - out[0, pos]).abs().max() < 1e-12
        # the tree's loss counts a shared token once: weight each sample's tokens by 1 / (samples through them)
        visits = torch.zeros(plan.num_tokens, dtype=torch.float64)
        for pos in tree.sample_positions:
            visits[pos] += 1
        loss = sum((stand_ins.chunk_kda(*(t[:, pos] for t in inputs), use_qk_l2norm_in_kernel=True)[0]
                    * (w[:, pos] / visits[pos][None, :, None, None])).sum() for pos in tree.sample_positions)
        want = torch.autograd.grad(loss, inputs)
        for name, a, b in zip("q k v g beta".split(), got, want):
            assert (a - b).abs().max() < 1e-10, name


@pytest.mark.parametrize("forest", ["tiny", "groups"])  # one root, three roots
def test_kda_scan_component_initial_state(kimi_family, forest):
    import tree_recurrence as tr
    from tree_recurrence import components, driver, stand_ins

    tree = M.pack_forest(forest)
    plan = tr.tree_plan(tree.trl_kwargs())
    q, k, v, g, beta = (t.detach() for t in _kda_inputs(plan.num_tokens, seed=5))
    h0 = torch.randn(1, 2, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    if forest == "groups":  # the native op takes one state per root: one state for three roots is forked instead
        with pytest.raises(ValueError, match="native"):
            components.kda_scan(q, k, v, g, beta, plan, initial_state=h0, policy=tr.Policy(strategy="native"))
    for backend, strategy in (("auto", "auto"), ("kernel", "fork"), ("kernel", "rescan")):
        driver.decisions.clear()
        out = components.kda_scan(q, k, v, g, beta, plan, initial_state=h0, backend=backend,
                                  policy=tr.Policy(strategy=strategy, fork_min_saved_tokens=0))
        expected = {"auto": "native" if forest == "tiny" else "fork"}.get(strategy, strategy)
        assert {d[2] for d in driver.decisions} == {expected}, (strategy, forest, list(driver.decisions))
        for pos in tree.sample_positions:
            o, _ = stand_ins.chunk_kda(q[:, pos], k[:, pos], v[:, pos], g[:, pos], beta[:, pos], initial_state=h0)
            assert (o[0] - out[0, pos]).abs().max() < 1e-12


# ------------------------------------------------------------------------------------------------
# the model: tree-packed == every sample alone
# ------------------------------------------------------------------------------------------------

_ALONE: dict = {}


def alone(binding: str, forest: str) -> M.Result:
    key = (binding, forest)
    if key not in _ALONE:
        model = make_kimi()
        tree = M.pack_forest(forest)
        with bound(binding):
            _ALONE[key] = M.run_alone(model, tree.samples, M.loss_weights(tree.samples))
    return _ALONE[key]


CASES = [  # (strategy, binding): native; rescan and fork over transformers' torch KDA and over FLA's API (varlen)
    ("native", "torch"), ("native", "stand_ins"), ("rescan", "torch"), ("fork", "torch"), ("rescan", "stand_ins"),
    ("fork", "stand_ins"),
]


@pytest.mark.parametrize("strategy,binding", CASES)
def test_kimi_tree_matches_samples_alone(kimi_family, strategy, binding):
    import tree_recurrence as tr
    from tree_recurrence import driver

    tree = M.pack_forest("mixed")
    reference = alone(binding, "mixed")
    model = make_kimi()
    backends = None if strategy == "native" else {"kimi_linear": "kernel"}
    with bound(binding), installed(model, policy=tr.Policy(strategy=strategy), backends=backends) as support:
        assert support.mode == "tree", support.reason
        assert support.families == {"kimi_linear": "kernel" if backends else "auto"}
        assert [layer.class_name for layer in support.layers] == ["KimiLinearDeltaAttention"]
        driver.decisions.clear()
        result = M.run_tree(model, tree, M.loss_weights(tree.samples), tree.trl_kwargs())
    used = {(seam, s) for family, seam, s, _ in driver.decisions if family == "kimi_linear"}
    assert used == {("causal_conv1d_fn", "native" if strategy == "native" else "rescan"),
                    ("chunk_kimi_delta_attention", strategy)}, used
    M.assert_matches(result, reference, model, f"kimi_linear {strategy} over {binding}")


@pytest.mark.parametrize("forest", ["tiny", "chain"])
def test_kimi_native_under_gradient_checkpointing(kimi_family, forest):
    import tree_recurrence as tr

    tree = M.pack_forest(forest)
    reference = alone("torch", forest)
    model = make_kimi()
    model.gradient_checkpointing_enable()
    with installed(model, policy=tr.Policy(strategy="native")) as support:
        assert support.mode == "tree"
        result = M.run_tree(model, tree, M.loss_weights(tree.samples), tree.rich_kwargs())
    M.assert_matches(result, reference, model, f"kimi_linear native, checkpointed, {forest}")


_SUBPROCESS = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import test_sdk_kimi as T
    import tree_recurrence as tr
    from tree_recurrence import plugins
    support = tr.install(T.make_kimi())
    print(json.dumps({{"mode": support.mode, "reason": support.reason, "families": sorted(plugins.families()),
                       "layers": [l.path for l in support.layers]}}))
""")


def _install_in_fresh_process(plugin_path: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TREE_RECURRENCE_PLUGIN_PATH"}
    if plugin_path:
        env["TREE_RECURRENCE_PLUGIN_PATH"] = plugin_path
    env.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    script = _SUBPROCESS.format(tests=str(Path(__file__).resolve().parent))
    out = _run([sys.executable, "-c", script], "install in a fresh process", env=env, cwd=str(REPO / "tests" / "python"))
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_without_the_plugin_install_names_the_kda_layers():
    """A fresh process (plugins are never unloaded in-process) without the plugin on the path."""
    answer = _install_in_fresh_process(None)
    assert "kimi_linear" not in answer["families"]
    assert answer["mode"] == "none" and answer["layers"] == []
    reason = answer["reason"]
    assert "model.layers.0.self_attn" in reason, reason
    assert "KimiLinearForgetGate" in reason and "A_log" in reason, reason  # the KDA decay nobody covers
    assert "model.layers.1" not in reason, reason  # the attention layer is fine


def test_plugin_path_variable_finds_the_plugin(kimi_plugin_dir):
    answer = _install_in_fresh_process(str(kimi_plugin_dir))
    assert "kimi_linear" in answer["families"]
    assert answer["mode"] == "tree" and answer["layers"] == ["model.layers.0.self_attn"], answer


# ------------------------------------------------------------------------------------------------
# Python SDK surface: a model that follows trees in its own code
# ------------------------------------------------------------------------------------------------


class ToyKDA(torch.nn.Module):
    """A KDA mixer written for tree-packed rows with tree_recurrence.components: its pieces take no plan,
    the marked forward provides it."""

    def __init__(self, hidden: int = 16, heads: int = 2, dim: int = 8, width: int = 3):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.qkv = torch.nn.Linear(hidden, 3 * heads * dim, bias=False)
        self.conv_weight = torch.nn.Parameter(torch.randn(3 * heads * dim, width) * 0.5)
        self.gate = torch.nn.Linear(hidden, heads * dim, bias=False)
        self.A_log = torch.nn.Parameter(torch.rand(heads) - 0.5)
        self.b = torch.nn.Linear(hidden, heads, bias=False)
        self.out = torch.nn.Linear(heads * dim, hidden, bias=False)

    def mix(self, x):
        batch, length, _ = x.shape
        qkv = components.short_convolution(self.qkv(x), self.conv_weight, activation="silu")
        q, k, v = (t.reshape(batch, length, self.heads, self.dim) for t in qkv.split(self.heads * self.dim, dim=-1))
        decay = self.A_log.exp()[:, None] * torch.nn.functional.softplus(self.gate(x).reshape(batch, length, self.heads, -1))
        o = components.kda_scan(q, k, v, -decay, self.b(x).sigmoid(), use_qk_l2norm_in_kernel=True)
        return self.out(o.reshape(batch, length, -1))

    @components.mark_tree_forward
    def forward(self, x, **kwargs):
        return self.mix(x)


class UnmarkedToyKDA(ToyKDA):
    def forward(self, x, **kwargs):
        return self.mix(x)


class ToyModel(torch.nn.Module):
    def __init__(self, mixer: type = ToyKDA):
        super().__init__()
        self.embed = torch.nn.Embedding(M.VOCAB, 16)
        self.mixers = torch.nn.ModuleList([mixer(), mixer()])
        self.head = torch.nn.Linear(16, M.VOCAB)

    def forward(self, input_ids, **kwargs):
        x = self.embed(input_ids)
        for mixer in self.mixers:
            x = x + mixer(x, **kwargs)
        return self.head(x)


def test_register_family_and_components_make_a_model_follow_trees(kimi_family):
    import tree_recurrence as tr
    from tree_recurrence import components, plugins

    torch.manual_seed(0)
    model = ToyModel().double()
    tree = M.pack_forest("mixed")
    kwargs = tree.trl_kwargs()
    with installed(model) as support:  # an A_log nobody covers
        assert support.mode == "none" and "ToyKDA" in support.reason and "A_log" in support.reason
    record = tr.register_family("toy_kda", model_types=["toy"], mixer_classes=[ToyKDA], layer_types=["linear_attention"])
    try:
        assert plugins.families()["toy_kda"] is record
        with pytest.raises(ValueError, match="already registered"):
            tr.register_family("toy_kda", "toy", [ToyKDA], "linear_attention")
        with pytest.raises(ValueError, match="plugin named 'kimi_linear'"):
            tr.register_family("kimi_linear", "toy", [ToyKDA], "linear_attention")
        with installed(model) as support:
            assert support.mode == "tree", support.reason
            assert [layer.path for layer in support.layers] == ["mixers.0", "mixers.1"]
            assert support.families == {"toy_kda": "auto"}
            logits = model(tree.input_ids, **kwargs)[0]
        weights = M.loss_weights(tree.samples)
        loss = sum((logits[pos] * w.double()).sum() for pos, w in zip(tree.sample_positions, weights))
        tree_grads = torch.autograd.grad(loss, list(model.parameters()))
        loss = sum((model(sample[None])[0] * w.double()).sum() for sample, w in zip(tree.samples, weights))
        alone_grads = torch.autograd.grad(loss, list(model.parameters()))
        for sample, pos in zip(tree.samples, tree.sample_positions):
            assert (model(sample[None])[0] - logits[pos]).abs().max() < 1e-10
        # 1e-6: the native tree conv accumulates weight gradients in fp32, also for float64 (sdk/kernels)
        for (name, _), a, b in zip(model.named_parameters(), tree_grads, alone_grads):
            assert (a - b).abs().max() < 1e-6 * max(1.0, float(b.abs().max())), name
    finally:
        components.unregister_family("toy_kda")
    assert "toy_kda" not in plugins.families()


def test_unmarked_mixer_without_plan_mixes_the_samples(kimi_family):
    """The same components without mark_tree_forward (and no plan=) see an ordinary row: the packed row
    then differs from the samples alone, which is what the marking is for. ToyKDA's kda_scan is the
    kimi_linear plugin's component, so the test loads the plugin itself (kimi_family)."""
    torch.manual_seed(0)
    model = ToyModel(UnmarkedToyKDA).double()
    tree = M.pack_forest("fan")
    logits = model(tree.input_ids, **tree.trl_kwargs())[0]
    with torch.no_grad():
        logits = logits.detach()
        worst = max(float((model(s[None])[0] - logits[pos]).abs().max()) for s, pos in zip(tree.samples, tree.sample_positions))
    assert worst > 1e-3


def test_tree_conv_component_native_and_torch_agree(kimi_family):
    import tree_recurrence as tr
    from tree_recurrence import components

    tree = M.pack_forest("tiny")
    plan = tr.tree_plan(tree.trl_kwargs())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 6, plan.num_tokens, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True)
    native = components.tree_conv(x, w, b, "silu", plan, family="kimi_linear")
    torch_path = components._tree_conv_torch(x, w, b, True, plan)
    assert (native - torch_path).abs().max() < 1e-12
    for pos in tree.sample_positions:  # == a plain causal conv on every sample alone
        alone = components.short_convolution(x[:, :, pos].transpose(1, 2), w, b, "silu").transpose(1, 2)
        assert (alone - native[:, :, pos]).abs().max() < 1e-12
    g1 = torch.autograd.grad(native.sum(), (x, w, b))
    g2 = torch.autograd.grad(torch_path.sum(), (x, w, b))
    for a, c in zip(g1, g2):  # weight and bias gradients: fp32 accumulation in the native op
        assert (a - c).abs().max() < 1e-6 * max(1.0, float(c.abs().max()))


def test_gdn_and_ssd_scan_components():
    import tree_recurrence as tr
    from tree_recurrence import components, plugins, stand_ins

    tree = M.pack_forest("groups")
    plan = tr.tree_plan(tree.trl_kwargs())
    n = plan.num_tokens
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta = M.gdn_inputs(n, 2, 4, gen)
    for backend in ("auto", "kernel"):
        out = components.gdn_scan(q, k, v, g, beta, plan, use_qk_l2norm_in_kernel=True, backend=backend)
        for pos in tree.sample_positions:
            o, _ = stand_ins.chunk_gated_delta_rule(q[:, pos], k[:, pos], v[:, pos], g[:, pos], beta[:, pos],
                                                    use_qk_l2norm_in_kernel=True)
            assert (o[0] - out[0, pos]).abs().max() < 1e-12
    if "mamba2" not in plugins.families() or not hasattr(torch.ops.tree_recurrence_mamba2, "ssd_tree_scan"):
        pytest.skip("no mamba2 plugin with ssd_tree_scan in this build")
    x = torch.randn(1, n, 4, 8, generator=gen)
    dt = torch.randn(1, n, 4, generator=gen)
    A = -torch.rand(4, generator=gen)
    B, C = (torch.randn(1, n, 2, 16, generator=gen) for _ in range(2))
    D, dt_bias = torch.rand(4, generator=gen), torch.rand(4, generator=gen)
    y = components.ssd_scan(x, dt, A, B, C, plan, D=D, dt_bias=dt_bias, dt_softplus=True)
    ops = torch.ops.tree_recurrence_mamba2
    for pos in tree.sample_positions:  # every sample alone: a one-segment trie
        alone = ops.ssd_token_scan(x[0, pos], dt[0, pos], B[0, pos], C[0, pos], torch.tensor([0, len(pos)]),
                                  torch.tensor([-1]), None, A, [0.0, float("inf")], D, dt_bias, True, None)
        assert (alone - y[0, pos]).abs().max() < 1e-5
    if hasattr(stand_ins, "mamba_chunk_scan_combined"):  # rescan over mamba-ssm's API (no fork: SSD has no neutral padding)
        y_kernel = components.ssd_scan(x, dt, A, B, C, plan, chunk_size=8, D=D, dt_bias=dt_bias, dt_softplus=True,
                                       backend="kernel")
        assert (y_kernel - y).abs().max() < 1e-5
