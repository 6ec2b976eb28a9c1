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
#pragma once

#include <yaml-cpp/yaml.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tree_recurrence/sdk/family.h"

namespace tree_recurrence {

struct PluginRecord {
  std::string manifest_path;
  std::string library_path;
  std::string family;   // from the manifest (or the file name when the manifest is unreadable)
  std::string version;
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
  void load(PluginRecord& record);
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<PluginRecord>> records_;
};

}  // namespace tree_recurrence
