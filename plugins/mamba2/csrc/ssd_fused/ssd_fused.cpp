// fused::supported, fused::scan (the autograd Function around fused::forward / fused::backward), the
// binding of ssd_tree_scan's arguments (ssd_fused.h), and the checks and kernel-parameter binding of the
// backward's inputs (ssd_fused_bwd.h).
//
// Output dtype: x's (bf16 / fp16), as the kernels write it (mamba-ssm's chunk scan rounds its output to
// the input dtype too); the composite (every other path) returns fp32 (ssd_chunked.h). A grad_out
// arriving in any dtype is handed to fused::backward in the in-type.
#include "ssd_fused.h"
#include "tree_recurrence/sdk/check.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>

#include <string>

#include "kernels/params.h"
#include "kernels/params_bwd.h"
#include "ssd_fused_bwd.h"
#include "tree_recurrence/sdk/settings.h"

namespace tree_recurrence::ssd::fused {
namespace {

// Why the fused kernels do not take this call, or "" when they do.
std::string unsupported(const Args& a, const Tables& t) {
  if (!settings::fused_kernels()) return "TREE_RECURRENCE_FUSED=0";
#ifndef TREE_RECURRENCE_WITH_CUDA
  (void)a;
  (void)t;
  return "built without CUDA";
#else
  const at::Tensor& x = a.x;
  if (!x.is_cuda()) return "x is not on a CUDA device";
  if (x.key_set().has(c10::DispatchKey::Python) || x.key_set().has(c10::DispatchKey::Functionalize) ||
      x.key_set().has(c10::DispatchKey::Meta))
    return "x is a traced (fake / functional / meta) tensor";
  const auto in = x.scalar_type();
  if (in != at::kBFloat16 && in != at::kHalf) return "x is neither bfloat16 nor float16";
  if (a.B.scalar_type() != in || a.C.scalar_type() != in) return "B and C do not have x's dtype";
  if (x.dim() != 3 || a.B.dim() != 3 || t.gather.dim() != 2) return "bad ranks";
  if (!kernels::fwd_shape_supported(t.gather.size(1), x.size(2), a.B.size(2)))
    return "chunk not 64/128/256, or head_dim / state not multiples of 8 up to 128 / 256";
  for (const at::Tensor* v : {&a.dt, &a.A})
    if (!at::isFloatingType(v->scalar_type()) || !v->is_cuda()) return "dt or A is not a floating CUDA tensor";
  for (const auto* o : {&a.D, &a.dt_bias, &a.z, &a.initial_state})
    if (*o && (!at::isFloatingType((*o)->scalar_type()) || (*o)->device() != x.device()))
      return "an optional input is not a floating tensor on x's device";
  if (a.z) {
    const at::Tensor z = a.z->dim() == 4 && a.z->size(0) == 1 ? (*a.z)[0] : *a.z;
    if (z.sizes() != x.sizes()) return "z is not shaped like x";
  }
  if (a.initial_state) {
    const at::Tensor& s = *a.initial_state;
    if (!((s.dim() == 3 || s.dim() == 4) && s.size(-3) == x.size(1) && s.size(-2) == x.size(2) && s.size(-1) == a.B.size(2)))
      return "initial_state is not (H, P, N) or (R, H, P, N)";
  }
  for (const at::Tensor* v : {&t.gather, &t.seg_chunk_offsets, &t.parents, &t.root_index, &t.level_segments, &t.child_offsets})
    if (v->scalar_type() != at::kLong || v->device() != x.device()) return "a chunk table is not int64 on x's device";
  if (t.level_offsets.empty()) return "level_offsets is empty";
  return "";
#endif
}

at::Tensor opt(const std::optional<at::Tensor>& v) { return v ? *v : at::Tensor(); }
std::optional<at::Tensor> some(const at::Tensor& v) { return v.defined() ? std::optional<at::Tensor>(v) : std::nullopt; }

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct ScanFn : public torch::autograd::Function<ScanFn> {
  // Inputs 0..4 are tensors; 5..8 optional tensors (std::optional, not undefined tensors: apply()
  // builds a VariableInfo of every at::Tensor argument, which throws "tensor does not have a
  // device" on an undefined one, while an absent optional is simply not a variable input); 9, 10
  // the Args (scalars) and Tables; 11 whether the pre-gate y is saved (false when no gradient can
  // follow: grad mode off or no input requiring grad). backward() returns one slot per argument (12), undefined for the
  // absent optionals and the non-tensors.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& B,
                            const at::Tensor& C, const at::Tensor& A, const std::optional<at::Tensor>& D,
                            const std::optional<at::Tensor>& dt_bias, const std::optional<at::Tensor>& z,
                            const std::optional<at::Tensor>& h0, const Args* args, const Tables* tables,
                            bool save_y) {
    // y is stored only for a backward that reads it (forms_y_itself: the post kernel recomputes it)
    auto [out, saved] = fused::forward(*args, *tables, save_y && !forms_y_itself(*args, *tables));
    ctx->save_for_backward({x, dt, B, C, A, opt(D), opt(dt_bias), opt(z), opt(h0), saved.dt, saved.Lam, saved.states,
                            saved.y});
    ctx->saved_data["dt_min"] = args->dt_min;
    ctx->saved_data["dt_max"] = args->dt_max;
    ctx->saved_data["dt_softplus"] = args->dt_softplus;
    tables->save(ctx);
    return out;  // x's dtype (ssd_chunked.h: the fused path's output contract)
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list sv = ctx->get_saved_variables();
    Args a;
    a.x = sv[0], a.dt = sv[1], a.B = sv[2], a.C = sv[3], a.A = sv[4];
    a.D = some(sv[5]), a.dt_bias = some(sv[6]), a.z = some(sv[7]), a.initial_state = some(sv[8]);
    a.dt_min = ctx->saved_data["dt_min"].toDouble();
    a.dt_max = ctx->saved_data["dt_max"].toDouble();
    a.dt_softplus = ctx->saved_data["dt_softplus"].toBool();
    const Tables t = Tables::load(ctx);
    at::Tensor g = grads[0];
    if (!g.defined()) g = at::zeros(a.x.sizes(), a.x.options().dtype(at::kFloat));

    // Without retain_graph no later backward reads the saved y (the engine frees this node's buffers after this
    // call): the backward may write dz over it. Saved-tensor hooks that unpack to a fresh tensor (save_on_cpu,
    // checkpointing) hand over a copy, which is as much ours.
    const bool keep_graph = torch::autograd::get_current_graph_task_keep_graph();
    const Saved saved{sv[9], sv[10], sv[11], sv[12], /*y_consumable=*/!keep_graph};
    const Grads gr = fused::backward(g.to(a.x.scalar_type()), a, t, saved);
    variable_list out(12);
    out[0] = gr.dx, out[1] = gr.ddt, out[2] = gr.dB, out[3] = gr.dC, out[4] = gr.dA;
    out[5] = gr.dD, out[6] = gr.ddt_bias, out[7] = gr.dz, out[8] = gr.d_initial_state;
    return out;
  }
};

}  // namespace

