// Fake-CUDA shim for the CPU build of torch (compiled without CUDA).
//
// Two registrations make FakeTensorMode tensors on device "cuda" usable through backward:
//   * a no-op CUDA DeviceGuardImpl ($XMEM_FAKE_DEVICE_COUNT devices, one stream 0 per device, events that
//     are always complete), so `.to("cuda")` and the autograd engine's stream bookkeeping work;
//   * CUDA hooks with isBuilt() == true, so at::getAccelerator() is CUDA and backward runs CUDA nodes on the
//     CUDA device thread, as on a GPU.
// Nothing here touches memory: the tensors are FakeTensors, whose kernels are meta functions.
// Must be dlopen'ed with RTLD_GLOBAL BEFORE `import torch`: torch._C's init caches getCUDAHooks() forever.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Registry.h>

#include <atomic>
#include <cstdlib>

namespace {
using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;

int env_int(const char* name, int fallback) {
  const char* value = std::getenv(name);
  return value ? std::atoi(value) : fallback;
}
DeviceIndex fake_device_count() {
  static const DeviceIndex n = static_cast<DeviceIndex>(env_int("XMEM_FAKE_DEVICE_COUNT", 1));
  return n;
}
thread_local DeviceIndex t_current_device = 0;  // CUDA's current device is per host thread too

struct FakeCUDAGuardImpl final : c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device d) const override {
    Device old = getDevice();
    setDevice(d);
    return old;
  }
  Device getDevice() const override { return Device(DeviceType::CUDA, t_current_device); }
  void setDevice(Device d) const override {
    if (d.index() >= 0) t_current_device = d.index();
  }
  void uncheckedSetDevice(Device d) const noexcept override {
    if (d.index() >= 0) t_current_device = d.index();
  }
  Stream getStream(Device d) const override { return Stream(Stream::DEFAULT, resolve(d)); }
  Stream getDefaultStream(Device d) const override { return Stream(Stream::DEFAULT, resolve(d)); }
  Stream exchangeStream(Stream s) const override { return Stream(Stream::DEFAULT, s.device()); }
  DeviceIndex deviceCount() const noexcept override { return fake_device_count(); }
  // Events: any non-null handle means "recorded"; all work is complete at once.
  void record(void** event, const Stream&, const DeviceIndex, const c10::EventFlag) const override {
    if (event && !*event) *event = reinterpret_cast<void*>(1);
  }
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const Stream&) const override {}

 private:
  Device resolve(Device d) const { return Device(DeviceType::CUDA, d.index() < 0 ? t_current_device : d.index()); }
};

struct FakeCUDAHooks final : at::CUDAHooksInterface {
  explicit FakeCUDAHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return false; }  // no real device: torch must not try to initialise one
  bool hasPrimaryContext(DeviceIndex i) const override { return i >= 0 && i < fake_device_count(); }
  DeviceIndex deviceCount() const override { return fake_device_count(); }
  DeviceIndex getCurrentDevice() const override { return t_current_device; }
  DeviceIndex current_device() const override { return t_current_device; }
  void setCurrentDevice(DeviceIndex d) const override { t_current_device = d; }
  DeviceIndex exchangeDevice(DeviceIndex d) const override {
    DeviceIndex old = t_current_device;
    t_current_device = d;
    return old;
  }
  DeviceIndex maybeExchangeDevice(DeviceIndex d) const override { return exchangeDevice(d); }
  bool isPinnedPtr(const void*) const override { return false; }
  int getNumGPUs() const override { return 0; }
  void deviceSynchronize(DeviceIndex) const override {}
};

FakeCUDAGuardImpl g_guard;
c10::impl::DeviceGuardImplRegistrar g_guard_registrar(DeviceType::CUDA, &g_guard);
at::RegistererCUDAHooksRegistry g_hooks_registrar(
    "CUDAHooks", at::CUDAHooksRegistry(), at::RegistererCUDAHooksRegistry::DefaultCreator<FakeCUDAHooks>,
    c10::demangle_type<FakeCUDAHooks>());
}  // namespace

extern "C" int xmem_fake_cuda_active() {
  return dynamic_cast<const FakeCUDAHooks*>(&at::detail::getCUDAHooks()) != nullptr;
}
