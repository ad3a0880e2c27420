// The one compiled Python module, pimhbm._core: hands the FFI handlers to JAX.
// Every op has one target name for both platforms (cpu and CUDA).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "attention/attention_ffi.h"
#include "backup/shm_region.h"
#include "backup/snapshot.h"
#include "faults/inject_ffi.h"
#include "parity/parity_ffi.h"
#include "peer/ipc.h"
#include "peer/peer_ffi.h"
#include "pimhbm/digest.h"
#include "pimhbm/ffi_alias.h"
#include "repair/repair_ffi.h"
#include "scan/scan_ffi.h"
#include "summary/fault_list_ffi.h"
#include "telemetry/telemetry.h"
#include "update/adamw_layout.h"
#include "update/inplace_ffi.h"
#include "update/precheck_ffi.h"
#include "update/update_ffi.h"

#if defined(PIMHBM_WITH_CUDA)
#include <cuda_runtime_api.h>

#include <cstdio>
#endif

namespace nb = nanobind;

namespace {

// Every FFI target: its name, and its handler on each platform (PIMHBM_FFI_HANDLERS).
struct Target {
  const char* name;
  XLA_FFI_Handler* cpu;
  XLA_FFI_Handler* cuda;  // null without CUDA
};
#if defined(PIMHBM_WITH_CUDA)
#define PIMHBM_TARGET(name, symbol) \
  { name, symbol##Cpu, symbol##Cuda }
#else
#define PIMHBM_TARGET(name, symbol) \
  { name, symbol##Cpu, nullptr }
#endif
constexpr Target kTargets[] = {
    PIMHBM_TARGET("pimhbm_scan", PimhbmScan),
    PIMHBM_TARGET("pimhbm_verify", PimhbmVerify),
    PIMHBM_TARGET("pimhbm_adamw", PimhbmAdamW),
    PIMHBM_TARGET("pimhbm_restore", PimhbmRestore),
    PIMHBM_TARGET("pimhbm_repair", PimhbmRepair),
    PIMHBM_TARGET("pimhbm_restore_clean", PimhbmRestoreClean),
    PIMHBM_TARGET("pimhbm_repair_packed", PimhbmRepairPacked),
    PIMHBM_TARGET("pimhbm_inject", PimhbmInject),
    PIMHBM_TARGET("pimhbm_snapshot", PimhbmSnapshot),
    PIMHBM_TARGET("pimhbm_snapshot_fence", PimhbmSnapshotFence),
    PIMHBM_TARGET("pimhbm_peer_all_gather", PimhbmPeerAllGather),
    PIMHBM_TARGET("pimhbm_peer_all_to_all", PimhbmPeerAllToAll),
    PIMHBM_TARGET("pimhbm_peer_pull", PimhbmPeerPull),
    PIMHBM_TARGET("pimhbm_parity", PimhbmParity),
    PIMHBM_TARGET("pimhbm_adamw_inplace", PimhbmAdamWInPlace),
    PIMHBM_TARGET("pimhbm_adamw_redo", PimhbmAdamWRedo),
    PIMHBM_TARGET("pimhbm_inplace_precheck", PimhbmInPlacePrecheck),
    PIMHBM_TARGET("pimhbm_fault_list", PimhbmFaultList),
    PIMHBM_TARGET("pimhbm_parity_rebuild", PimhbmParityRebuild),
    PIMHBM_TARGET("pimhbm_attention_fwd", PimhbmAttentionFwd),
    PIMHBM_TARGET("pimhbm_attention_bwd", PimhbmAttentionBwd),
};
#undef PIMHBM_TARGET

nb::dict registrations() {
  nb::dict cpu, cuda, out;
  for (const Target& t : kTargets) {
    cpu[t.name] = nb::capsule(reinterpret_cast<void*>(t.cpu));
    if (t.cuda) cuda[t.name] = nb::capsule(reinterpret_cast<void*>(t.cuda));
  }
  out["cpu"] = cpu;
#if defined(PIMHBM_WITH_CUDA)
  out["CUDA"] = cuda;
#endif
  return out;
}

// The buffers of one leaf of a pimhbm_adamw call (update/adamw_layout.h), for the Python front
// to build its calls from by name.
nb::object position(int k) {  // among a leaf's operands or results; None: not there
  if (k < 0) return nb::none();
  return nb::int_(k);
}

nb::dict adamw_layout() {
  using namespace pimhbm::update;
  nb::list rows;
  for (int row = 0; row < kLeafRows; ++row) {
    const LeafBuffer& b = kLeafBuffers[row];
    nb::dict d;
    d["name"] = b.name;
    d["role"] = role_name(b.role);
    d["tensor"] = tensor_key(b.tensor);
    d["table"] = b.table;
    d["dtype"] = dtype_rule(b.dtype);
    d["count"] = count_rule(b.count);
    d["operand"] = position(operand_of(row));
    d["result"] = position(result_of(row));
    rows.append(d);
  }
  nb::dict out;
  out["leaf"] = rows;
  out["leaf_operands"] = kLeafOperands;
  out["leaf_results"] = kLeafResults;
  return out;
}

// The operands and results of one leaf of a pimhbm_adamw_inplace / _redo call, by name, in order.
nb::dict inplace_layout() {
  nb::list operands, results;
  for (const char* n : pimhbm::update::kInPlaceOperands) operands.append(n);
  for (const char* n : pimhbm::update::kInPlaceResults) results.append(n);
  nb::dict out;
  out["operands"] = operands;
  out["results"] = results;
  out["totals"] = pimhbm::update::kInPlaceTotals;
  nb::list totals;
  for (const char* n : pimhbm::update::kInPlaceTotalNames) totals.append(n);
  out["total_names"] = totals;
  nb::list sizes;
  for (int64_t c : pimhbm::update::kInPlaceChunkElems) sizes.append(c);
  out["chunk_elems"] = sizes;
  out["stash_columns"] = pimhbm::update::kStashIndexColumns;
  return out;
}

// The sizes a pimhbm_fault_list call's scratch result is made of.
nb::dict fault_list_layout() {
  nb::dict out;
  out["range_entries"] = pimhbm::summary::kRangeEntries;
  out["range_bytes"] = sizeof(pimhbm::summary::Range);
  out["totals"] = pimhbm::summary::kListTotals;
  return out;
}

using pimhbm::backup::ShmRegion;
using pimhbm::telemetry::Telemetry;

nb::dict health_dict(const pimhbm::telemetry::DeviceHealth& h) {
  nb::dict d, fields, unavailable;
  d["index"] = h.index;
  d["name"] = h.name;
  d["uuid"] = h.uuid;
  for (const auto& [name, r] : h.fields) {
    if (r.ok) {
      fields[name.c_str()] = r.value;
    } else {
      fields[name.c_str()] = nb::none();
      unavailable[name.c_str()] = r.why;
    }
  }
  d["fields"] = fields;
  d["unavailable"] = unavailable;
  return d;
}

nb::list events_list(const std::vector<pimhbm::telemetry::Event>& events) {
  nb::list out;
  for (const auto& e : events) {
    nb::dict d;
    d["device"] = e.device;
    d["kind"] = e.kind;
    d["xid"] = e.xid;
    d["detail"] = e.detail;
    d["seconds"] = e.seconds;
    out.append(d);
  }
  return out;
}

// NVML-style UUIDs ("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx") of the CUDA devices this
// process sees, by CUDA ordinal: how a JAX device is matched with an NVML device. Empty
// without CUDA or a driver.
std::vector<std::string> cuda_device_uuids() {
  std::vector<std::string> out;
#if defined(PIMHBM_WITH_CUDA)
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear: no driver or no device is not an error here
    return out;
  }
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) {
      cudaGetLastError();
      out.emplace_back();
      continue;
    }
    const auto* b = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
    char buf[48];
    std::snprintf(buf, sizeof(buf),
                  "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                  b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                  b[14], b[15]);
    out.emplace_back(buf);
  }
#endif
  return out;
}

nb::dlpack::dtype parse_dtype(const std::string& name) {
  using nb::dlpack::dtype_code;
  const auto make = [](dtype_code code, int bits) {
    return nb::dlpack::dtype{static_cast<uint8_t>(code), static_cast<uint8_t>(bits), 1};
  };
  if (name == "float32") return make(dtype_code::Float, 32);
  if (name == "float16") return make(dtype_code::Float, 16);
  if (name == "float64") return make(dtype_code::Float, 64);
  if (name == "bfloat16") return make(dtype_code::Bfloat, 16);
  if (name == "uint8") return make(dtype_code::UInt, 8);
  if (name == "uint16") return make(dtype_code::UInt, 16);
  if (name == "uint32") return make(dtype_code::UInt, 32);
  if (name == "uint64") return make(dtype_code::UInt, 64);
  if (name == "int8") return make(dtype_code::Int, 8);
  if (name == "int32") return make(dtype_code::Int, 32);
  if (name == "int64") return make(dtype_code::Int, 64);
  throw std::invalid_argument("unsupported dtype for a region view: " + name);
}

// A view of `shape` elements of `dtype` at `offset` bytes into the region; the view keeps the
// region mapped for as long as it lives.
template <typename... Framework>
nb::ndarray<Framework...> region_view(std::shared_ptr<ShmRegion> region, int64_t offset,
                                      std::vector<size_t> shape, const std::string& dtype) {
  const nb::dlpack::dtype dt = parse_dtype(dtype);
  // Sizes multiplied without overflow: a view larger than the region is refused before that.
  int64_t bytes = dt.bits / 8;
  for (size_t d : shape) {
    if (d != 0 && static_cast<uint64_t>(bytes) > static_cast<uint64_t>(region->nbytes()) / d) {
      throw std::out_of_range("a view of shape larger than the region of " +
                              std::to_string(region->nbytes()) + " bytes");
    }
    bytes *= static_cast<int64_t>(d);
  }
  if (offset < 0 || bytes > region->nbytes() || offset > region->nbytes() - bytes) {
    throw std::out_of_range("view of " + std::to_string(bytes) + " bytes at offset " +
                            std::to_string(offset) + " is outside the region of " +
                            std::to_string(region->nbytes()) + " bytes");
  }
  auto* keep = new std::shared_ptr<ShmRegion>(region);
  nb::capsule owner(keep,
                    [](void* p) noexcept { delete static_cast<std::shared_ptr<ShmRegion>*>(p); });
  return nb::ndarray<Framework...>(region->data() + offset, shape.size(), shape.data(), owner,
                                   nullptr, dt, nb::device::cpu::value, 0);
}

// Shared-memory regions and the snapshots into them.
void def_regions(nb::module_& m) {
  nb::class_<ShmRegion>(m, "ShmRegion",
                        "A named POSIX shared-memory region, owned by C++; outlives the process.")
      .def_static("create", &ShmRegion::create, nb::arg("name"), nb::arg("nbytes"),
                  "Creates the region /name (it must not exist: mode 0600, locked).")
      .def_static("open", &ShmRegion::open, nb::arg("name"),
                  "Maps the existing region /name (this user's, mode 0600, not in use; locked).")
      .def_static("unlink", &ShmRegion::unlink, nb::arg("name"), "Removes the region's name.")
      .def_prop_ro("address",
                   [](const ShmRegion& r) { return reinterpret_cast<uintptr_t>(r.data()); })
      .def_prop_ro("nbytes", &ShmRegion::nbytes)
      .def_prop_ro("id", &ShmRegion::id, "How the snapshot op finds the region (never reused).")
      .def("release", &ShmRegion::release, "Gives the lock up; views stay valid.")
      .def_prop_ro("held", &ShmRegion::held, "Whether this handle holds the region's lock.")
      .def_prop_ro("name", &ShmRegion::name)
      .def("pin", &ShmRegion::pin, nb::call_guard<nb::gil_scoped_release>(),
           "Page-locks the region for fast device-to-host copies (releases the GIL).")
      .def_prop_ro("pinned", &ShmRegion::pinned)
      .def("numpy", &region_view<nb::numpy>, nb::arg("offset"), nb::arg("shape"), nb::arg("dtype"),
           "A NumPy view of region memory (no copy).")
      .def("jax", &region_view<nb::jax>, nb::arg("offset"), nb::arg("shape"), nb::arg("dtype"),
           "A JAX array on the CPU over region memory, through DLPack (no copy).");
  m.def("snapshot_wait", &pimhbm::backup::snapshot_wait,
        "Blocks until every snapshot copy issued so far is done.");
  m.def("snapshot_pending", &pimhbm::backup::snapshot_pending,
        "Whether a snapshot copy is still running.");
  m.attr("chunk_align") = pimhbm::kChunkAlign;
  m.attr("max_chunk_size") = pimhbm::kMaxChunkSize;
}

// NVML telemetry: readings and the background thread's events.
void def_telemetry(nb::module_& m) {
  nb::class_<Telemetry>(m, "Telemetry",
                        "The GPU's own fault signals through NVML, opened at run time.")
      .def(nb::init<const std::string&>(), nb::arg("library") = "",
           "Opens NVML (library: a path; default libnvidia-ml.so.1 or $PIMHBM_NVML_LIBRARY).")
      .def_prop_ro("available", &Telemetry::available)
      .def_prop_ro("reason", &Telemetry::reason)
      .def_prop_ro("library", &Telemetry::library)
      .def_prop_ro("device_count", &Telemetry::device_count)
      .def(
          "read",
          [](const Telemetry& t) {
            nb::list out;
            for (const auto& h : t.read()) out.append(health_dict(h));
            return out;
          },
          "Per device: {index, name, uuid, fields: {name: value or None}, unavailable: {name: "
          "why}}.")
      .def("start", &Telemetry::start, nb::arg("poll_seconds") = 1.0,
           nb::call_guard<nb::gil_scoped_release>(),
           "Starts the background thread: driver events, and counters read every poll_seconds.")
      .def("stop", &Telemetry::stop, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("running", &Telemetry::running)
      .def_prop_ro("events_status", &Telemetry::events_status,
                   "'' while driver events are watched, else why they are not.")
      .def(
          "drain", [](Telemetry& t) { return events_list(t.drain()); },
          "The events since the last drain: {device, kind, xid, detail, seconds}.");
  m.def("telemetry_fields", &pimhbm::telemetry::field_names, "The fields of a reading, in order.");
}

// The tally of results XLA did not alias (ffi_alias.h).
void def_unaliased(nb::module_& m) {
  m.def("unaliased_copies", &pimhbm::ffi_util::unaliased_total,
        "How many results of in-place ops XLA did not alias with their operands in this process "
        "(each cost a copy); zero is the expected figure.");
  m.def(
      "unaliased_copies_by_op",
      [] {
        nb::dict out;
        for (const auto& [op, t] : pimhbm::ffi_util::unaliased_tally()) {
          nb::dict d;
          d["results"] = t.results;
          d["bytes"] = t.bytes;
          d["in_command_buffer"] = t.in_command_buffer;
          out[op.c_str()] = d;
        }
        return out;
      },
      "The same by op: {op: {results, bytes, in_command_buffer}}. in_command_buffer counts the "
      "copies recorded into a CUDA graph: they repeat on every replay, counted once.");
}

// Repairs from a replica in another process, over CUDA IPC (peer/ipc.h).
void def_ipc(nb::module_& m) {
  nb::exception<pimhbm::peer::ipc::Unavailable>(m, "IpcUnavailable", PyExc_RuntimeError);
  m.def(
      "ipc_export",
      [](uint64_t ptr, int device) {
        const std::string blob = pimhbm::peer::ipc::export_pointer(ptr, device);
        return nb::bytes(blob.data(), blob.size());
      },
      nb::arg("ptr"), nb::arg("device"),
      "The CUDA IPC export (handle of the allocation, offset) of device pointer `ptr` on CUDA "
      "device `device`; RuntimeError when that memory cannot be shared between processes.");
  m.def(
      "ipc_pull",
      [](int device, const std::vector<int32_t>& chunks, uint64_t dst, uint64_t dst_table,
         int64_t nbytes, int64_t chunk_bytes, nb::bytes src, nb::bytes src_table,
         int64_t timeout_ms) {
        const std::string s(src.c_str(), src.size()), st(src_table.c_str(), src_table.size());
        nb::gil_scoped_release release;
        return pimhbm::peer::ipc::pull(device, chunks, dst, dst_table, nbytes, chunk_bytes, s, st,
                                       timeout_ms);
      },
      nb::arg("device"), nb::arg("chunks"), nb::arg("dst"), nb::arg("dst_table"), nb::arg("nbytes"),
      nb::arg("chunk_bytes"), nb::arg("src"), nb::arg("src_table"), nb::arg("timeout_ms"),
      "Repairs the listed chunks of this process's tensor at `dst` (with its digest table) from "
      "another process's copy (exports of it and its table), reading that GPU's memory "
      "directly; a status per chunk (pimhbm.REPAIRED, ...). Bounded by timeout_ms.");
  m.def("ipc_close", &pimhbm::peer::ipc::close_all,
        "Unmaps every peer allocation this process mapped for IPC pulls and closes the "
        "descriptors it exported (for every trainer of the process).");
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "pim-hbm-bypass: FFI handlers (CPU and CUDA) for JAX";
  // Regions can be alive at interpreter exit (JAX arrays over their memory are released in an
  // order Python does not promise); that is not a leak worth a warning.
  nb::set_leak_warnings(false);
  m.def("registrations", &registrations,
        "Map platform -> {target name -> FFI handler capsule}, for jax.ffi.register_ffi_target.");
#if defined(PIMHBM_WITH_CUDA)
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.attr("default_chunk_bytes") = pimhbm::kDefaultChunkBytes;
  m.def("adamw_layout", &adamw_layout,
        "The buffers of one leaf of a pimhbm_adamw call: per row its name, role (read, write, "
        "copy, report), tensor (p, master, mu, nu, g, faults, grad_nonfinite), whether it is "
        "the tensor's digest table, its dtype and count rules, and its positions among the "
        "leaf's operands and results (None: none). The step scalars come before the leaves' "
        "operands, the call's totals after their results.");
  m.def("inplace_layout", &inplace_layout, "The buffers of a leaf of pimhbm_adamw_inplace.");
  m.def("fault_list_layout", &fault_list_layout,
        "Entries a range of pimhbm_fault_list's scratch table covers, its row's bytes, and the "
        "number of its totals.");

  def_regions(m);
  def_telemetry(m);
  def_unaliased(m);
  def_ipc(m);
  m.def("cuda_device_uuids", &cuda_device_uuids,
        "NVML-style UUIDs of the CUDA devices this process sees, by CUDA ordinal.");
}
