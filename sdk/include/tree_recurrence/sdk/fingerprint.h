// The build fingerprint compiled into every library of this project (core and plugins).
// CMake passes the values as compile definitions taken from torch's CMake package; a library
// built against another torch, C++ ABI or CUDA is refused by the registry with both values named.
#pragma once

#include <cstddef>  // defines _GLIBCXX_USE_CXX11_ABI as this translation unit sees it

#ifndef TREE_RECURRENCE_TORCH_VERSION
#error "TREE_RECURRENCE_TORCH_VERSION must come from the build (tree_recurrence_add_family sets it)"
#endif
#ifndef TREE_RECURRENCE_CUDA_VERSION
#define TREE_RECURRENCE_CUDA_VERSION ""
#endif
#ifndef TREE_RECURRENCE_CUDA_ARCHS
#define TREE_RECURRENCE_CUDA_ARCHS ""
#endif
#ifndef _GLIBCXX_USE_CXX11_ABI
#define TREE_RECURRENCE_CXX11_ABI 1
#else
#define TREE_RECURRENCE_CXX11_ABI _GLIBCXX_USE_CXX11_ABI
#endif

#define TREE_RECURRENCE_FINGERPRINT                                                   \
  TreeRecurrenceFingerprint {                                                         \
    TREE_RECURRENCE_TORCH_VERSION, TREE_RECURRENCE_CXX11_ABI,                         \
        TREE_RECURRENCE_CUDA_VERSION, TREE_RECURRENCE_CUDA_ARCHS                      \
  }
