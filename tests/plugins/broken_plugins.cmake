# The deliberately broken test plugins, shared by the main build (tests/plugins/CMakeLists.txt) and
# the sanitizer build (tests/cpp/asan/CMakeLists.txt), so both build the same set. A plugin's
# position in this list is its BROKEN_MODE in broken_family.cpp.
set(TREE_RECURRENCE_BROKEN_PLUGINS
  test_good test_wrong_abi test_wrong_fingerprint test_no_entry test_factory_throws test_null_factory
  test_wrong_version)

# Builds every plugin of the list with the caller's test_plugin(name mode) and copies the manifests of
# `manifests_dir` into `out` (the folder the registry tests discover).
macro(tree_recurrence_broken_plugins out manifests_dir)
  foreach(name IN LISTS TREE_RECURRENCE_BROKEN_PLUGINS)
    list(FIND TREE_RECURRENCE_BROKEN_PLUGINS ${name} mode)
    test_plugin(${name} ${mode})
  endforeach()
  file(GLOB manifests "${manifests_dir}/*.yaml")
  foreach(m ${manifests})
    get_filename_component(n "${m}" NAME)
    configure_file("${m}" "${out}/${n}" COPYONLY)
  endforeach()
endmacro()
