// tree_recurrence._core: the C++ core as seen from Python. Plans, policies and the registry only;
// tensors never pass through here (kernels are torch ops registered by the plugins). Plan arrays
// leave as copies (bytearrays that torch.frombuffer wraps): nothing Python does to them can reach a
// built plan. Plans are built from buffer objects (1-D contiguous int64), never from addresses.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "tree_recurrence/policy.h"
#include "tree_recurrence/registry.h"
#include "tree_recurrence/sdk/detectors.h"
#include "tree_recurrence/sdk/settings.h"
#include "tree_recurrence/tree_plan.h"

namespace py = pybind11;
using namespace tree_recurrence;

namespace {

// Strings leave C++ for Python only through text() and path_text(), and exceptions through the
// translator the module registers (translate): strings here carry bytes from files anyone who can
// write to a plugin folder chooses (manifest text that yaml-cpp quotes in its errors, file names,
// manifest values, what plugins return), and pybind11's own conversions decode strict UTF-8, so one
// invalid byte would raise UnicodeDecodeError out of plugin discovery.

// `s` as Python text; bytes that are not UTF-8 become \xNN escapes (Python's "backslashreplace").
py::str text(const std::string& s) {
  PyObject* out = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "backslashreplace");
  if (!out) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(out);
}

// A file system path (std::filesystem::path::string(): the bytes the file system holds, on POSIX never
// converted) as os.fsdecode makes it: bytes that are not UTF-8 become surrogates, so the str still names
// the same file (os.fsencode gives the bytes back).
py::str path_text(const std::string& s) {
  PyObject* out = PyUnicode_DecodeFSDefaultAndSize(s.data(), static_cast<Py_ssize_t>(s.size()));
  if (!out) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(out);
}

// A path from Python (str, bytes or os.PathLike) as the bytes the file system sees (os.fsencode): a str
// holding surrogates (a name that is not UTF-8, as os.environ and os.listdir give it) is a valid path
// that pybind11's own str conversion refuses. A NUL byte is refused as Python's os functions refuse it
// (the file system would see the name cut there).
std::string fs_bytes(const py::handle& path) {
  std::string bytes = py::module_::import("os").attr("fsencode")(path).cast<std::string>();
  if (const size_t nul = bytes.find('\0'); nul != std::string::npos)
    throw py::value_error("embedded null byte in path '" + clip(bytes.substr(0, nul), 300) + "\\0...'");
  return bytes;
}

// Sets the Python error `type` with `message` as text: what() of an exception thrown here may quote
// file content (yaml-cpp's messages carry the offending byte).
void raise_text(PyObject* type, const char* message) { PyErr_SetObject(type, text(message).ptr()); }

// pybind11's translation of C++ exceptions (the same Python types), with what() decoded by text().
void translate(std::exception_ptr thrown) {
  try {
    if (thrown) std::rethrow_exception(thrown);
  } catch (const py::error_already_set&) {
    throw;  // already a Python error: pybind11 restores it
  } catch (const py::key_error& e) {
    raise_text(PyExc_KeyError, e.what());
  } catch (const py::value_error& e) {
    raise_text(PyExc_ValueError, e.what());
  } catch (const py::type_error& e) {
    raise_text(PyExc_TypeError, e.what());
  } catch (const py::index_error& e) {
    raise_text(PyExc_IndexError, e.what());
  } catch (const py::builtin_exception&) {
    throw;  // pybind11's own (cast errors, stop_iteration, ...): its messages name C++ types
  } catch (const std::bad_alloc&) {
    throw;
  } catch (const std::invalid_argument& e) {
    raise_text(PyExc_ValueError, e.what());
  } catch (const std::domain_error& e) {
    raise_text(PyExc_ValueError, e.what());
  } catch (const std::length_error& e) {
    raise_text(PyExc_ValueError, e.what());
  } catch (const std::range_error& e) {
    raise_text(PyExc_ValueError, e.what());
  } catch (const std::out_of_range& e) {
    raise_text(PyExc_IndexError, e.what());
  } catch (const std::overflow_error& e) {
    raise_text(PyExc_OverflowError, e.what());
  } catch (const std::exception& e) {
    raise_text(PyExc_RuntimeError, e.what());
  }
}

// A copy of one plan array, as a bytearray of native int64 values.
py::bytearray copy_out(const IndexVector& values) {
  return py::bytearray(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(Index));
}