bool supported(const Args& a, const Tables& t) { return unsupported(a, t).empty(); }

at::Tensor scan(const Args& a, const Tables& t) {
  // Absent optionals as std::nullopt (also a defined-less optional would be dropped the same way).
  const auto present = [](const std::optional<at::Tensor>& v) { return some(opt(v)); };
  bool grad = false;
  if (at::GradMode::is_enabled()) {
    for (const at::Tensor* v : {&a.x, &a.dt, &a.B, &a.C, &a.A}) grad = grad || v->requires_grad();
    for (const auto* o : {&a.D, &a.dt_bias, &a.z, &a.initial_state}) grad = grad || (*o && (*o)->requires_grad());
  }
  return ScanFn::apply(a.x, a.dt, a.B, a.C, a.A, present(a.D), present(a.dt_bias), present(a.z), present(a.initial_state),
                       &a, &t, /*save_y=*/grad);
}

std::pair<Args, Tables> bind(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& B, const at::Tensor& C,
                             TREE_RECURRENCE_CHUNK_TABLE_PARAMS, const std::optional<at::Tensor>& initial_state,
                             const at::Tensor& A, at::ArrayRef<double> dt_limit, const std::optional<at::Tensor>& D,
                             const std::optional<at::Tensor>& dt_bias, bool dt_softplus, const std::optional<at::Tensor>& z) {
  Args a;
  a.x = x, a.dt = dt, a.B = B, a.C = C, a.A = A;
  a.D = D, a.dt_bias = dt_bias, a.z = z, a.initial_state = initial_state;
  // z (1, T, H, P) as its (T, H, P) view: the kernels and the backward's checks take x's shape, and autograd hands
  // dz back through the view in z's own shape
  if (z && z->dim() == 4 && z->size(0) == 1) a.z = z->select(0, 0);
  TR_CHECK_VALUE(dt_limit.size() == 2, "ssd_tree_scan: dt_limit must be (low, high)");
  a.dt_min = dt_limit[0], a.dt_max = dt_limit[1];
  a.dt_softplus = dt_softplus;
  return {a, Tables::of(TREE_RECURRENCE_CHUNK_TABLE_ARGS)};
}

