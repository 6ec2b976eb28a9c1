// The plugin ABI: one extern "C" entry point per family library.
//
// Contract: the loader resolves `tree_recurrence_plugin_info`, reads the returned POD struct and
// checks `abi_version`, `struct_size` and the build fingerprint BEFORE calling anything else.
// The struct only grows at its end; `struct_size` tells the loader which fields exist.
// No exception crosses `create_family`: it returns 0 and sets `*out`, or returns non-zero and
// writes a message into `error` (at most `error_size` bytes, NUL-terminated).
#pragma once

#include <cstddef>
#include <cstdint>

#define TREE_RECURRENCE_ABI_VERSION 1u
#define TREE_RECURRENCE_ENTRY_SYMBOL "tree_recurrence_plugin_info"

extern "C" {

struct TreeRecurrenceFingerprint {
  const char* torch_version;  // e.g. "2.11.0"
  int32_t cxx11_abi;          // value of _GLIBCXX_USE_CXX11_ABI the library was built with
  const char* cuda_version;   // "" when built without CUDA kernels
  const char* cuda_archs;     // e.g. "90", "" without CUDA
};

struct TreeRecurrencePluginInfo {
  uint32_t abi_version;
  uint32_t struct_size;
  const char* family_name;
  const char* family_version;
  TreeRecurrenceFingerprint fingerprint;
  // Creates the family object (a tree_recurrence::TreeFamily*), owned by the loader forever.
  int32_t (*create_family)(void** out, char* error, size_t error_size);
};

typedef const TreeRecurrencePluginInfo* (*TreeRecurrencePluginInfoFn)();
}