// A copy of a 1-D contiguous int64 buffer (a numpy array, array.array('q'), memoryview, ...).
IndexVector copy_in(const char* field, const py::buffer& buffer) {
  const py::buffer_info info = buffer.request();
  const std::string format = info.format;
  if (info.itemsize != static_cast<py::ssize_t>(sizeof(Index)) || (format != "q" && format != "l" && format != "<q" && format != "=q" && format != "<l" && format != "=l"))
    throw py::type_error(std::string(field) + ": expected a buffer of int64 values, got format '" + format + "' with " +
                         std::to_string(info.itemsize) + "-byte items");
  if (info.ndim != 1) throw py::value_error(std::string(field) + ": expected a 1-D buffer, got " + std::to_string(info.ndim) + " dimensions");
  if (info.shape[0] > 1 && info.strides[0] != static_cast<py::ssize_t>(sizeof(Index)))
    throw py::value_error(std::string(field) + ": expected a contiguous buffer");
  const auto* data = static_cast<const Index*>(info.ptr);
  return IndexVector(data, data + info.shape[0]);
}

std::optional<IndexVector> copy_in(const char* field, const std::optional<py::buffer>& buffer) {
  if (!buffer) return std::nullopt;
  return copy_in(field, *buffer);
}

py::object yaml_to_python(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map: {
      py::dict out;
      // a key that is not a scalar (YAML allows `? [a, b]: x` and an empty key) is kept as its YAML text
      for (const auto& item : node)
        out[text(item.first.IsScalar() ? item.first.Scalar() : YAML::Dump(item.first))] = yaml_to_python(item.second);
      return out;
    }
    case YAML::NodeType::Sequence: {
      py::list out;
      for (const auto& item : node) out.append(yaml_to_python(item));
      return out;
    }
    case YAML::NodeType::Scalar: {
      const std::string scalar = node.Scalar();
      if (node.Tag() != "!") {  // plain scalars: YAML's usual typing
        if (scalar == "true" || scalar == "false") return py::bool_(scalar == "true");
        if (scalar == "null" || scalar == "~") return py::none();
        try {
          size_t used = 0;
          const long long value = std::stoll(scalar, &used);
          if (used == scalar.size()) return py::int_(value);
        } catch (const std::exception&) {
        }
        try {
          size_t used = 0;
          const double value = std::stod(scalar, &used);
          if (used == scalar.size()) return py::float_(value);
        } catch (const std::exception&) {
        }
      }
      return text(scalar);
    }
    default: return py::none();
  }
}

py::dict record_to_python(const PluginRecord& r) {
  py::dict out;
  // Fields come from files anyone with write access to a plugin folder controls: bounded here
  // (the registry already bounds the messages it writes), so doctor never prints megabytes.
  out["family"] = text(clip(r.family, 100));
  out["version"] = text(clip(r.version, 100));
  out["library_version"] = text(r.library_version);
  out["op_namespace"] = text(r.manifest.op_namespace);
  // A loaded plugin's paths resolved (at most PATH_MAX) and are used as paths: kept whole.
  out["manifest_path"] = path_text(r.loaded ? r.manifest_path : clip(r.manifest_path, 1000));
  out["library_path"] = path_text(r.loaded ? r.library_path : clip(r.library_path, 1000));
  out["loaded"] = r.loaded;
  out["error"] = text(clip(r.error, 2000));
  out["fingerprint"] = text(r.fingerprint);
  out["manifest"] = r.loaded ? yaml_to_python(r.manifest_node) : py::object(py::none());
  py::list kernels;
  if (r.loaded)
    for (const auto& k : r.family_object->kernels()) kernels.append(py::make_tuple(text(k.name), text(k.device), k.available));
  out["kernels"] = kernels;
  return out;
}

const PluginRecord& loaded(const std::string& family) {
  const PluginRecord* record = Registry::instance().loaded_family(family);
  if (!record) throw py::key_error("no loaded family plugin named '" + family + "'");
  return *record;
}

ModuleDescription describe_module(const py::dict& d) {
  ModuleDescription m;
  m.path = d["path"].cast<std::string>();
  m.class_name = d["class_name"].cast<std::string>();
  m.model_type = d.contains("model_type") ? d["model_type"].cast<std::string>() : "";
  if (d.contains("params"))
    for (const auto& p : d["params"].cast<py::list>()) {
      auto pair = p.cast<py::tuple>();
      m.params.push_back({pair[0].cast<std::string>(), pair[1].cast<std::vector<int64_t>>()});
    }
  if (d.contains("conv") && !d["conv"].is_none()) {
    auto c = d["conv"].cast<py::dict>();
    m.conv = {true, c["in_channels"].cast<int64_t>(), c["out_channels"].cast<int64_t>(), c["groups"].cast<int64_t>(),
              c["kernel_size"].cast<int64_t>(), c["padding"].cast<int64_t>()};
  }
  return m;
}

