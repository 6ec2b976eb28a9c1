// Every environment variable the library reads, declared once: its name, kind, default and one line
// of documentation. C++ reads them through the accessors below (the core, the shared ops library, the
// plugins); Python gets the same table and the same parsers from the core module
// (`tree_recurrence.settings`) and reads its own through them; `python -m tree_recurrence doctor` lists
// them with their current values. Nothing else in the library calls getenv / os.environ for a
// TREE_RECURRENCE_* name, and no kernel file reads the environment at all
// (tests/python/test_settings.py checks the tree).
//
// Values are read when asked (a process may change them between calls; tests do), never cached in a
// kernel file. An unset or empty variable has its fallback. A flag accepts 1 / 0, true / false,
// yes / no, on / off (any case, surrounding blanks ignored); a count a non-negative decimal integer;
// a choice one of its listed values; anything else is a std::invalid_argument naming the variable.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace tree_recurrence::settings {

enum class Kind { Flag, Count, Choice, Path, PathList, Names };

struct Setting {
  const char* name;
  Kind kind;
  const char* fallback;  // the value when unset or empty
  const char* doc;
  const char* choices = nullptr;  // Kind::Choice: the accepted values, space-separated
};

// Indices into kAll.
enum Id : int {
  PluginPath = 0,
  DisableFamilies,
  PolicyFile,
  Strategy,
  PreferNative,
  ForkMinSavedTokens,
  Fused,
  SsdRecomputeY,
  TestOps,
  LargeTests,
  kCount
};

inline constexpr Setting kAll[kCount] = {
    {"TREE_RECURRENCE_PLUGIN_PATH", Kind::PathList, "",
     "more plugin folders (':'-separated), searched after the installed plugins"},
    {"TREE_RECURRENCE_DISABLE_FAMILIES", Kind::Names, "",
     "family names (comma-separated) not to load: their layers run as transformers wrote them"},
    {"TREE_RECURRENCE_POLICY_FILE", Kind::Path, "", "a YAML policy file, read before the three policy variables"},
    {"TREE_RECURRENCE_STRATEGY", Kind::Choice, "auto", "route of every seam call: auto, native, fork or rescan",
     "auto native fork rescan"},
    {"TREE_RECURRENCE_PREFER_NATIVE", Kind::Flag, "1", "auto takes the native tree kernel where one runs"},
    {"TREE_RECURRENCE_FORK_MIN_SAVED_TOKENS", Kind::Count, "1024",
     "auto forks over the bound kernel when each extra call saves at least this many tokens"},
    {"TREE_RECURRENCE_FUSED", Kind::Flag, "1",
     "the fused CUDA kernels (GDN, SSD); 0 runs the ATen composites instead (the kill switch)"},
    {"TREE_RECURRENCE_SSD_RECOMPUTE_Y", Kind::Flag, "0",
     "memory mode of the fused SSD path: the backward recomputes the pre-gate y instead of saving it"},
    {"TREE_RECURRENCE_TEST_OPS", Kind::Flag, "0", "register the float64 oracles and kernel stage ops (tests)"},
    {"TREE_RECURRENCE_LARGE_TESTS", Kind::Flag, "0", "run the 2^31-element GPU tests (tests)"},
};

// The declared setting of that name, or null.
inline const Setting* find(std::string_view name) {
  for (const Setting& s : kAll)
    if (name == s.name) return &s;
  return nullptr;
}

// Whether the variable is set to a non-empty value (a set variable overrides a policy file's key).
inline bool is_set(Id id) {
  const char* v = std::getenv(kAll[id].name);
  return v != nullptr && *v != '\0';
}

// The raw text: the variable's value, or its fallback when unset or empty.
inline std::string text(Id id) { return is_set(id) ? std::string(std::getenv(kAll[id].name)) : kAll[id].fallback; }

