// The embedding API in one include: tensors and memory accounting, autograd, every op family, the
// models and the training pieces (AdamW, schedule, the config-driven Trainer, and its data
// parallelism: the Communicator, the launcher's rendezvous and the local launcher). No CUDA header is
// pulled in: devices, streams and budgets are passed as kestrel::Device, kestrel::StreamHandle
// (an opaque cudaStream_t) and byte counts. Kernel authors who need CUDA types include
// kestrel/cuda/context.h and kestrel/cuda/check.h themselves.
// Link the CMake target kestrel::kestrel (or pkg-config kestrel). JSON configs use nlohmann::json,
// which the package declares as a dependency.
#pragma once

// runtime: tensors, devices, memory accounting, budgets, streams, logging, errors
#include "kestrel/runtime/accumulate.h"
#include "kestrel/runtime/communicator.h"
#include "kestrel/runtime/device.h"
#include "kestrel/runtime/device_info.h"
#include "kestrel/runtime/dtype.h"
#include "kestrel/runtime/error.h"
#include "kestrel/runtime/local_launch.h"
#include "kestrel/runtime/log.h"
#include "kestrel/runtime/memory.h"
#include "kestrel/runtime/memory_budget.h"
#include "kestrel/runtime/memory_config.h"
#include "kestrel/runtime/memory_report.h"
#include "kestrel/runtime/memory_trace.h"
#include "kestrel/runtime/parallel.h"
#include "kestrel/runtime/random.h"
#include "kestrel/runtime/rendezvous.h"
#include "kestrel/runtime/stream_scope.h"
#include "kestrel/runtime/tensor.h"

// autograd: the tape, no-grad scopes, recompute regions
#include "kestrel/autograd/grad_mode.h"
#include "kestrel/autograd/recompute.h"
#include "kestrel/autograd/tape.h"

// ops: differentiable operations (CPU reference kernels; CUDA kernels when built with CUDA)
#include "kestrel/ops/activation.h"
#include "kestrel/ops/attention.h"
#include "kestrel/ops/cross_entropy.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/embedding.h"
#include "kestrel/ops/fp8.h"
#include "kestrel/ops/matmul.h"
#include "kestrel/ops/norm.h"
#include "kestrel/ops/optim.h"
#include "kestrel/ops/patch.h"
#include "kestrel/ops/reduce.h"
#include "kestrel/ops/rope.h"
#include "kestrel/ops/shape.h"
#include "kestrel/ops/softmax.h"

// models: configs, parameters with safetensors I/O, the decoder, the vision tower, the VLM
#include "kestrel/models/config.h"
#include "kestrel/models/decoder.h"
#include "kestrel/models/packed_batch.h"
#include "kestrel/models/parameters.h"
#include "kestrel/models/vision.h"
#include "kestrel/models/vlm.h"

// train: optimizer, schedule, run configuration and the in-process trainer loop
#include "kestrel/train/optimizer.h"
#include "kestrel/train/run_config.h"
#include "kestrel/train/schedule.h"
#include "kestrel/train/train_config.h"
#include "kestrel/train/trainer.h"
