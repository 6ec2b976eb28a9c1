// Registry: discovers family plugins (YAML manifest + shared library) and loads them for the
// lifetime of the process.
//
// Discovery order: the folders given to discover(), in order (the Python package passes its own
// plugin folder, then TREE_RECURRENCE_PLUGIN_PATH, then folders registered at run time). Every
// `*.yaml` file in a folder is a manifest. Each failure (unreadable or invalid manifest, missing
// library, missing entry symbol, wrong ABI version, wrong build fingerprint, a factory that
// throws, a family name already loaded) refuses that plugin with a message naming the file and
// what was expected, and the others still load. Libraries are opened RTLD_LOCAL and never closed:
// they register torch ops, which must outlive every caller.
//
// Plugin folders are input too (docs/plugins.md, "Trust"): a manifest's library must resolve,
// after symlinks, to a regular file inside the folder that holds the manifest, else it is refused
// and never opened; manifests are regular files of at most kMaxManifestBytes whose YAML expands
// (aliases included) to at most kMaxManifestNodes nodes; every filesystem error (symlink loops,
// over-long names or paths, permissions) refuses that one entry with its reason, never throws.
#pragma once

#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tree_recurrence/sdk/family.h"

namespace tree_recurrence {

constexpr size_t kMaxManifestBytes = 1 << 20;
constexpr size_t kMaxManifestNodes = 100000;
constexpr size_t kMaxManifestDepth = 64;

// `text` cut to at most `limit` bytes (with a note saying how long it was), for error messages.
std::string clip(const std::string& text, size_t limit = 300);

struct PluginRecord {
  std::string manifest_path;
  std::string folder;  // the plugin folder the manifest was found in (canonical when it resolves)
  std::string library_path;
  std::string family;   // from the manifest (or the file name when the manifest is unreadable)
  std::string version;          // the manifest's family version
  std::string library_version;  // the family version the library declares (must equal the manifest's)
  bool loaded = false;
  std::string error;        // why the plugin was refused (empty when loaded)
  std::string fingerprint;  // the library's build fingerprint, as text
  FamilyManifest manifest;
  YAML::Node manifest_node;          // the whole manifest, for the Python driver's seam specs
  TreeFamily* family_object = nullptr;  // owned by the process, never destroyed
};

// The fingerprint this process's core was built with, as text.
std::string core_fingerprint();

// Parses and validates a manifest; throws std::invalid_argument naming the file and the field.
FamilyManifest parse_manifest(const YAML::Node& node, const std::string& origin);

class Registry {
 public:
  static Registry& instance();  // process-lifetime; never destroyed

  // Scans each folder for manifests and loads what is new. Returns the records added.
  std::vector<const PluginRecord*> discover(const std::vector<std::string>& folders);
  std::vector<const PluginRecord*> records() const;
  const PluginRecord* loaded_family(const std::string& family) const;

 private:
  Registry() = default;
  void load(PluginRecord& record, const std::filesystem::path& manifest);
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<PluginRecord>> records_;
};

}  // namespace tree_recurrence
