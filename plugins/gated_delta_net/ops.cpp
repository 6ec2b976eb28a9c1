// Torch ops of the gated_delta_net family (namespace tree_recurrence_gated_delta_net), registered
// when the family is created (sdk/op_library.h says why). The tree conv and the state pass it runs on are the
// shared ops library's (torch.ops.tree_recurrence.*, sdk/shared_ops.h), not registered here.
//
// Every op's kernel is boxed: bind() reads the call's arguments by their schema names into the one
// argument struct (csrc/gdn_args.h), so the schema strings and the struct are the only places that
// list them.
#include "ops.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <type_traits>
#include <utility>
#include <vector>

#include "csrc/gdn_args.h"
#include "csrc/gdn_chunked.h"
#include "csrc/gdn_fused/gdn_fused.h"
#include "csrc/gdn_fused/gdn_fused_bwd.h"
#include "csrc/gdn_token_oracle.h"
#include "tree_recurrence/sdk/check.h"
#include "tree_recurrence/sdk/chunk_tables.h"
#include "tree_recurrence/sdk/op_library.h"
#include "tree_recurrence/sdk/settings.h"

#define GDN_CHUNKED_SCHEMA                                                                               \
  TREE_RECURRENCE_GDN_INPUTS_SCHEMA ", " TREE_RECURRENCE_CHUNK_TABLE_SCHEMA ", " TREE_RECURRENCE_GDN_SCALARS_SCHEMA

namespace tree_recurrence::gdn {
namespace {

// One boxed call's arguments, by schema name.
class Call {
 public:
  Call(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> values) : schema_(schema), values_(values) {}

  const c10::IValue& operator[](const char* name) const {
    const auto i = schema_.argumentIndexWithName(name);
    TR_CHECK(i.has_value(), schema_.name(), " has no argument '", name, "'");
    return values_[*i];
  }
  at::Tensor tensor(const char* name) const { return (*this)[name].toTensor(); }

 private:
  const c10::FunctionSchema& schema_;
  c10::ArrayRef<c10::IValue> values_;
};

// The schema's arguments into the struct: the one binding of every op.
template <class TablesT>
ArgsOf<TablesT> bind(const Call& c) {
  ArgsOf<TablesT> a;
  ArgsOf<TablesT>::each_input(a, [&](const char* name, at::Tensor& t) { t = c.tensor(name); });
  TablesT::each_tensor(a.tables, [&](const char* name, at::Tensor& t) { t = c.tensor(name); });
  if constexpr (std::is_same_v<TablesT, Tables>) a.tables.level_offsets = c["level_offsets"].toIntVector();
  a.initial_state = c["initial_state"].toOptional<at::Tensor>();
  ArgsOf<TablesT>::each_scalar(a, [&](const char* name, auto& x) { x = c[name].template to<std::decay_t<decltype(x)>>(); });
  return a;
}

at::Tensor tree_scan(const Call& c) { return chunked_scan(bind<Tables>(c)); }
at::Tensor token_scan(const Call& c) { return token_oracle(bind<TokenTables>(c)); }
std::vector<at::Tensor> fused_stages(const Call& c) { return fused::stages(bind<Tables>(c)); }
std::vector<at::Tensor> fused_backward_stages(const Call& c) {
  fused::Saved sv{c.tensor("G"), c.tensor("Ainv"), c.tensor("w"),     c.tensor("kd"),
                  c.tensor("h"), c.tensor("v_new"), c.tensor("rq"), c.tensor("rk")};
  return fused::backward_stages(c.tensor("grad_o"), bind<Tables>(c), std::move(sv));
}

// Body's result in place of the call's arguments on the stack.
template <auto Body>
void boxed(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  auto result = Body(Call(op.schema(), torch::jit::last(*stack, n)));
  torch::jit::drop(*stack, n);
  torch::jit::push(*stack, std::move(result));
}

template <auto Body>
torch::CppFunction kernel() {
  return torch::CppFunction::makeFromBoxedFunction<&boxed<Body>>();
}

}  // namespace

void register_ops() {
  // The seam's native op: chunked, over the plan's device chunk tables (csrc/gdn_chunked.h).
  op_library(torch::Library::FRAGMENT).def("gdn_tree_scan(" GDN_CHUNKED_SCHEMA ") -> Tensor");
  auto& composite = op_library(torch::Library::IMPL, c10::DispatchKey::CompositeImplicitAutograd);
  composite.impl("gdn_tree_scan", kernel<&tree_scan>());
  if (!settings::test_ops()) return;  // the test-only ops below: TREE_RECURRENCE_TEST_OPS=1 (sdk/settings.h)
  auto& test_ops = op_library(torch::Library::FRAGMENT);
  // Its float64 token-by-token oracle over the plan's host arrays (csrc/gdn_token_oracle.h).
  test_ops.def("gdn_token_scan(" TREE_RECURRENCE_GDN_INPUTS_SCHEMA ", Tensor seg_offsets, Tensor parents, "
               TREE_RECURRENCE_GDN_SCALARS_SCHEMA ") -> Tensor");
  // The fused CUDA forward's stages (csrc/gdn_fused/gdn_fused.h: fused::stages).
  test_ops.def("gdn_fused_stages(" GDN_CHUNKED_SCHEMA ") -> Tensor[]");
  // The fused CUDA backward's stages from given saved buffers (csrc/gdn_fused/gdn_fused_bwd.h).
  test_ops.def("gdn_fused_backward_stages(Tensor grad_o, " GDN_CHUNKED_SCHEMA
               ", Tensor G, Tensor Ainv, Tensor w, Tensor kd, Tensor h, Tensor v_new, Tensor rq, Tensor rk) -> Tensor[]");
  auto& test_composite = op_library(torch::Library::IMPL, c10::DispatchKey::CompositeImplicitAutograd);
  test_composite.impl("gdn_token_scan", kernel<&token_scan>());
  test_composite.impl("gdn_fused_stages", kernel<&fused_stages>());
  test_composite.impl("gdn_fused_backward_stages", kernel<&fused_backward_stages>());
}

}  // namespace tree_recurrence::gdn
