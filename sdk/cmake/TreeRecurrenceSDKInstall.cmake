# Installs the SDK into the wheel, under tree_recurrence/sdk/ (included from sdk/CMakeLists.txt):
#
#   include/tree_recurrence/{sdk,kernels}/*.h   the public headers
#   lib/libtree_recurrence_kernels.a            the shared kernels (tree conv, state pass; CPU, and CUDA when built), PIC
#   lib/libtree_recurrence_ops.so               the shared torch ops (torch.ops.tree_recurrence.*; sdk/shared_ops.h)
#   cmake/TreeRecurrenceSDKConfig.cmake         find_package(TreeRecurrenceSDK): imported targets, Torch, and
#   cmake/TreeRecurrenceSDKConfigVersion.cmake  tree_recurrence_add_family() stamping this build's fingerprint
#   cmake/TreeRecurrenceFamily.cmake
#
# `python -m tree_recurrence sdk --cmake-dir` prints the cmake folder of the installed package.
set(_tr_sdk_dest tree_recurrence/sdk)

install(DIRECTORY "${PROJECT_SOURCE_DIR}/sdk/include/" DESTINATION ${_tr_sdk_dest}/include FILES_MATCHING PATTERN "*.h")
install(TARGETS tree_recurrence_kernels ARCHIVE DESTINATION ${_tr_sdk_dest}/lib)
install(TARGETS tree_recurrence_ops LIBRARY DESTINATION ${_tr_sdk_dest}/lib)

# The fingerprint every library of this build carries (sdk/include/tree_recurrence/sdk/fingerprint.h): the
# installed config records it so that an out-of-tree family is built for the same torch, C++ ABI and CUDA.
string(REGEX MATCH "_GLIBCXX_USE_CXX11_ABI=([01])" _tr_abi_flag "${CMAKE_CXX_FLAGS}")
if(_tr_abi_flag)
  set(TREE_RECURRENCE_SDK_CXX11_ABI "${CMAKE_MATCH_1}")
else()
  set(TREE_RECURRENCE_SDK_CXX11_ABI "1")
endif()
set(TREE_RECURRENCE_SDK_TORCH_VERSION "${Torch_VERSION}")
set(TREE_RECURRENCE_SDK_CUDA_VERSION "")
set(TREE_RECURRENCE_SDK_CUDA_ARCHS "")
if(CMAKE_CUDA_COMPILER)
  set(TREE_RECURRENCE_SDK_CUDA_VERSION "${CMAKE_CUDA_COMPILER_VERSION}")
  string(REPLACE ";" "," TREE_RECURRENCE_SDK_CUDA_ARCHS "${CMAKE_CUDA_ARCHITECTURES}")
endif()
file(READ "${PROJECT_SOURCE_DIR}/sdk/include/tree_recurrence/sdk/abi.h" _tr_abi_header)
string(REGEX MATCH "#define TREE_RECURRENCE_ABI_VERSION ([0-9]+)" _tr_abi_define "${_tr_abi_header}")
set(TREE_RECURRENCE_SDK_ABI_VERSION "${CMAKE_MATCH_1}")
set(TREE_RECURRENCE_SDK_BUILD_PYTHON "${Python_EXECUTABLE}")
set(TREE_RECURRENCE_SDK_VERSION "${PROJECT_VERSION}")

include(CMakePackageConfigHelpers)
configure_file("${PROJECT_SOURCE_DIR}/sdk/cmake/TreeRecurrenceSDKConfig.cmake.in"
               "${CMAKE_CURRENT_BINARY_DIR}/TreeRecurrenceSDKConfig.cmake" @ONLY)
write_basic_package_version_file("${CMAKE_CURRENT_BINARY_DIR}/TreeRecurrenceSDKConfigVersion.cmake"
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES "${CMAKE_CURRENT_BINARY_DIR}/TreeRecurrenceSDKConfig.cmake"
              "${CMAKE_CURRENT_BINARY_DIR}/TreeRecurrenceSDKConfigVersion.cmake"
              "${PROJECT_SOURCE_DIR}/sdk/cmake/TreeRecurrenceFamily.cmake"
        DESTINATION ${_tr_sdk_dest}/cmake)
