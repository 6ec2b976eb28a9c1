# The deliberately broken test plugins, shared by the main build (tests/plugins/CMakeLists.txt) and
# the sanitizer build (tests/cpp/asan/CMakeLists.txt), so both build the same set. A plugin's
# position in this list is its BROKEN_MODE in broken_family.cpp.
set(TREE_RECURRENCE_BROKEN_PLUGINS
  test_good test_wrong_abi test_wrong_fingerprint test_no_entry test_factory_throws test_null_factory
  test_wrong_version)