std::vector<at::Tensor> stages_op(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& B, const at::Tensor& C,
                                  TREE_RECURRENCE_CHUNK_TABLE_PARAMS, const std::optional<at::Tensor>& initial_state,
                                  const at::Tensor& A, at::ArrayRef<double> dt_limit, const std::optional<at::Tensor>& D,
                                  const std::optional<at::Tensor>& dt_bias, bool dt_softplus, const std::optional<at::Tensor>& z,
                                  c10::string_view plan) {
  auto [a, t] = bind(x, dt, B, C, TREE_RECURRENCE_CHUNK_TABLE_ARGS, initial_state, A, dt_limit, D, dt_bias, dt_softplus, z);
  const std::string why = unsupported(a, t);
  TR_CHECK_VALUE(why.empty(), "ssd_fused_stages: the fused kernels do not take this call: ", why);
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> out = forward_stages(a, t, std::string_view(plan.data(), plan.size()));
  if (!out[5].defined()) out[5] = at::empty({0}, x.options());
  return out;
}

kernels::BwdType bwd_type(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return kernels::BwdType::Float32;
    case at::kBFloat16: return kernels::BwdType::BFloat16;
    case at::kHalf: return kernels::BwdType::Float16;
    default:
      TR_CHECK_TYPE(false, "fused SSD backward: ", name, " has dtype ", t.scalar_type(),
                    ", expected float32, bfloat16 or float16");
  }
  return kernels::BwdType::Float32;
}

