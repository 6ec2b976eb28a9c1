#define BOOST_DLL_USE_STD_FS
#include "tree_recurrence/registry.h"

#include <algorithm>
#include <boost/dll/shared_library.hpp>
#include <dlfcn.h>

#include <filesystem>
#include <fstream>

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

// One entry of a plugin folder: a manifest to load, or the reason it cannot be read.
struct FolderEntry {
  fs::path path;
  std::string error;
};

// *.yaml entries of a folder, sorted. Only non-throwing filesystem calls: a symlink loop, an
// over-long name or an unreadable entry becomes one entry with its reason. A folder that does not
// exist yields nothing; a folder that cannot be read (loop, over-long path, permissions) yields one
// entry with the reason.
std::vector<FolderEntry> manifests_in(const std::string& folder) {
  std::vector<FolderEntry> found;
  std::error_code ec;
  const fs::file_status status = fs::status(folder, ec);
  if (status.type() == fs::file_type::not_found) return found;
  if (ec || !fs::is_directory(status)) {
    if (ec && ec != std::errc::no_such_file_or_directory)
      found.push_back({fs::path(folder), "plugin folder " + clip(folder) + " cannot be read: " + ec.message()});
    return found;
  }
  fs::directory_iterator it(folder, fs::directory_options::skip_permission_denied, ec);
  if (ec) {
    found.push_back({fs::path(folder), "plugin folder " + clip(folder) + " cannot be read: " + ec.message()});
    return found;
  }
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) {
      found.push_back({fs::path(folder), "plugin folder " + clip(folder) + " cannot be listed: " + ec.message()});
      break;
    }
    const fs::path& path = it->path();
    if (path.extension() != ".yaml") continue;
    std::error_code entry_ec;
    const fs::file_status entry_status = fs::status(path, entry_ec);
    if (entry_ec)
      found.push_back({path, "manifest " + clip(path.string()) + " cannot be read: " + entry_ec.message()});
    else if (!fs::is_regular_file(entry_status))
      found.push_back({path, "manifest " + clip(path.string()) + " is not a regular file"});
    else
      found.push_back({path, ""});
  }
  std::sort(found.begin(), found.end(), [](const FolderEntry& a, const FolderEntry& b) { return a.path < b.path; });
  return found;
}

// Nodes of a YAML tree with aliases expanded, counted up to `budget` (a billion-laughs manifest
// is a few hundred bytes that expand to billions of nodes for every reader walking it).
bool within_budget(const YAML::Node& node, size_t& budget, size_t depth) {
  if (budget == 0 || depth > kMaxManifestDepth) return false;
  --budget;
  if (node.IsMap()) {
    for (const auto& item : node)
      if (!within_budget(item.first, budget, depth + 1) || !within_budget(item.second, budget, depth + 1)) return false;
  } else if (node.IsSequence()) {
    for (const auto& item : node)
      if (!within_budget(item, budget, depth + 1)) return false;
  }
  return true;
}

// Whether `inner` (canonical) lies inside `folder` (canonical).
bool is_inside(const fs::path& inner, const fs::path& folder) {
  auto f = folder.begin(), i = inner.begin();
  for (; f != folder.end(); ++f, ++i)
    if (i == inner.end() || *f != *i) return false;
  return i != inner.end();
}

}  // namespace

std::string core_fingerprint() { return describe(own_fingerprint()); }

std::string clip(const std::string& text, size_t limit) {
  if (text.size() <= limit) return text;
  // A UTF-8 character the limit would split is cut whole, before its lead byte (at most 3 bytes back;
  // a longer run of continuation bytes is not UTF-8 and is cut at the limit).
  size_t cut = limit;
  for (size_t back = 0; back < 3 && cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80; ++back) --cut;
  if ((static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) cut = limit;
  return text.substr(0, cut) + "... (" + std::to_string(text.size()) + " bytes)";
}

Registry& Registry::instance() {
  static Registry* registry = new Registry();  // leaked on purpose: plugins are never unloaded
  return *registry;
}

std::vector<const PluginRecord*> Registry::discover(const std::vector<std::string>& folders) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<const PluginRecord*> added;
  for (const auto& folder : folders) {
    std::error_code folder_ec;
    fs::path canonical_folder = fs::canonical(folder, folder_ec);
    if (folder_ec) canonical_folder = fs::path(folder);
    for (const auto& entry : manifests_in(folder)) {
      std::error_code ec;
      std::string canonical = fs::weakly_canonical(entry.path, ec).string();
      if (ec || canonical.empty()) canonical = entry.path.string();
      const bool seen = std::any_of(records_.begin(), records_.end(),
                                    [&](const auto& r) { return r->manifest_path == canonical; });
      if (seen) continue;
      auto record = std::make_unique<PluginRecord>();
      record->manifest_path = canonical;
      record->folder = canonical_folder.string();
      // a file name is at most 255 bytes: cut at 84, with clip's note it stays within the 100 bytes the
      // Python binding shows (else that cut would clip the note)
      record->family = clip(entry.path.stem().string(), 84);
      if (entry.error.empty())
        load(*record, entry.path);
      else
        record->error = entry.error;
      added.push_back(record.get());
      records_.push_back(std::move(record));
    }
  }
  return added;
}

