#include <doctest/doctest.h>

#include <map>

#include "tree_recurrence/registry.h"

using namespace tree_recurrence;

namespace {
std::map<std::string, const PluginRecord*> by_manifest_name(const std::vector<const PluginRecord*>& records) {
  std::map<std::string, const PluginRecord*> out;
  for (const auto* r : records) out[r->manifest_path.substr(r->manifest_path.rfind('/') + 1)] = r;
  return out;
}
}  // namespace

TEST_SUITE("Registry") {
  TEST_CASE("every failure mode is reported and skipped; the good plugin loads") {
    auto records = by_manifest_name(Registry::instance().discover({TEST_PLUGIN_DIR}));
    REQUIRE(records.size() == 10);
    const PluginRecord* good = records.at("test_good.yaml");
    CHECK(good->loaded);
    CHECK(good->error.empty());
    REQUIRE(good->family_object != nullptr);
    CHECK(good->family_object->kernels().at(0).name == "test_kernel");
    ModuleDescription mixer{"model.layers.0.mixer", "TestMixer", "test_model", {}, {}};
    CHECK(good->family_object->detect(mixer).claimed);
    mixer.class_name = "SomethingElse";
    CHECK_FALSE(good->family_object->detect(mixer).claimed);

    auto refused = [&](const char* name, const char* expected) {
      const PluginRecord* r = records.at(name);
      CAPTURE(name);
      CAPTURE(r->error);
      CHECK_FALSE(r->loaded);
      CHECK(r->error.find(expected) != std::string::npos);
    };
    refused("test_missing_library.yaml", "libtest_does_not_exist.so named by the manifest does not exist");
    refused("test_bad_yaml.yaml", "invalid YAML");
    refused("test_missing_field.yaml", "missing field 'models'");
    refused("test_wrong_abi.yaml", "plugin ABI version 42, this core speaks version 1");
    refused("test_wrong_fingerprint.yaml", "build fingerprint mismatch: the plugin was built for torch 0.0.1-other-torch");
    refused("test_no_entry.yaml", "has no entry symbol 'tree_recurrence_plugin_info'");
    refused("test_factory_throws.yaml", "family factory failed: test factory refuses to build");
    refused("test_zz_duplicate.yaml", "family 'test_good' is already loaded");
    refused("test_bad_schema.yaml", "family factory failed:");
  }

  TEST_CASE("discovering a folder again adds nothing") {
    Registry::instance().discover({TEST_PLUGIN_DIR});
    const size_t known = Registry::instance().records().size();
    CHECK(Registry::instance().discover({TEST_PLUGIN_DIR}).empty());
    CHECK(Registry::instance().records().size() == known);
  }

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
}