int64_t check_backward_inputs(const at::Tensor& grad_out, const Args& a, const Tables& t, const Saved& saved, bool& shared_h0) {
  TR_CHECK_VALUE(a.x.is_cuda(), "fused SSD backward: x must be a CUDA tensor, got one on ", a.x.device());
  TR_CHECK_VALUE(a.x.dim() == 3, "fused SSD backward: x must be (tokens, heads, head_dim), got ", a.x.sizes());
  const int64_t T = a.x.size(0), H = a.x.size(1), P = a.x.size(2);
  TR_CHECK_VALUE(a.B.dim() == 3 && a.B.size(0) == T && a.C.sizes() == a.B.sizes(),
                 "fused SSD backward: B and C must be (tokens, groups, state) alike, got ", a.B.sizes(), " and ",
                 a.C.sizes());
  const int64_t G = a.B.size(1), N = a.B.size(2);
  TR_CHECK_VALUE(G > 0 && H % G == 0, "fused SSD backward: heads ", H, " must be a multiple of groups ", G);
  TR_CHECK_VALUE(a.dt.dim() == 2 && a.dt.size(0) == T && a.dt.size(1) == H, "fused SSD backward: dt must be (", T, ", ",
                 H, "), got ", a.dt.sizes());
  TR_CHECK_VALUE(a.A.dim() == 1 && a.A.size(0) == H, "fused SSD backward: A must be (", H, "), got ", a.A.sizes());
  TR_CHECK_VALUE(grad_out.sizes() == a.x.sizes(), "fused SSD backward: grad_out must be shaped like x ", a.x.sizes(),
                 ", got ", grad_out.sizes());
  TR_CHECK_VALUE(t.gather.dim() == 2 && t.gather.scalar_type() == at::kLong,
                 "fused SSD backward: gather must be an int64 (chunks, chunk) table, got ", t.gather.scalar_type(), " ",
                 t.gather.sizes());
  const int64_t NC = t.gather.size(0), L = t.gather.size(1);
  TR_CHECK_VALUE(L >= 1 && L <= kernels::kBwdMaxChunk, "fused SSD backward: chunk ", L, " must be in 1..", kernels::kBwdMaxChunk);
  TR_CHECK_VALUE(t.level_offsets.size() >= 1, "fused SSD backward: level_offsets must not be empty");
  TR_CHECK_VALUE(saved.dt.scalar_type() == at::kFloat && saved.Lam.scalar_type() == at::kFloat &&
                     saved.dt.sizes() == at::IntArrayRef({NC, H, L}) && saved.Lam.sizes() == saved.dt.sizes(),
                 "fused SSD backward: saved dt and Lam must be float32 (chunks, heads, chunk) = (", NC, ", ", H, ", ", L,
                 "), got ", saved.dt.scalar_type(), " ", saved.dt.sizes(), " and ", saved.Lam.scalar_type(), " ",
                 saved.Lam.sizes());
  TR_CHECK_VALUE(saved.states.sizes() == at::IntArrayRef({NC, H, P, N}), "fused SSD backward: saved states must be (", NC,
                 ", ", H, ", ", P, ", ", N, "), got ", saved.states.sizes());
  if (a.z) {
    TR_CHECK_VALUE(a.z->sizes() == a.x.sizes(), "fused SSD backward: z must be shaped like x ", a.x.sizes(), ", got ",
                   a.z->sizes());
    // y may be absent (the forward did not store it: forms_y_itself): then the backward recomputes it
    TR_CHECK_VALUE(!saved.y.defined() || saved.y.sizes() == a.x.sizes(),
                   "fused SSD backward: the saved y must be shaped like x ", a.x.sizes(), ", got ", saved.y.sizes());
  }
  if (a.D)
    TR_CHECK_VALUE((a.D->dim() == 1 && a.D->size(0) == H) || (a.D->dim() == 2 && a.D->size(0) == H && a.D->size(1) == P),
                   "fused SSD backward: D must be (", H, ") or (", H, ", ", P, "), got ", a.D->sizes());
  if (a.dt_bias)
    TR_CHECK_VALUE(a.dt_bias->dim() == 1 && a.dt_bias->size(0) == H, "fused SSD backward: dt_bias must be (", H,
                   "), got ", a.dt_bias->sizes());
  shared_h0 = false;
  int64_t R = t.level_offsets.size() >= 2 ? t.level_offsets[1] - t.level_offsets[0] : 0;  // roots = level 0
  if (a.initial_state) {
    const at::Tensor& s = *a.initial_state;
    TR_CHECK_VALUE((s.dim() == 3 || s.dim() == 4) && s.size(-3) == H && s.size(-2) == P && s.size(-1) == N,
                   "fused SSD backward: initial_state must be (", H, ", ", P, ", ", N, ") or (roots, ", H, ", ", P, ", ",
                   N, "), got ", s.sizes());
    shared_h0 = s.dim() == 3 || s.size(0) == 1;
    if (!shared_h0) R = s.size(0);
  }
  return R;
}
void bind_backward_params(kernels::BwdParams& p, BwdInputs& in, const at::Tensor& grad_out, const Args& a, const Tables& t,
                 const Saved& saved) {
  const auto fit = [](const at::Tensor& v) {
    return v.scalar_type() == at::kDouble ? v.to(at::kFloat).contiguous() : v.contiguous();
  };
  const int64_t H = a.x.size(1), P = a.x.size(2);
  in.x = fit(a.x), in.B = fit(a.B), in.C = fit(a.C), in.dout = fit(grad_out), in.states = fit(saved.states);
  in.dt_raw = a.dt.to(at::kFloat).contiguous(), in.A = a.A.to(at::kFloat).contiguous();
  in.dt_s = saved.dt.contiguous(), in.Lam = saved.Lam.contiguous();
  if (a.dt_bias) in.dt_bias = a.dt_bias->to(at::kFloat).contiguous();
  if (a.D)
    in.D = (a.D->dim() == 1 ? a.D->to(at::kFloat).view({H, 1}).expand({H, P}) : a.D->to(at::kFloat)).contiguous();
  if (a.z) in.z = fit(*a.z);
  if (a.z && saved.y.defined()) in.y = fit(saved.y);
  in.gather = t.gather.contiguous();
  in.sco = t.seg_chunk_offsets.contiguous(), in.ridx = t.root_index.contiguous();
  in.lsegs = t.level_segments.contiguous(), in.coff = t.child_offsets.contiguous();
  in.kids = t.children.numel() > 0 ? t.children.contiguous() : at::zeros({1}, t.parents.options());

  p.tokens = a.x.size(0); p.heads = H; p.groups = a.B.size(1); p.head_dim = P; p.state_dim = a.B.size(2);
  p.num_chunks = t.gather.size(0); p.chunk = t.gather.size(1); p.num_segments = t.parents.size(0);
  p.x_type = bwd_type(in.x, "x");
  p.bc_type = bwd_type(in.B, "B");
  TR_CHECK_TYPE(in.C.scalar_type() == in.B.scalar_type(), "fused SSD backward: B and C must share a dtype, got ",
                in.B.scalar_type(), " and ", in.C.scalar_type());
  p.dout_type = bwd_type(in.dout, "grad_out");
  p.states_type = bwd_type(in.states, "saved states");
  p.x = in.x.data_ptr(); p.B = in.B.data_ptr(); p.C = in.C.data_ptr(); p.dout = in.dout.data_ptr();
  p.states = in.states.data_ptr();
  if (a.z) {
    p.z_type = bwd_type(in.z, "z");
    p.z = in.z.data_ptr();
    if (in.y.defined()) {
      p.y_type = bwd_type(in.y, "saved y");
      p.y = in.y.data_ptr();
    }
  }
  p.dt_raw = in.dt_raw.data_ptr<float>();
  p.A = in.A.data_ptr<float>();
  p.dt_bias = a.dt_bias ? in.dt_bias.data_ptr<float>() : nullptr;
  p.D = a.D ? in.D.data_ptr<float>() : nullptr;
  p.dt_softplus = a.dt_softplus;
  p.dt_min = static_cast<float>(a.dt_min);
  p.dt_max = static_cast<float>(a.dt_max);
  p.dt = in.dt_s.data_ptr<float>();
  p.Lam = in.Lam.data_ptr<float>();
  p.gather = in.gather.data_ptr<int64_t>();
  p.seg_chunk_offsets = in.sco.data_ptr<int64_t>();
  p.root_index = in.ridx.data_ptr<int64_t>();
  p.level_segments = in.lsegs.data_ptr<int64_t>();
  p.child_offsets = in.coff.data_ptr<int64_t>();
  p.children = in.kids.data_ptr<int64_t>();
}

}  // namespace tree_recurrence::ssd::fused