// A setting's value from its text as os.environ holds it (a str, surrogates for bytes that are not
// UTF-8), parsed by the one parser the C++ accessors use (sdk/settings.h): a bool, an int, a str, or
// a list of str; paths come back as os.fsdecode makes them.
py::object parse_setting(const std::string& name, const py::str& raw) {
  const settings::Setting* s = settings::find(name);
  if (!s) {
    std::string names;
    for (const settings::Setting& d : settings::kAll) names += std::string(names.empty() ? "" : ", ") + d.name;
    throw py::key_error(name + " is not a tree-recurrence setting; the settings are " + names);
  }
  std::string value = fs_bytes(raw);
  if (value.empty()) value = s->fallback;
  switch (s->kind) {
    case settings::Kind::Flag: return py::bool_(settings::parse_flag(s->name, value));
    case settings::Kind::Count: return py::int_(settings::parse_count(s->name, value));
    case settings::Kind::Choice: return text(settings::parse_choice(*s, value));
    case settings::Kind::Path: return path_text(value);
    case settings::Kind::PathList:
    case settings::Kind::Names: {
      py::list out;
      for (const std::string& piece : settings::parse_list(*s, value))
        out.append(s->kind == settings::Kind::PathList ? path_text(piece) : text(piece));
      return out;
    }
  }
  return py::none();
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "tree-recurrence core: TreePlan, Policy, plugin registry";
  m.attr("ABI_VERSION") = TREE_RECURRENCE_ABI_VERSION;
  py::register_local_exception_translator(translate);
  m.def("core_fingerprint", [] { return text(core_fingerprint()); });
  // The environment variables the library reads (sdk/settings.h): (name, kind, fallback, doc) each.
  m.def("settings", [] {
    py::list out;
    for (const settings::Setting& s : settings::kAll)
      out.append(py::make_tuple(s.name, settings::kind_name(s.kind), s.fallback, s.doc));
    return out;
  });
  m.def("parse_setting", &parse_setting, py::arg("name"), py::arg("text"));

  py::class_<TreePlan, std::shared_ptr<TreePlan>>(m, "TreePlan")
      .def_static(
          "build",
          [](const py::buffer& cu_seqlens_q, const std::optional<py::buffer>& kv_index, const std::optional<py::buffer>& cu_seqlens_k,
             const std::optional<py::buffer>& parents, const std::optional<py::buffer>& depths, Index num_tokens) {
            TreeInput input;
            input.cu_seqlens_q = copy_in("tree_cu_seqlens_q", cu_seqlens_q);
            input.kv_index = copy_in("tree_kv_index", kv_index);
            input.cu_seqlens_k = copy_in("tree_cu_seqlens_k", cu_seqlens_k);
            input.segment_parents = copy_in("tree_segment_parents", parents);
            input.segment_depths = copy_in("tree_segment_depths", depths);
            input.num_tokens = num_tokens;
            py::gil_scoped_release release;
            return TreePlan::build(input);
          },
          py::arg("cu_seqlens_q"), py::arg("kv_index"), py::arg("cu_seqlens_k"), py::arg("parents"), py::arg("depths"),
          py::arg("num_tokens"))
      .def_property_readonly("num_tokens", &TreePlan::num_tokens)
      .def_property_readonly("num_segments", &TreePlan::num_segments)
      .def_property_readonly("num_leaves", &TreePlan::num_leaves)
      .def_property_readonly("num_levels", &TreePlan::num_levels)
      .def_property_readonly("path_token_total", &TreePlan::path_token_total)
      .def_property_readonly("saved_tokens", &TreePlan::saved_tokens)
      .def_property_readonly("max_path_length", &TreePlan::max_path_length)
      .def_property_readonly("max_segment_length", &TreePlan::max_segment_length)
      .def_property_readonly("is_chains", &TreePlan::is_chains)
      .def_static("array_names", &TreePlan::array_names)
      .def("array",
           [](const std::shared_ptr<TreePlan>& plan, const std::string& name) {
             const IndexVector* values;
             {
               py::gil_scoped_release release;
               values = &plan->array(name);
             }
             return copy_out(*values);
           })
      .def("conv_tables", [](const std::shared_ptr<TreePlan>& plan, Index width) {
        // (ancestors, reader_offsets, readers) for a conv of this width, computed once and cached.
        const IndexVector *ancestors, *offsets, *readers;
        {
          py::gil_scoped_release release;
          ancestors = &plan->conv_ancestors(width);
          offsets = &plan->conv_reader_offsets(width);
          readers = &plan->conv_readers(width);
        }
        return py::make_tuple(copy_out(*ancestors), copy_out(*offsets), copy_out(*readers));
      })
      .def("chunk_tables", [](const std::shared_ptr<TreePlan>& plan, Index chunk_size) {
        // (gather (num_chunks * chunk_size), scatter, seg_chunk_offsets, root_index, num_chunks), built on each
        // call: the Python TreePlan caches what it wraps (TreePlan.cached).
        ChunkTables tables;
        {
          py::gil_scoped_release release;
          tables = plan->chunk_tables(chunk_size);
        }
        return py::make_tuple(copy_out(tables.gather), copy_out(tables.scatter), copy_out(tables.seg_chunk_offsets),
                              copy_out(tables.root_index), tables.num_chunks);
      });

  py::class_<Policy>(m, "Policy")
      .def(py::init<>())
      .def_readwrite("fork_min_saved_tokens", &Policy::fork_min_saved_tokens)
      .def_property(
          "strategy", [](const Policy& p) { return to_string(p.strategy); },
          [](Policy& p, const std::string& s) { p.strategy = strategy_from_string(s); })
      .def_readwrite("prefer_native", &Policy::prefer_native)
      .def_static(
          "from_yaml_file",
          [](const py::object& path, Policy base) { return Policy::from_yaml_file(fs_bytes(path), base); },
          py::arg("path"), py::arg("base"))
      .def_static("from_yaml_text", py::overload_cast<const std::string&, Policy, const std::string&>(&Policy::from_yaml_text),
                  py::arg("text"), py::arg("base"), py::arg("origin") = "<string>")
      .def_static("from_environment", py::overload_cast<Policy>(&Policy::from_environment), py::arg("base"))
      .def_static("from_environment_variables", &Policy::from_environment_variables, py::arg("base"))
      .def("choose",
           [](const Policy& p, const TreePlan& plan, bool native_available, bool fork_available) {
             Decision d = p.choose(plan, native_available, fork_available);
             return py::make_tuple(to_string(d.strategy), text(d.reason));
           })
      .def("__repr__", [](const Policy& p) {
        return "Policy(fork_min_saved_tokens=" + std::to_string(p.fork_min_saved_tokens) + ", strategy='" +
               to_string(p.strategy) + "', prefer_native=" + (p.prefer_native ? "True" : "False") + ")";
      });

  // folders: str, bytes or os.PathLike each (a str from os.fsdecode of a name that is not UTF-8 included)
  m.def("discover_plugins", [](const py::iterable& folders) {
    if (py::isinstance<py::str>(folders) || py::isinstance<py::bytes>(folders))
      throw py::type_error("discover_plugins: expected a list of folders, got one path");
    std::vector<std::string> paths;
    for (const auto& folder : folders) paths.push_back(fs_bytes(folder));
    py::list out;
    for (const PluginRecord* r : Registry::instance().discover(paths)) out.append(record_to_python(*r));
    return out;
  });
  m.def("plugin_records", []() {
    py::list out;
    for (const PluginRecord* r : Registry::instance().records()) out.append(record_to_python(*r));
    return out;
  });
  m.def("detect", [](const std::string& family, const py::dict& module) {
    Claim c = loaded(family).family_object->detect(describe_module(module));
    return py::make_tuple(c.claimed, text(c.role), text(c.reason));
  });
  // The fallback for a module no loaded family recognises: the SDK's detectors (sdk/detectors.h, the
  // ones the families ship) in their order; why it mixes tokens like a recurrent layer, or None.
  m.def("generic_leftover", [](const py::dict& module) -> py::object {
    namespace d = tree_recurrence::detectors;
    const ModuleDescription desc = describe_module(module);
    for (const d::Detector& detector : {d::kStateSpaceDecay, d::kCausalDepthwiseConv}) {
      const std::string why = detector.why(desc);
      if (!why.empty()) return text(why + " [generic fallback detector: no loaded family recognises it]");
    }
    return py::none();
  });
}
