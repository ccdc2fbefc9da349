// cuBLASLt opened at run time (kestrel/cuda/cublaslt_api.h states why). Policy:
// - the library is libcublasLt.so.<CUBLAS_VER_MAJOR>, the soname of the toolkit whose headers we
//   were compiled against; dlopen searches for it as it does for any library (LD_LIBRARY_PATH,
//   libkestrel's RUNPATH, the ld.so cache), and where that fails, in the folder libcudart.so (which
//   libkestrel links) was loaded from: the toolkit's lib folder, where cuBLAS sits beside it;
// - it is opened once per process, RTLD_LOCAL, and never closed; a failed load throws and is tried
//   again by the next call (a magic static whose initialiser throws is not initialised);
// - a library of another major version than the headers is refused: cuBLASLt's ABI (its structs and
//   enums) is kept within a major version only.
#include "cuda/cublaslt_loader.h"

#include <dlfcn.h>

#include <cuda_runtime.h>

#include <string>

#include "kestrel/runtime/error.h"

namespace kestrel::cuda {
namespace {

constexpr size_t kHeaderMajor = CUBLAS_VER_MAJOR;

// The folder libcudart was loaded from, or "" when it cannot be told.
std::string cudart_folder() {
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&cudaRuntimeGetVersion), &info) == 0 || info.dli_fname == nullptr) return "";
  std::string path(info.dli_fname);
  if (path.find("cudart") == std::string::npos) return "";  // resolved to some other object: no hint
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? "" : path.substr(0, slash);
}

template <typename F>
void resolve(void* lib, const std::string& library, F& fn, const char* name) {
  fn = reinterpret_cast<F>(::dlsym(lib, name));
  KESTREL_CHECK(fn != nullptr, "cublas", library, " has no ", name, " (not cuBLASLt, or one older than the headers' ",
                CUBLAS_VER_MAJOR, ".", CUBLAS_VER_MINOR, ")");
}

}  // namespace

std::string cublaslt_library_name() { return "libcublasLt.so." + std::to_string(kHeaderMajor); }

CublasLtApi load_cublaslt(const std::string& library) {
  void* lib = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::string why;
  if (!lib) {
    const char* e = ::dlerror();
    why = e ? e : "unknown";
    const std::string folder = library.find('/') == std::string::npos ? cudart_folder() : "";
    if (!folder.empty()) {
      const std::string beside = folder + "/" + library;
      lib = ::dlopen(beside.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (!lib) {
        e = ::dlerror();
        why += "; beside libcudart: ";
        why += e ? e : "unknown";
      }
    }
  }
  if (!lib)
    throw make_error("cublas", "cannot load ", library, " (", why, "): install cuBLAS of CUDA ", kHeaderMajor,
                     " (the toolkit's libcublas) or put its lib folder on LD_LIBRARY_PATH (e.g. /usr/local/cuda/lib64)");
  CublasLtApi a;
  resolve(lib, library, a.GetVersion, "cublasLtGetVersion");
  const size_t major = a.GetVersion() / 10000;
  KESTREL_CHECK(major == kHeaderMajor, "cublas", library, " is cuBLAS ", major, " but Kestrel was built against ",
                kHeaderMajor, ": put the lib folder of a CUDA ", kHeaderMajor, " toolkit on LD_LIBRARY_PATH");
  resolve(lib, library, a.Create, "cublasLtCreate");
  resolve(lib, library, a.Destroy, "cublasLtDestroy");
  resolve(lib, library, a.Matmul, "cublasLtMatmul");
  resolve(lib, library, a.MatmulDescCreate, "cublasLtMatmulDescCreate");
  resolve(lib, library, a.MatmulDescDestroy, "cublasLtMatmulDescDestroy");
  resolve(lib, library, a.MatmulDescSetAttribute, "cublasLtMatmulDescSetAttribute");
  resolve(lib, library, a.MatrixLayoutCreate, "cublasLtMatrixLayoutCreate");
  resolve(lib, library, a.MatrixLayoutDestroy, "cublasLtMatrixLayoutDestroy");
  resolve(lib, library, a.MatrixLayoutSetAttribute, "cublasLtMatrixLayoutSetAttribute");
  resolve(lib, library, a.MatmulPreferenceCreate, "cublasLtMatmulPreferenceCreate");
  resolve(lib, library, a.MatmulPreferenceDestroy, "cublasLtMatmulPreferenceDestroy");
  resolve(lib, library, a.MatmulPreferenceSetAttribute, "cublasLtMatmulPreferenceSetAttribute");
  resolve(lib, library, a.MatmulAlgoGetHeuristic, "cublasLtMatmulAlgoGetHeuristic");
  return a;  // the library stays open for the process's life
}

const CublasLtApi& cublaslt_api() {
  static const CublasLtApi api = load_cublaslt(cublaslt_library_name());
  return api;
}

}  // namespace kestrel::cuda
