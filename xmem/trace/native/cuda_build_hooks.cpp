// Fake-CUDA shim for the CUDA build of torch on a machine with no GPU and no driver.
//
// Registers, at REGISTRY_PREFERRED priority, CUDA hooks that forward every question to torch's real
// at::cuda::detail::CUDAHooks except:
//   * hasPrimaryContext(i): true for i < $XMEM_FAKE_DEVICE_COUNT. The autograd engine asks it for every
//     device before backward (GraphTask::stash_current_streams); the real hooks throw with zero devices.
//   * the cuDNN capability questions, answered from $XMEM_FAKE_SM (major*10+minor) with the thresholds of
//     ATen's CUDAHooks.cpp, since the real ones read device properties that do not exist here.
// Must be dlopen'ed with RTLD_GLOBAL BEFORE `import torch`: torch._C's init caches getCUDAHooks() forever.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Registry.h>

#include <cstdio>
#include <cstdlib>
#include <memory>

namespace {
using at::DeviceIndex;

int env_int(const char* name, int fallback) {
  const char* value = std::getenv(name);
  return value ? std::atoi(value) : fallback;
}
int fake_sm() { static const int sm = env_int("XMEM_FAKE_SM", 90); return sm; }
int fake_device_count() { static const int n = env_int("XMEM_FAKE_DEVICE_COUNT", 1); return n; }

std::unique_ptr<at::CUDAHooksInterface> g_real;  // torch's own CUDAHooks, which we delegate to

struct DelegatingCUDAHooks final : at::CUDAHooksInterface {
  const at::CUDAHooksInterface& r() const { return *g_real; }

  // Changed answers.
  bool hasPrimaryContext(DeviceIndex i) const override { return i >= 0 && i < fake_device_count(); }
  bool supportsDilatedConvolutionWithCuDNN() const override { return r().compiledWithCuDNN() && fake_sm() >= 50; }
  bool supportsDepthwiseConvolutionWithCuDNN() const override { return r().compiledWithCuDNN() && fake_sm() >= 70; }
  bool supportsBFloat16ConvolutionWithCuDNNv8() const override { return r().compiledWithCuDNN() && fake_sm() >= 80; }

  // Everything else: torch's answer.
  bool isBuilt() const override { return r().isBuilt(); }
  bool isAvailable() const override { return r().isAvailable(); }
  void init() const override { r().init(); }
  DeviceIndex deviceCount() const override { return r().deviceCount(); }
  void setCurrentDevice(DeviceIndex d) const override { r().setCurrentDevice(d); }
  DeviceIndex getCurrentDevice() const override { return r().getCurrentDevice(); }
  DeviceIndex exchangeDevice(DeviceIndex d) const override { return r().exchangeDevice(d); }
  DeviceIndex maybeExchangeDevice(DeviceIndex d) const override { return r().maybeExchangeDevice(d); }
  bool isPinnedPtr(const void* p) const override { return r().isPinnedPtr(p); }
  at::Allocator* getPinnedMemoryAllocator() const override { return r().getPinnedMemoryAllocator(); }
  at::Device getDeviceFromPtr(void* p) const override { return r().getDeviceFromPtr(p); }
  const at::Generator& getDefaultGenerator(DeviceIndex i = -1) const override { return r().getDefaultGenerator(i); }
  at::Generator getNewGenerator(DeviceIndex i = -1) const override { return r().getNewGenerator(i); }
  bool hasCUDA() const override { return r().hasCUDA(); }
  bool hasCUDART() const override { return r().hasCUDART(); }
  bool hasMAGMA() const override { return r().hasMAGMA(); }
  bool hasCuDNN() const override { return r().hasCuDNN(); }
  bool hasCuSOLVER() const override { return r().hasCuSOLVER(); }
  bool hasCuBLASLt() const override { return r().hasCuBLASLt(); }
  bool hasROCM() const override { return r().hasROCM(); }
  bool hasCKSDPA() const override { return r().hasCKSDPA(); }
  bool hasCKGEMM() const override { return r().hasCKGEMM(); }
  const at::cuda::NVRTC& nvrtc() const override { return r().nvrtc(); }
  DeviceIndex current_device() const override { return r().current_device(); }
  at::Allocator* getCUDADeviceAllocator() const override { return r().getCUDADeviceAllocator(); }
  bool compiledWithCuDNN() const override { return r().compiledWithCuDNN(); }
  bool compiledWithMIOpen() const override { return r().compiledWithMIOpen(); }
  bool supportsBFloat16RNNWithCuDNN() const override { return r().supportsBFloat16RNNWithCuDNN(); }
  long versionCuDNN() const override { return r().versionCuDNN(); }
  long versionRuntimeCuDNN() const override { return r().versionRuntimeCuDNN(); }
  long versionCuDNNFrontend() const override { return r().versionCuDNNFrontend(); }
  long versionMIOpen() const override { return r().versionMIOpen(); }
  long versionHipBLASLt() const override { return r().versionHipBLASLt(); }
  long versionCUDART() const override { return r().versionCUDART(); }
  std::string showConfig() const override { return r().showConfig(); }
  double batchnormMinEpsilonCuDNN() const override { return r().batchnormMinEpsilonCuDNN(); }
  int64_t cuFFTGetPlanCacheMaxSize(DeviceIndex i) const override { return r().cuFFTGetPlanCacheMaxSize(i); }
  void cuFFTSetPlanCacheMaxSize(DeviceIndex i, int64_t m) const override { r().cuFFTSetPlanCacheMaxSize(i, m); }
  int64_t cuFFTGetPlanCacheSize(DeviceIndex i) const override { return r().cuFFTGetPlanCacheSize(i); }
  void cuFFTClearPlanCache(DeviceIndex i) const override { r().cuFFTClearPlanCache(i); }
  int getNumGPUs() const override { return r().getNumGPUs(); }
  void deviceSynchronize(DeviceIndex i) const override { r().deviceSynchronize(i); }
};

// libtorch_cuda is a NEEDED dependency of this library, so its static initialiser has already registered
// the real "CUDAHooks" (at REGISTRY_DEFAULT) when ours runs.
struct Installer {
  Installer() {
    auto* registry = at::CUDAHooksRegistry();
    g_real = registry->Create("CUDAHooks", at::CUDAHooksArgs{});
    if (!g_real) {
      std::fprintf(stderr, "xmem fake-CUDA shim: torch registered no CUDAHooks\n");
      return;
    }
    registry->Register(
        "CUDAHooks",
        [](at::CUDAHooksArgs) -> std::unique_ptr<at::CUDAHooksInterface> { return std::make_unique<DelegatingCUDAHooks>(); },
        c10::REGISTRY_PREFERRED);
  }
} g_installer;
}  // namespace

// 1 when torch's live CUDA hooks are ours (checked after `import torch`).
extern "C" int xmem_fake_cuda_active() {
  return dynamic_cast<const DelegatingCUDAHooks*>(&at::detail::getCUDAHooks()) != nullptr;
}
