# tree_recurrence_add_family(<name> SOURCES ... [CUDA_SOURCES ...] MANIFEST <family.yaml>
#                            [PYTHON <folder>] [LINK ...] [OUTPUT_DIR <dir>] [INSTALL_DIR <dir>])
#
# Builds the family plugin library `tree_recurrence_<name>` (a MODULE library loaded at run time)
# against LibTorch, stamps it with the build fingerprint the registry checks (torch version,
# _GLIBCXX_USE_CXX11_ABI from torch's flags, CUDA version and archs), and places its manifest next
# to it. The op namespace is `tree_recurrence_<name>`, passed as TREE_RECURRENCE_OP_NAMESPACE so it
# is never typed twice. The plugin links the shared ops library (TreeRecurrence::ops, sdk/shared_ops.h), which
# registers the ops families share (torch.ops.tree_recurrence.tree_conv, .chunk_state_pass) once for all. PYTHON names the family's Python folder (library stand-ins, component adapters:
# the manifest's `python:` modules); its *.py files go next to the manifest as the folder <name>/, where
# the engine imports them from.
function(tree_recurrence_fingerprint_definitions target)
  set(cuda_version "")
  set(cuda_archs "")
  if(CMAKE_CUDA_COMPILER_VERSION)
    set(cuda_version "${CMAKE_CUDA_COMPILER_VERSION}")
    string(REPLACE ";" "," cuda_archs "${CMAKE_CUDA_ARCHITECTURES}")
  elseif(TREE_RECURRENCE_SDK_CUDA_VERSION)
    # Out of tree, without a CUDA compiler of its own (the installed TreeRecurrenceSDKConfig.cmake sets these):
    # the family links the package's prebuilt CUDA kernels, so it carries their CUDA version and archs.
    set(cuda_version "${TREE_RECURRENCE_SDK_CUDA_VERSION}")
    set(cuda_archs "${TREE_RECURRENCE_SDK_CUDA_ARCHS}")
  endif()
  target_compile_definitions(${target} PRIVATE
    TREE_RECURRENCE_TORCH_VERSION="${Torch_VERSION}"
    TREE_RECURRENCE_CUDA_VERSION="${cuda_version}"
    TREE_RECURRENCE_CUDA_ARCHS="${cuda_archs}")
endfunction()

function(tree_recurrence_add_family name)
  cmake_parse_arguments(ARG "" "MANIFEST;PYTHON;OUTPUT_DIR;INSTALL_DIR" "SOURCES;CUDA_SOURCES;LINK" ${ARGN})
  set(target tree_recurrence_${name})
  set(sources ${ARG_SOURCES})
  if(CMAKE_CUDA_COMPILER AND ARG_CUDA_SOURCES)
    list(APPEND sources ${ARG_CUDA_SOURCES})
  endif()
  add_library(${target} MODULE ${sources})
  target_link_libraries(${target} PRIVATE ${TORCH_LIBRARIES} ${ARG_LINK})
  if(TARGET TreeRecurrence::sdk)
    target_link_libraries(${target} PRIVATE TreeRecurrence::sdk)
  endif()
  # The shared ops library (sdk/shared_ops.h): the C++ functions of the shared ops (chunk_state_pass, tree_conv).
  if(TARGET TreeRecurrence::ops)
    target_link_libraries(${target} PRIVATE TreeRecurrence::ops)
  endif()
  target_compile_definitions(${target} PRIVATE TREE_RECURRENCE_OP_NAMESPACE=tree_recurrence_${name})
  if(CMAKE_CUDA_COMPILER AND ARG_CUDA_SOURCES)
    target_compile_definitions(${target} PRIVATE TREE_RECURRENCE_WITH_CUDA=1)
  endif()
  tree_recurrence_fingerprint_definitions(${target})
  set_target_properties(${target} PROPERTIES PREFIX "lib" CXX_VISIBILITY_PRESET hidden)
  if(ARG_INSTALL_DIR AND TARGET tree_recurrence_ops)
    # In the package: plugins/ next to sdk/lib/, where the shared ops library is installed.
    set_target_properties(${target} PROPERTIES INSTALL_RPATH "$ORIGIN/../sdk/lib")
  elseif(ARG_INSTALL_DIR AND TARGET TreeRecurrence::ops)
    # Out of tree: the installed package's sdk/lib/ (the Python package also loads the library before any plugin).
    get_target_property(_tr_ops_location TreeRecurrence::ops IMPORTED_LOCATION)
    get_filename_component(_tr_ops_dir "${_tr_ops_location}" DIRECTORY)
    set_target_properties(${target} PROPERTIES INSTALL_RPATH "${_tr_ops_dir}")
  endif()
  if(NOT ARG_OUTPUT_DIR)
    set(ARG_OUTPUT_DIR "${CMAKE_BINARY_DIR}/plugins")
  endif()
  set_target_properties(${target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY "${ARG_OUTPUT_DIR}")
  if(ARG_MANIFEST)
    configure_file("${ARG_MANIFEST}" "${ARG_OUTPUT_DIR}/${name}.yaml" COPYONLY)
  endif()
  if(ARG_PYTHON)
    get_filename_component(python_dir "${ARG_PYTHON}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
    file(GLOB python_files CONFIGURE_DEPENDS "${python_dir}/*.py")
    foreach(file IN LISTS python_files)
      get_filename_component(file_name "${file}" NAME)
      configure_file("${file}" "${ARG_OUTPUT_DIR}/${name}/${file_name}" COPYONLY)
    endforeach()
  endif()
  if(ARG_INSTALL_DIR)
    install(TARGETS ${target} LIBRARY DESTINATION "${ARG_INSTALL_DIR}")
    if(ARG_MANIFEST)
      install(FILES "${ARG_MANIFEST}" DESTINATION "${ARG_INSTALL_DIR}" RENAME "${name}.yaml")
    endif()
    if(ARG_PYTHON)
      install(FILES ${python_files} DESTINATION "${ARG_INSTALL_DIR}/${name}")
    endif()
  endif()
endfunction()
