// snapckpt's optional native loops over many tensors (snapckpt/_native/__init__.py builds and loads this file).
//
// One C++ loop per pass that the Python path makes with one torch call per tensor (guards, data pointers, version
// bumps). Plain CPython API and c10's TensorImpl only (no pybind11, no ATen operators): a shorter compile.
// A Python tensor object is read through a struct with THPVariable's layout (torch/csrc/autograd/python_variable.h:
// PyObject_HEAD, then the at::Tensor, whose only member is the TensorImpl pointer); load() checks it with probe().
#include <Python.h>

#include <c10/core/TensorImpl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <vector>

namespace {

struct VariableView {
  PyObject_HEAD
  c10::TensorImpl* impl;  // at::Tensor's intrusive_ptr<TensorImpl>: one pointer
};

inline c10::TensorImpl* impl_of(PyObject* obj) {
  return reinterpret_cast<VariableView*>(obj)->impl;
}

// One record per tensor in a table: fixed words, then sizes[dim], strides[dim].
// word 0: the Python type; 1: dispatch key set (raw); 2: dtype | requires_grad << 8 | device type << 16 |
// (device index + 1) << 24 | inference << 32 | dim << 40; 3: storage offset (elements).
constexpr size_t kFixed = 4;

inline int64_t packed(const c10::TensorImpl* t) {
  auto dev = t->device();
  return static_cast<int64_t>(static_cast<uint8_t>(t->dtype().toScalarType())) |
         (static_cast<int64_t>(t->requires_grad()) << 8) |
         (static_cast<int64_t>(static_cast<uint8_t>(dev.type())) << 16) |
         (static_cast<int64_t>(static_cast<uint8_t>(dev.index() + 1)) << 24) |
         (static_cast<int64_t>(const_cast<c10::TensorImpl*>(t)->is_inference()) << 32) | (static_cast<int64_t>(t->dim()) << 40);
}

// Tensors whose layout a table may hold: strided, sizes and strides readable without a Python or symbolic call.
inline bool plain(const c10::TensorImpl* t) {
  return t->layout() == c10::kStrided && !t->is_python_dispatch() && !t->has_symbolic_sizes_strides();
}

PyObject* list_arg(PyObject* obj) {
  if (!PyList_Check(obj)) {
    PyErr_SetString(PyExc_TypeError, "expected a list of tensors");
    return nullptr;
  }
  return obj;
}

// probe(tensor) -> (data_ptr, numel, storage_offset): load()'s check of the struct layout against Python's answers.
PyObject* probe(PyObject*, PyObject* t) {
  const c10::TensorImpl* impl = impl_of(t);
  return Py_BuildValue("(KLL)", static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(impl->data())),
                       static_cast<long long>(impl->numel()), static_cast<long long>(impl->storage_offset()));
}

// table(tensors, tensor_type) -> bytes, or None when a tensor's layout cannot be tabled (the caller goes without).
PyObject* table_impl(PyObject* const* args);

PyObject* table(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !list_arg(args[0])) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "table(tensors, tensor_type)");
    return nullptr;
  }
  try {
    return table_impl(args);
  } catch (const std::exception&) {  // a C++ exception must not cross into Python: no table, the Python path
    Py_RETURN_NONE;
  }
}

PyObject* table_impl(PyObject* const* args) {
  PyObject* lst = args[0];
  Py_ssize_t n = PyList_GET_SIZE(lst);
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(n) * (kFixed + 2));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* o = PyList_GET_ITEM(lst, i);
    int ok = PyObject_IsInstance(o, args[1]);
    if (ok < 0) return nullptr;
    if (!ok) Py_RETURN_NONE;
    const c10::TensorImpl* t = impl_of(o);
    if (!plain(t)) Py_RETURN_NONE;
    out.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(Py_TYPE(o))));
    out.push_back(static_cast<int64_t>(t->key_set().raw_repr()));
    out.push_back(packed(t));
    out.push_back(t->storage_offset());
    for (auto s : t->sizes()) out.push_back(s);
    for (auto s : t->strides()) out.push_back(s);
  }
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(out.data()),
                                   static_cast<Py_ssize_t>(out.size() * sizeof(int64_t)));
}

// Whether tensors[i] has record `r` of a table; advances r.
inline bool matches(PyObject* o, const int64_t*& r, const int64_t* end) {
  if (end - r < static_cast<ptrdiff_t>(kFixed)) return false;
  if (r[0] != static_cast<int64_t>(reinterpret_cast<uintptr_t>(Py_TYPE(o)))) return false;
  const c10::TensorImpl* t = impl_of(o);
  if (r[1] != static_cast<int64_t>(t->key_set().raw_repr()) || !plain(t) || r[2] != packed(t) ||
      r[3] != t->storage_offset())
    return false;
  size_t dim = static_cast<size_t>(r[2] >> 40);
  if (end - r < static_cast<ptrdiff_t>(kFixed + 2 * dim)) return false;
  auto sizes = t->sizes();
  auto strides = t->strides();
  const int64_t* p = r + kFixed;
  if ((dim && std::memcmp(p, sizes.data(), dim * sizeof(int64_t)) != 0) ||
      (dim && std::memcmp(p + dim, strides.data(), dim * sizeof(int64_t)) != 0))
    return false;
  r = p + 2 * dim;
  return true;
}

