// TreeFamily: what a layer family plugin implements, and the macro that exports it.
//
// A family is described twice: declaratively by its YAML manifest (model types, modeling modules,
// mixer classes, layer_types, seams) and in code by a TreeFamily object (detection beyond class
// names, kernel availability). The registry hands the parsed manifest to `configure` before any
// other call. Objects are created once and never destroyed (plugins are never unloaded).
#pragma once

#include <exception>
#include <map>
#include <string>
#include <vector>

#include "tree_recurrence/sdk/abi.h"
#include "tree_recurrence/sdk/fingerprint.h"

namespace tree_recurrence {

// One model the family covers, as listed in the manifest.
struct ModelEntry {
  std::string model_type;
  std::string module;               // python modeling module holding the seams
  std::vector<std::string> mixers;  // mixer class names
  std::vector<std::string> layer_types;  // layer_types values these mixers implement
  std::vector<std::string> plan_carriers;  // classes whose forward carries the plan (no-kwargs seams)
};

struct FamilyManifest {
  std::string family;
  std::string version;
  std::string library;
  std::string op_namespace;
  std::vector<ModelEntry> models;
  std::vector<std::string> seams;  // names of the module-level functions replaced
};

// A module of a model, described by the Python side without any torch object.
struct ParamDescription {
  std::string name;
  std::vector<int64_t> shape;
};
struct ConvDescription {
  bool present = false;
  int64_t in_channels = 0, out_channels = 0, groups = 0, kernel_size = 0, padding = 0;
};
struct ModuleDescription {
  std::string path;        // e.g. "model.layers.0.linear_attn"
  std::string class_name;  // e.g. "Qwen3_5GatedDeltaNet"
  std::string model_type;  // config.model_type of the model (text config)
  std::vector<ParamDescription> params;  // direct parameters only
  ConvDescription conv;    // set when the module is an nn.Conv1d
};

struct Claim {
  bool claimed = false;
  std::string role;    // "mixer" for a covered recurrent mixer
  std::string reason;  // why (shown in Support tables)
};

struct KernelInfo {
  std::string name;    // e.g. "tree_conv"
  std::string device;  // "cpu" or "cuda"
  bool available = false;
};

// The shared tree conv's kernels as linked into the calling plugin (CUDA when the SDK's kernels
// were built with it), for a family's kernels() list.
inline std::vector<KernelInfo> tree_conv_kernels() {
#ifdef TREE_RECURRENCE_WITH_CUDA
  constexpr bool cuda = true;
#else
  constexpr bool cuda = false;
#endif
  return {{"tree_conv", "cpu", true}, {"tree_conv", "cuda", cuda}};
}

class TreeFamily {
 public:
  virtual ~TreeFamily() = default;
  virtual void configure(const FamilyManifest& manifest) { manifest_ = manifest; }
  // Default: claims the manifest's mixer classes. Override to recognise more.
  virtual Claim detect(const ModuleDescription& module) const {
    for (const auto& model : manifest_.models)
      for (const auto& mixer : model.mixers)
        if (mixer == module.class_name) return {true, "mixer", manifest_.family + " mixer " + mixer};
    return {};
  }
  virtual std::vector<KernelInfo> kernels() const = 0;
  const FamilyManifest& manifest() const { return manifest_; }

 protected:
  FamilyManifest manifest_;
};

namespace detail {
inline void copy_message(const char* message, char* error, size_t size) {
  if (!error || size == 0) return;
  size_t i = 0;
  for (; message[i] && i + 1 < size; ++i) error[i] = message[i];
  error[i] = '\0';
}
template <class Family>
int32_t create_family(void** out, char* error, size_t size) {
  try {
    *out = static_cast<TreeFamily*>(new Family());
    return 0;
  } catch (const std::exception& e) {
    copy_message(e.what(), error, size);
  } catch (...) {
    copy_message("unknown exception in the family factory", error, size);
  }
  return 1;
}
}  // namespace detail
}  // namespace tree_recurrence

#if defined(_WIN32)
#define TREE_RECURRENCE_EXPORT __declspec(dllexport)
#else
#define TREE_RECURRENCE_EXPORT __attribute__((visibility("default")))
#endif

// Exports the entry point of a family library. Use once per plugin, at namespace scope.
#define TREE_RECURRENCE_FAMILY(FamilyClass, family_name, family_version)                      \
  extern "C" TREE_RECURRENCE_EXPORT const TreeRecurrencePluginInfo*                            \
  tree_recurrence_plugin_info() {                                                              \
    static const TreeRecurrencePluginInfo info{                                                \
        TREE_RECURRENCE_ABI_VERSION, sizeof(TreeRecurrencePluginInfo), family_name,            \
        family_version, TREE_RECURRENCE_FINGERPRINT,                                           \
        &::tree_recurrence::detail::create_family<FamilyClass>};                               \
    return &info;                                                                              \
  }