void Registry::load(PluginRecord& record, const fs::path& manifest) {
  const std::string shown = clip(record.manifest_path);
  try {
    std::error_code ec;
    const auto size = fs::file_size(manifest, ec);
    if (ec) {
      record.error = "manifest " + shown + " cannot be read: " + ec.message();
      return;
    }
    if (size > kMaxManifestBytes) {
      record.error = "manifest " + shown + " is " + std::to_string(size) + " bytes, at most " + std::to_string(kMaxManifestBytes);
      return;
    }
    std::ifstream in(manifest, std::ios::binary);
    std::string text(static_cast<size_t>(size), '\0');
    if (!in.read(text.data(), static_cast<std::streamsize>(size))) {
      record.error = "manifest " + shown + " cannot be read";
      return;
    }
    record.manifest_node = YAML::Load(text);
    size_t budget = kMaxManifestNodes;
    if (!within_budget(record.manifest_node, budget, 0)) {
      record.error = "manifest " + shown + ": more than " + std::to_string(kMaxManifestNodes) + " YAML nodes or " +
                     std::to_string(kMaxManifestDepth) + " levels once aliases are expanded (a manifest is a few hundred nodes)";
      record.manifest_node = YAML::Node();
      return;
    }
    record.manifest = parse_manifest(record.manifest_node, shown);
  } catch (const YAML::Exception& e) {
    record.error = "manifest " + shown + ": invalid YAML: " + clip(e.what());
    return;
  } catch (const std::exception& e) {
    record.error = clip(e.what(), 1000);
    return;
  }
  record.family = record.manifest.family;
  record.version = clip(record.manifest.version, 100);
  for (const auto& other : records_)
    if (other->loaded && other->family == record.family) {
      record.error = "family '" + record.family + "' is already loaded from " + other->library_path;
      return;
    }
  // The library must resolve, symlinks followed, to a regular file inside the manifest's folder:
  // nothing else is ever opened (opening runs the library's constructors).
  const fs::path named = fs::path(record.folder) / record.manifest.library;
  record.library_path = clip(named.lexically_normal().string());
  std::error_code ec;
  if (!fs::exists(named, ec)) {
    record.error = ec && ec != std::errc::no_such_file_or_directory
                       ? "library " + record.library_path + " named by the manifest cannot be resolved: " + ec.message()
                       : "library " + record.library_path + " named by the manifest does not exist";
    return;
  }
  const fs::path library = fs::canonical(named, ec);
  if (ec) {
    record.error = "library " + record.library_path + " named by the manifest cannot be resolved: " + ec.message();
    return;
  }
  if (!is_inside(library, fs::path(record.folder))) {
    record.error = "library '" + clip(record.manifest.library) + "' resolves to " + clip(library.string()) +
                   ", outside the plugin folder " + clip(record.folder) + " that holds the manifest: refused, not opened";
    return;
  }
  record.library_path = library.string();  // resolved, so at most PATH_MAX: kept whole (plugins.py reads it)
  const fs::file_status status = fs::status(library, ec);
  if (ec || !fs::is_regular_file(status)) {
    record.error = "library " + record.library_path + " is not a regular file" +
                   (fs::is_directory(status) ? " (a directory)" : "") + (ec ? ": " + ec.message() : "");
    return;
  }
  auto shared = std::make_unique<boost::dll::shared_library>();
  ec.clear();
  dlerror();  // clear any earlier loader message
  shared->load(library, boost::dll::load_mode::rtld_local | boost::dll::load_mode::rtld_now, ec);
  if (ec) {
    // Boost.DLL reports every dlopen failure as "Bad file descriptor"; the loader's own message says why.
    const char* why = dlerror();
    record.error = "library " + record.library_path + " cannot be loaded: " + clip(why ? why : ec.message(), 1000);
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
  record.library_version = clip(info->family_version ? info->family_version : "", 100);
  if (record.library_version != record.version) {
    record.error = "library " + record.library_path + " is version '" + record.library_version + "' of family '" +
                   record.family + "' but its manifest says version '" + record.version + "'";
    return;
  }
  if (!info->create_family) {  // as LLVM refuses a plugin whose registration callback is empty
    record.error = "library " + record.library_path + ": plugin info has no create_family (a null factory)";
    return;
  }
  char message[512] = {0};
  void* object = nullptr;
  if (info->create_family(&object, message, sizeof(message)) != 0 || !object) {
    message[sizeof(message) - 1] = '\0';  // a factory that filled the buffer to the end
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
