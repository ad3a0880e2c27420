// The few parts of NVML's C ABI that telemetry uses, declared here so that nothing links
// against NVML or needs its header: the library is opened at run time (dlopen) and is
// optional. Values and layouts as in NVIDIA's public nvml.h.
#pragma once

#include <cstdint>

namespace pimhbm::telemetry::nvml {

using Return = int;  // nvmlReturn_t
inline constexpr Return kSuccess = 0;
inline constexpr Return kErrorNotSupported = 3;
inline constexpr Return kErrorTimeout = 10;
inline constexpr Return kErrorFunctionNotFound = 13;
inline constexpr Return kErrorGpuIsLost = 15;

using Device = struct DeviceOpaque*;      // nvmlDevice_t
using EventSet = struct EventSetOpaque*;  // nvmlEventSet_t

// nvmlEnableState_t
inline constexpr int kDisabled = 0;
inline constexpr int kEnabled = 1;
// nvmlMemoryErrorType_t
inline constexpr int kCorrected = 0;
inline constexpr int kUncorrected = 1;
// nvmlEccCounterType_t
inline constexpr int kVolatile = 0;
inline constexpr int kAggregate = 1;
// nvmlMemoryLocation_t
inline constexpr int kLocationDram = 2;
inline constexpr int kLocationSram = 7;
// nvmlPageRetirementCause_t
inline constexpr int kRetiredMultipleSingleBit = 0;
inline constexpr int kRetiredDoubleBit = 1;

// Event types (nvmlEventType*)
inline constexpr unsigned long long kEventSingleBitEcc = 0x1ull;
inline constexpr unsigned long long kEventDoubleBitEcc = 0x2ull;
inline constexpr unsigned long long kEventXidCritical = 0x8ull;

struct EventData {  // nvmlEventData_t
  Device device;
  unsigned long long event_type;
  unsigned long long event_data;  // the Xid for kEventXidCritical
  unsigned int gpu_instance_id;
  unsigned int compute_instance_id;
};

// nvmlFieldValue_t, for the GPU recovery action (field 230, newer drivers only).
inline constexpr unsigned kFieldGpuRecoveryAction = 230;
struct FieldValue {
  unsigned field_id;
  unsigned scope_id;
  long long timestamp;
  long long latency_usec;
  int value_type;
  Return nvml_return;
  union {
    double d;
    unsigned int ui;
    unsigned long ul;
    unsigned long long ull;
    long long sll;
    int si;
    unsigned short us;
  } value;
};

// Function types, by their exported names.
using InitFn = Return (*)();
using ShutdownFn = Return (*)();
using ErrorStringFn = const char* (*)(Return);
using GetCountFn = Return (*)(unsigned*);
using GetHandleByIndexFn = Return (*)(unsigned, Device*);
using GetStringFn = Return (*)(Device, char*, unsigned);
using GetEccModeFn = Return (*)(Device, int*, int*);
using GetTotalEccErrorsFn = Return (*)(Device, int, int, unsigned long long*);
using GetMemoryErrorCounterFn = Return (*)(Device, int, int, int, unsigned long long*);
using GetRemappedRowsFn = Return (*)(Device, unsigned*, unsigned*, unsigned*, unsigned*);
using GetRetiredPagesFn = Return (*)(Device, int, unsigned*, unsigned long long*);
using GetRetiredPagesPendingFn = Return (*)(Device, int*);
using GetFieldValuesFn = Return (*)(Device, int, FieldValue*);
using EventSetCreateFn = Return (*)(EventSet*);
using GetSupportedEventTypesFn = Return (*)(Device, unsigned long long*);
using RegisterEventsFn = Return (*)(Device, unsigned long long, EventSet);
using EventSetWaitFn = Return (*)(EventSet, EventData*, unsigned);
using EventSetFreeFn = Return (*)(EventSet);

}  // namespace pimhbm::telemetry::nvml