// Each tensor's Python object, TensorImpl and StorageImpl are cache misses, one behind the other: the loop asks for
// those of tensors a few places ahead (objects 16 ahead, their TensorImpls 8 ahead, the storages 4 ahead), so that
// the misses of several tensors overlap instead of following one another.
inline void prefetch_ahead(PyObject* lst, Py_ssize_t i, Py_ssize_t n) {
  if (i + 16 < n) __builtin_prefetch(PyList_GET_ITEM(lst, i + 16));
  if (i + 8 < n) {
    const char* t = reinterpret_cast<const char*>(impl_of(PyList_GET_ITEM(lst, i + 8)));
    __builtin_prefetch(t);
    __builtin_prefetch(t + 64);
    __builtin_prefetch(t + 128);
  }
  if (i + 4 < n) {
    c10::TensorImpl* t = impl_of(PyList_GET_ITEM(lst, i + 4));
    __builtin_prefetch(t->unsafe_storage().unsafeGetStorageImpl());
  }
}

// check(tensors, table, ptrs) -> int: -1 when a tensor's type, dispatch keys, dtype, requires_grad, device, storage
// offset, shape or strides differ from its record (or the counts differ); else how many data pointers differ from
// the ints of list `ptrs` (0 when `ptrs` is None).
PyObject* check_impl(PyObject* const* args);

PyObject* check(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !list_arg(args[0]) || !PyBytes_Check(args[1])) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "check(tensors, table: bytes, ptrs)");
    return nullptr;
  }
  try {
    return check_impl(args);
  } catch (const std::exception&) {  // not expected (the records rule such tensors out): the Python path decides
    return PyLong_FromLong(-1);
  }
}

PyObject* check_impl(PyObject* const* args) {
  PyObject* lst = args[0];
  PyObject* ptrs = args[2] == Py_None ? nullptr : args[2];
  if (ptrs && !PyList_Check(ptrs)) {
    PyErr_SetString(PyExc_TypeError, "ptrs: a list of ints or None");
    return nullptr;
  }
  Py_ssize_t n = PyList_GET_SIZE(lst);
  if (ptrs && PyList_GET_SIZE(ptrs) != n) return PyLong_FromLong(-1);
  const int64_t* r = reinterpret_cast<const int64_t*>(PyBytes_AS_STRING(args[1]));
  const int64_t* end = r + PyBytes_GET_SIZE(args[1]) / sizeof(int64_t);
  long differ = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    prefetch_ahead(lst, i, n);
    PyObject* o = PyList_GET_ITEM(lst, i);
    if (!matches(o, r, end)) return PyLong_FromLong(-1);
    if (ptrs) {
      unsigned long long want = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(ptrs, i));
      if (want == static_cast<unsigned long long>(-1) && PyErr_Occurred()) return nullptr;
      if (want != reinterpret_cast<uintptr_t>(impl_of(o)->data())) ++differ;
    }
  }
  if (r != end) return PyLong_FromLong(-1);
  return PyLong_FromLong(differ);
}

// check_ids(tensors, table, ids, variants, ptrs_out) -> int: 0 when each tensors[i] has one of the records
// variants * ids[i] ... variants * ids[i] + variants - 1 of the table (the one of its Python type) and a data pointer
// that is not null and no other tensor's (so no tensor object occurs twice), its data pointer then written to
// ptrs_out[i]; -2 when the first tensor that fails has a Python type that none of its records has (the caller may
// ask again with records of more types); else -1 (ptrs_out partly written either way). ids: a buffer of len(tensors) int32; ptrs_out: a writable buffer of
// len(tensors) int64. A restarted process's check of its live tensors against the slot's shape table.
PyObject* check_ids_impl(PyObject* const* args, const int32_t* ids, int64_t* out);

PyObject* check_ids(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5 || !list_arg(args[0]) || !PyBytes_Check(args[1]) || !PyLong_Check(args[3])) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_TypeError, "check_ids(tensors, table: bytes, ids, variants: int, ptrs_out)");
    return nullptr;
  }
  Py_buffer ids, out;
  if (PyObject_GetBuffer(args[2], &ids, PyBUF_C_CONTIGUOUS) < 0) return nullptr;
  if (PyObject_GetBuffer(args[4], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
    PyBuffer_Release(&ids);
    return nullptr;
  }
  Py_ssize_t n = PyList_GET_SIZE(args[0]);
  PyObject* result;
  if (ids.len != n * static_cast<Py_ssize_t>(sizeof(int32_t)) ||
      out.len != n * static_cast<Py_ssize_t>(sizeof(int64_t))) {
    PyErr_SetString(PyExc_ValueError, "ids: int32 and ptrs_out: int64, one per tensor");
    result = nullptr;
  } else {
    try {
      result = check_ids_impl(args, static_cast<const int32_t*>(ids.buf), static_cast<int64_t*>(out.buf));
    } catch (const std::exception&) {  // not expected: the Python path decides
      result = PyErr_Occurred() ? nullptr : PyLong_FromLong(-1);
    }
  }
  PyBuffer_Release(&out);
  PyBuffer_Release(&ids);
  return result;
}