inline std::string trimmed(const std::string& value) {
  const size_t begin = value.find_first_not_of(" \t\r\n");
  if (begin == std::string::npos) return "";
  return value.substr(begin, value.find_last_not_of(" \t\r\n") + 1 - begin);
}

// Parses a flag's text; throws std::invalid_argument naming the variable otherwise.
inline bool parse_flag(const char* name, const std::string& value) {
  std::string v;
  for (char c : trimmed(value)) v += static_cast<char>((c >= 'A' && c <= 'Z') ? c - 'A' + 'a' : c);
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  throw std::invalid_argument(std::string(name) + " must be 1 or 0 (true / false, yes / no, on / off), got '" +
                              value + "'");
}

// Parses a count's text; throws std::invalid_argument naming the variable otherwise.
inline int64_t parse_count(const char* name, const std::string& value) {
  const std::string v = trimmed(value);
  bool digits = !v.empty() && v.size() <= 18;
  for (char c : v) digits = digits && c >= '0' && c <= '9';
  if (digits) return std::stoll(v);
  throw std::invalid_argument(std::string(name) + " must be a non-negative integer, got '" + value + "'");
}

// Splits `value` at any of `separators`, dropping blanks around the pieces and empty pieces.
inline std::vector<std::string> split(const std::string& value, std::string_view separators) {
  std::vector<std::string> out;
  size_t begin = 0;
  while (begin <= value.size()) {
    size_t end = value.find_first_of(separators, begin);
    if (end == std::string::npos) end = value.size();
    std::string piece = trimmed(value.substr(begin, end - begin));
    if (!piece.empty()) out.push_back(std::move(piece));
    begin = end + 1;
  }
  return out;
}

// Parses a choice's text (one of setting.choices); throws std::invalid_argument naming the variable
// and the accepted values otherwise.
inline std::string parse_choice(const Setting& setting, const std::string& value) {
  const std::string v = trimmed(value);
  const std::vector<std::string> accepted = split(setting.choices ? setting.choices : "", " ");
  for (const std::string& choice : accepted)
    if (v == choice) return v;
  std::string list;
  for (const std::string& choice : accepted) list += (list.empty() ? "" : ", ") + choice;
  throw std::invalid_argument(std::string(setting.name) + " must be one of " + list + ", got '" + value + "'");
}

// The pieces of a path list (':'-separated) or a name list (comma-separated; ':' also separates).
inline std::vector<std::string> parse_list(const Setting& setting, const std::string& value) {
  if (setting.kind == Kind::PathList) {
    std::vector<std::string> out;  // a path keeps its blanks
    size_t begin = 0;
    while (begin <= value.size()) {
      size_t end = value.find(':', begin);
      if (end == std::string::npos) end = value.size();
      if (end > begin) out.push_back(value.substr(begin, end - begin));
      begin = end + 1;
    }
    return out;
  }
  return split(value, ",:");
}

inline bool flag(Id id) { return parse_flag(kAll[id].name, text(id)); }
inline int64_t count(Id id) { return parse_count(kAll[id].name, text(id)); }
inline std::string choice(Id id) { return parse_choice(kAll[id], text(id)); }
inline std::vector<std::string> list(Id id) { return parse_list(kAll[id], text(id)); }

inline const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Flag: return "flag";
    case Kind::Count: return "count";
    case Kind::Choice: return "choice";
    case Kind::Path: return "path";
    case Kind::PathList: return "path list";
    case Kind::Names: return "names";
  }
  return "?";
}

// The fused CUDA kernels may run (TREE_RECURRENCE_FUSED, the one kill switch).
inline bool fused_kernels() { return flag(Fused); }
// The fused SSD path's memory mode (TREE_RECURRENCE_SSD_RECOMPUTE_Y).
inline bool ssd_recompute_y() { return flag(SsdRecomputeY); }
// The test-only ops are registered (TREE_RECURRENCE_TEST_OPS).
inline bool test_ops() { return flag(TestOps); }

}  // namespace tree_recurrence::settings
