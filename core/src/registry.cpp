#define BOOST_DLL_USE_STD_FS
#include "tree_recurrence/registry.h"

#include <algorithm>
#include <boost/dll/shared_library.hpp>
#include <filesystem>

namespace tree_recurrence {
namespace fs = std::filesystem;
namespace {

std::string describe(const TreeRecurrenceFingerprint& f) {
  std::string out = std::string("torch ") + (f.torch_version ? f.torch_version : "?") + ", cxx11_abi " +
                    std::to_string(f.cxx11_abi) + ", cuda " + (f.cuda_version && *f.cuda_version ? f.cuda_version : "none");
  if (f.cuda_archs && *f.cuda_archs) out += std::string(" (sm ") + f.cuda_archs + ")";
  return out;
}

const TreeRecurrenceFingerprint& own_fingerprint() {
  static const TreeRecurrenceFingerprint fingerprint = TREE_RECURRENCE_FINGERPRINT;
  return fingerprint;
}

// A plugin must match the core in torch version and C++ ABI. CUDA kernels are optional: a
// library built without them still works on CPU, so CUDA is recorded, not compared.
std::string fingerprint_mismatch(const TreeRecurrenceFingerprint& theirs) {
  const TreeRecurrenceFingerprint& ours = own_fingerprint();
  if (!theirs.torch_version || std::string(theirs.torch_version) != ours.torch_version ||
      theirs.cxx11_abi != ours.cxx11_abi)
    return "build fingerprint mismatch: the plugin was built for " + describe(theirs) + ", this core for " + describe(ours);
  return "";
}

std::vector<fs::path> manifests_in(const std::string& folder) {
  std::vector<fs::path> found;
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return found;
  for (const auto& entry : fs::directory_iterator(folder, ec))
    if (entry.is_regular_file() && entry.path().extension() == ".yaml") found.push_back(entry.path());
  std::sort(found.begin(), found.end());
  return found;
}

}  // namespace

std::string core_fingerprint() { return describe(own_fingerprint()); }

Registry& Registry::instance() {
  static Registry* registry = new Registry();  // leaked on purpose: plugins are never unloaded
  return *registry;
}

std::vector<const PluginRecord*> Registry::discover(const std::vector<std::string>& folders) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<const PluginRecord*> added;
  for (const auto& folder : folders) {
    for (const auto& path : manifests_in(folder)) {
      std::error_code ec;
      const std::string canonical = fs::weakly_canonical(path, ec).string();
      const bool seen = std::any_of(records_.begin(), records_.end(),
                                    [&](const auto& r) { return r->manifest_path == canonical; });
      if (seen) continue;
      auto record = std::make_unique<PluginRecord>();
      record->manifest_path = canonical;
      record->family = path.stem().string();
      load(*record);
      added.push_back(record.get());
      records_.push_back(std::move(record));
    }
  }
  return added;
}

void Registry::load(PluginRecord& record) {
  try {
    record.manifest_node = YAML::LoadFile(record.manifest_path);
    record.manifest = parse_manifest(record.manifest_node, record.manifest_path);
  } catch (const YAML::Exception& e) {
    record.error = "manifest " + record.manifest_path + ": invalid YAML: " + e.what();
    return;
  } catch (const std::exception& e) {
    record.error = e.what();
    return;
  }
  record.family = record.manifest.family;
  record.version = record.manifest.version;
  for (const auto& other : records_)
    if (other->loaded && other->family == record.family) {
      record.error = "family '" + record.family + "' is already loaded from " + other->library_path;
      return;
    }
  const fs::path library = fs::path(record.manifest_path).parent_path() / record.manifest.library;
  record.library_path = library.string();
  if (!fs::exists(library)) {
    record.error = "library " + record.library_path + " named by the manifest does not exist";
    return;
  }
  auto shared = std::make_unique<boost::dll::shared_library>();
  boost::dll::fs::error_code ec;
  shared->load(library, boost::dll::load_mode::rtld_local | boost::dll::load_mode::rtld_now, ec);
  if (ec) {
    record.error = "library " + record.library_path + " cannot be loaded: " + ec.message();
    return;
  }
  if (!shared->has(TREE_RECURRENCE_ENTRY_SYMBOL)) {
    record.error = "library " + record.library_path + " has no entry symbol '" TREE_RECURRENCE_ENTRY_SYMBOL
                   "' (declare the family with TREE_RECURRENCE_FAMILY)";
    shared.release();  // never unload: it may have registered torch ops in its static initializers
    return;
  }
  auto entry = shared->get<const TreeRecurrencePluginInfo*()>(TREE_RECURRENCE_ENTRY_SYMBOL);
  shared.release();
  const TreeRecurrencePluginInfo* info = entry();
  if (!info) {
    record.error = "library " + record.library_path + ": entry point returned no plugin info";
    return;
  }
  if (info->abi_version != TREE_RECURRENCE_ABI_VERSION) {
    record.error = "library " + record.library_path + ": plugin ABI version " + std::to_string(info->abi_version) +
                   ", this core speaks version " + std::to_string(TREE_RECURRENCE_ABI_VERSION);
    return;
  }
  if (info->struct_size < sizeof(TreeRecurrencePluginInfo)) {
    record.error = "library " + record.library_path + ": plugin info is " + std::to_string(info->struct_size) +
                   " bytes, expected at least " + std::to_string(sizeof(TreeRecurrencePluginInfo));
    return;
  }
  record.fingerprint = describe(info->fingerprint);
  if (const std::string mismatch = fingerprint_mismatch(info->fingerprint); !mismatch.empty()) {
    record.error = "library " + record.library_path + ": " + mismatch;
    return;
  }
  if (!info->family_name || record.family != info->family_name) {
    record.error = "library " + record.library_path + " implements family '" + (info->family_name ? info->family_name : "") +
                   "' but its manifest names '" + record.family + "'";
    return;
  }
  char message[512] = {0};
  void* object = nullptr;
  if (info->create_family(&object, message, sizeof(message)) != 0 || !object) {
    record.error = "library " + record.library_path + ": family factory failed: " + message;
    return;
  }
  record.family_object = static_cast<TreeFamily*>(object);
  try {
    record.family_object->configure(record.manifest);
  } catch (const std::exception& e) {
    record.error = "library " + record.library_path + ": configure failed: " + e.what();
    record.family_object = nullptr;
    return;
  }
  record.loaded = true;
}

std::vector<const PluginRecord*> Registry::records() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<const PluginRecord*> out;
  for (const auto& r : records_) out.push_back(r.get());
  return out;
}

const PluginRecord* Registry::loaded_family(const std::string& family) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& r : records_)
    if (r->loaded && r->family == family) return r.get();
  return nullptr;
}

}  // namespace tree_recurrence
