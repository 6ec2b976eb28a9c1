#include <doctest/doctest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "tree_recurrence/registry.h"

using namespace tree_recurrence;

namespace {
std::map<std::string, const PluginRecord*> by_manifest_name(const std::vector<const PluginRecord*>& records) {
  std::map<std::string, const PluginRecord*> out;
  for (const auto* r : records) out[r->manifest_path.substr(r->manifest_path.rfind('/') + 1)] = r;
  return out;
}

// The record of manifest `name` was refused with an error containing `expected`.
void check_refused(const std::map<std::string, const PluginRecord*>& records, const char* name, const char* expected) {
  CAPTURE(name);
  REQUIRE(records.count(name) == 1);
  const PluginRecord* r = records.at(name);
  CAPTURE(r->error);
  CHECK_FALSE(r->loaded);
  CHECK(r->error.find(expected) != std::string::npos);
}
}  // namespace

TEST_SUITE("Registry") {
  TEST_CASE("every failure mode is reported and skipped and the good plugin loads") {
    auto records = by_manifest_name(Registry::instance().discover({TEST_PLUGIN_DIR}));
    REQUIRE(records.size() == 12);  // one per manifest in tests/plugins/manifests
    const PluginRecord* good = records.at("test_good.yaml");
    CHECK(good->loaded);
    CHECK(good->error.empty());
    REQUIRE(good->family_object != nullptr);
    CHECK(good->family_object->kernels().at(0).name == "test_kernel");
    ModuleDescription mixer{"model.layers.0.mixer", "TestMixer", "test_model", {}, {}};
    CHECK(good->family_object->detect(mixer).claimed);
    mixer.class_name = "SomethingElse";
    CHECK_FALSE(good->family_object->detect(mixer).claimed);

    auto refused = [&](const char* name, const char* expected) { check_refused(records, name, expected); };
    refused("test_missing_library.yaml", "libtest_does_not_exist.so named by the manifest does not exist");
    refused("test_bad_yaml.yaml", "invalid YAML");
    refused("test_missing_field.yaml", "missing field 'models'");
    refused("test_wrong_abi.yaml", "plugin ABI version 42, this core speaks version 1");
    refused("test_wrong_fingerprint.yaml", "build fingerprint mismatch: the plugin was built for torch 0.0.1-other-torch");
    refused("test_no_entry.yaml", "has no entry symbol 'tree_recurrence_plugin_info'");
    refused("test_factory_throws.yaml", "family factory failed: test factory refuses to build");
    refused("test_null_factory.yaml", "plugin info has no create_family (a null factory)");
    refused("test_wrong_version.yaml", "is version '2.0.0' of family 'test_wrong_version' but its manifest says version '1.0.0'");
    CHECK(records.at("test_good.yaml")->library_version == "1.0.0");
    refused("test_zz_duplicate.yaml", "family 'test_good' is already loaded");
#ifndef TREE_RECURRENCE_SANITIZER_BUILD  // the sanitizer build has no torch, so no torch-linked test plugin
    refused("test_bad_schema.yaml", "family factory failed:");
#else
    refused("test_bad_schema.yaml", "named by the manifest does not exist");
#endif
  }

  TEST_CASE("discovering a folder again adds nothing") {
    Registry::instance().discover({TEST_PLUGIN_DIR});
    const size_t known = Registry::instance().records().size();
    CHECK(Registry::instance().discover({TEST_PLUGIN_DIR}).empty());
    CHECK(Registry::instance().records().size() == known);
  }

#ifndef TREE_RECURRENCE_SANITIZER_BUILD
  TEST_CASE("the three family plugins load with their manifests") {
    Registry::instance().discover({REAL_PLUGIN_DIR});
    for (const char* family : {"gated_delta_net", "mamba2", "short_conv"}) {
      CAPTURE(family);
      const PluginRecord* r = Registry::instance().loaded_family(family);
      REQUIRE(r != nullptr);
      CHECK(r->manifest.op_namespace == std::string("tree_recurrence_") + family);
      CHECK_FALSE(r->manifest.models.empty());
      CHECK(r->fingerprint == core_fingerprint());
    }
  }

#endif

  TEST_CASE("manifest schema errors name the field") {
    CHECK_THROWS_WITH_AS(parse_manifest(YAML::Load("schema: 2"), "m.yaml"), doctest::Contains("schema 2 is not supported"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(parse_manifest(YAML::Load("schema: 1\nfamily: Bad-Name\nversion: 1\nlibrary: x"), "m.yaml"),
                         doctest::Contains("must be lower-case"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(
        parse_manifest(YAML::Load("schema: 1\nfamily: f\nversion: 1\nlibrary: x\nmodels: [{model_type: a, module: m}]\nseams: {}"),
                       "m.yaml"),
        doctest::Contains("models[0]: missing field 'mixers'"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(parse_manifest(YAML::Load("schema: 1\nfamily: f\nversion: 1\nlibrary: x\nmodels: "
                                                   "[{model_type: a, module: m, mixers: [M], layer_types: [t]}]\nseams: {s: 3}"),
                                        "m.yaml"),
                         doctest::Contains("seam 's' must be a mapping with an 'adapter' field"), std::invalid_argument);
  }

  TEST_CASE("hostile plugin folders give one refused entry each and nothing outside a folder is opened") {
    // issue 12 items 4-7: these threw filesystem_error out of discover() or loaded libraries from
    // anywhere.
    namespace fs = std::filesystem;
    const fs::path root = fs::temp_directory_path() / ("tree_recurrence_hostile_" + std::to_string(::getpid()));
    fs::remove_all(root);
    fs::create_directories(root / "plugins");
    fs::create_directories(root / "outside");
    fs::copy_file(fs::path(TEST_PLUGIN_DIR) / "libtest_factory_throws.so", root / "outside" / "libx.so");
    auto write = [](const fs::path& path, const std::string& text) { std::ofstream(path) << text; };
    auto manifest = [](const std::string& family, const std::string& library) {
      return "schema: 1\nfamily: " + family + "\nversion: 1\nlibrary: " + library +
             "\nmodels: [{model_type: a, module: m, mixers: [M], layer_types: [t]}]\nseams: {s: {adapter: conv}}\n";
    };
    const fs::path plugins = root / "plugins";
    write(plugins / "up.yaml", manifest("up", "../outside/libx.so"));
    write(plugins / "absolute.yaml", manifest("absolute", (root / "outside" / "libx.so").string()));
    fs::create_symlink(plugins / "loop.yaml", plugins / "loop.yaml");
    fs::create_symlink(plugins / "libloop.so", plugins / "libloop.so");
    write(plugins / "library_loop.yaml", manifest("library_loop", "libloop.so"));
    write(plugins / "long_name.yaml", manifest("long_name", std::string(300, 'l') + ".so"));
    std::string bomb = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n";
    for (int i = 1; i < 9; ++i) {
      bomb += "a" + std::to_string(i) + ": &a" + std::to_string(i) + " [";
      for (int j = 0; j < 10; ++j) bomb += (j ? ", *a" : "*a") + std::to_string(i - 1);
      bomb += "]\n";
    }
    write(plugins / "bomb.yaml", bomb + manifest("bomb", "libnothing.so"));
    write(plugins / "nul.yaml", manifest("nul", "\"libx.so\\0../outside/libx.so\""));
    fs::create_directory(plugins / "adir.so");
    write(plugins / "directory.yaml", manifest("directory", "adir.so"));

    std::vector<const PluginRecord*> added;
    REQUIRE_NOTHROW(added = Registry::instance().discover({plugins.string(), std::string(6000, 'x')}));
    auto records = by_manifest_name(added);
    auto refused = [&](const char* name, const char* expected) { check_refused(records, name, expected); };
    refused("up.yaml", "outside the plugin folder");
    refused("absolute.yaml", "outside the plugin folder");
    refused("loop.yaml", "Too many levels of symbolic links");
    refused("library_loop.yaml", "Too many levels of symbolic links");
    refused("long_name.yaml", "File name too long");
    refused("bomb.yaml", "once aliases are expanded");
    refused("nul.yaml", "contains a NUL character");
    refused("directory.yaml", "is not a regular file (a directory)");
    bool long_folder = false;
    for (const auto* r : added) long_folder |= r->error.find("File name too long") != std::string::npos && r->error.size() < 1000 &&
                                               r->error.find("plugin folder") == 0;
    CHECK(long_folder);
    fs::remove_all(root);
  }
}
