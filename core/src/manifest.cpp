#include <stdexcept>

#include "tree_recurrence/registry.h"

namespace tree_recurrence {
namespace {

[[noreturn]] void bad(const std::string& origin, const std::string& what) {
  throw std::invalid_argument("manifest " + origin + ": " + what);
}

std::string scalar(const YAML::Node& node, const std::string& key, const std::string& origin) {
  const YAML::Node value = node[key];
  if (!value) bad(origin, "missing field '" + key + "'");
  if (!value.IsScalar()) bad(origin, "field '" + key + "' must be a string");
  return value.as<std::string>();
}

std::vector<std::string> strings(const YAML::Node& node, const std::string& key, const std::string& origin, bool required) {
  const YAML::Node value = node[key];
  if (!value) {
    if (required) bad(origin, "missing field '" + key + "'");
    return {};
  }
  if (!value.IsSequence()) bad(origin, "field '" + key + "' must be a list of strings");
  std::vector<std::string> out;
  for (const auto& item : value) {
    if (!item.IsScalar()) bad(origin, "field '" + key + "' must be a list of strings");
    out.push_back(item.as<std::string>());
  }
  return out;
}

bool is_identifier(const std::string& name) {
  if (name.empty()) return false;
  for (char c : name)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) return false;
  return true;
}

}  // namespace

FamilyManifest parse_manifest(const YAML::Node& node, const std::string& origin) {
  if (!node.IsMap()) bad(origin, "must be a YAML mapping");
  const std::string schema = scalar(node, "schema", origin);
  if (schema != "1") bad(origin, "schema " + schema + " is not supported, expected 1");
  FamilyManifest m;
  m.family = scalar(node, "family", origin);
  if (m.family.size() > 64) bad(origin, "family name is " + std::to_string(m.family.size()) + " characters long, at most 64");
  if (!is_identifier(m.family)) bad(origin, "family '" + clip(m.family) + "' must be lower-case letters, digits and '_'");
  m.version = scalar(node, "version", origin);
  m.library = scalar(node, "library", origin);
  if (m.library.find('\0') != std::string::npos)
    bad(origin, "field 'library' contains a NUL character (a file name cannot): '" + clip(m.library.substr(0, m.library.find('\0'))) + "\\0...'");
  if (m.library.empty()) bad(origin, "field 'library' is empty");
  m.op_namespace = "tree_recurrence_" + m.family;
  const YAML::Node models = node["models"];
  if (!models) bad(origin, "missing field 'models'");
  if (!models.IsSequence() || models.size() == 0) bad(origin, "field 'models' must be a non-empty list");
  for (size_t i = 0; i < models.size(); ++i) {
    const std::string where = origin + " models[" + std::to_string(i) + "]";
    if (!models[i].IsMap()) bad(where, "must be a mapping");
    ModelEntry entry;
    entry.model_type = scalar(models[i], "model_type", where);
    entry.module = scalar(models[i], "module", where);
    entry.mixers = strings(models[i], "mixers", where, true);
    entry.layer_types = strings(models[i], "layer_types", where, true);
    entry.plan_carriers = strings(models[i], "plan_carriers", where, false);
    m.models.push_back(std::move(entry));
  }
  const YAML::Node seams = node["seams"];
  if (!seams) bad(origin, "missing field 'seams'");
  if (!seams.IsMap()) bad(origin, "field 'seams' must be a mapping of seam name to adapter");
  for (const auto& seam : seams) {
    const std::string name = seam.first.as<std::string>();
    if (!seam.second.IsMap() || !seam.second["adapter"])
      bad(origin, "seam '" + name + "' must be a mapping with an 'adapter' field");
    m.seams.push_back(name);
  }
  return m;
}

}  // namespace tree_recurrence
