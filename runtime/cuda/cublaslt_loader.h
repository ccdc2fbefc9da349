// Private: opening one particular cuBLASLt (cublaslt_api() opens the default one, once). The tests
// name a library that does not exist to check the error an absent cuBLASLt gives.
#pragma once

#include <string>

#include "kestrel/cuda/cublaslt_api.h"

namespace kestrel::cuda {

// "libcublasLt.so." + the major version of the cublasLt.h Kestrel was compiled against.
std::string cublaslt_library_name();

// Opens `library` (a bare name is searched as dlopen searches, then in the folder libcudart was
// loaded from; a path is opened as given) and resolves every entry point of CublasLtApi. Throws a
// kestrel::Error naming the library and what to do when it cannot be opened, lacks an entry point,
// or has another major version than the headers.
CublasLtApi load_cublaslt(const std::string& library);

}  // namespace kestrel::cuda