PyObject* check_ids_impl(PyObject* const* args, const int32_t* ids, int64_t* out) {
  PyObject* lst = args[0];
  long variants = PyLong_AsLong(args[3]);
  if (variants < 1) return PyErr_Occurred() ? nullptr : PyLong_FromLong(-1);
  const int64_t* r = reinterpret_cast<const int64_t*>(PyBytes_AS_STRING(args[1]));
  const int64_t* end = r + PyBytes_GET_SIZE(args[1]) / sizeof(int64_t);
  std::vector<const int64_t*> starts;  // each record's first word
  while (r < end) {
    if (end - r < static_cast<ptrdiff_t>(kFixed)) return PyLong_FromLong(-1);
    starts.push_back(r);
    r += kFixed + 2 * static_cast<size_t>(r[2] >> 40);
  }
  if (r != end) return PyLong_FromLong(-1);
  const size_t shapes = starts.size() / static_cast<size_t>(variants);
  Py_ssize_t n = PyList_GET_SIZE(lst);
  bool ascending = true;
  for (Py_ssize_t i = 0; i < n; ++i) {
    prefetch_ahead(lst, i, n);
    PyObject* o = PyList_GET_ITEM(lst, i);
    if (ids[i] < 0 || static_cast<size_t>(ids[i]) >= shapes) return PyLong_FromLong(-1);
    const int64_t type = static_cast<int64_t>(reinterpret_cast<uintptr_t>(Py_TYPE(o)));
    const int64_t* const* first = starts.data() + static_cast<size_t>(ids[i]) * variants;
    const int64_t* rec = nullptr;
    for (long v = 0; v < variants && !rec; ++v)
      if (first[v][0] == type) rec = first[v];
    if (!rec) return PyLong_FromLong(-2);
    if (!matches(o, rec, end)) return PyLong_FromLong(-1);
    const int64_t p = static_cast<int64_t>(reinterpret_cast<uintptr_t>(impl_of(o)->data()));
    if (p == 0) return PyLong_FromLong(-1);
    ascending &= i == 0 || static_cast<uint64_t>(p) > static_cast<uint64_t>(out[i - 1]);
    out[i] = p;
  }
  if (!ascending) {  // distinct data pointers: a sorted copy without two equal neighbours
    std::vector<uint64_t> sorted(reinterpret_cast<const uint64_t*>(out), reinterpret_cast<const uint64_t*>(out) + n);
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) return PyLong_FromLong(-1);
  }
  return PyLong_FromLong(0);
}

// bump(tensors) -> None: bump every tensor's version counter, as an in-place copy (and torch's increment_version)
// bumps it; a tensor made under inference mode has none and is skipped, as torch's increment_version skips it.
// TypeError for an item that is not a tensor (the ones before it bumped).
PyObject* bump(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !list_arg(args[0]) || !PyType_Check(args[1])) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "bump(tensors, tensor_type)");
    return nullptr;
  }
  PyObject* lst = args[0];
  PyTypeObject* tensor_type = reinterpret_cast<PyTypeObject*>(args[1]);
  Py_ssize_t n = PyList_GET_SIZE(lst);
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* o = PyList_GET_ITEM(lst, i);
      if (!PyObject_TypeCheck(o, tensor_type)) {
        PyErr_SetString(PyExc_TypeError, "bump: expected a list of tensors");
        return nullptr;
      }
      if (i + 16 < n) __builtin_prefetch(PyList_GET_ITEM(lst, i + 16));
      if (i + 8 < n) __builtin_prefetch(impl_of(PyList_GET_ITEM(lst, i + 8)));
      if (i + 4 < n) {
        // the version counter's object (VariableVersion holds one intrusive pointer); a prefetch never faults
        const c10::TensorImpl* t = impl_of(PyList_GET_ITEM(lst, i + 4));
        __builtin_prefetch(*reinterpret_cast<void* const*>(&t->version_counter()));
      }
      c10::TensorImpl* t = impl_of(o);
      if (!t->is_inference()) t->bump_version();
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"probe", reinterpret_cast<PyCFunction>(probe), METH_O, "probe(tensor) -> (data_ptr, numel, storage_offset)"},
    {"table", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(table)), METH_FASTCALL,
     "table(tensors, tensor_type) -> bytes or None"},
    {"check", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(check)), METH_FASTCALL,
     "check(tensors, table, ptrs) -> int"},
    {"check_ids", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(check_ids)), METH_FASTCALL,
     "check_ids(tensors, table, ids, variants, ptrs_out) -> int"},
    {"bump", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(bump)), METH_FASTCALL,
     "bump(tensors, tensor_type) -> None"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "snapckpt_tensor_loops", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_snapckpt_tensor_loops() { return PyModule_Create(&module); }
