// Private: leaf capture used by recompute regions. While a region runs its forward with grad mode
// off, should_record() notes each leaf that requires grad, so the region's tape entry can hold
// those leaves back from firing their grad-ready hooks until the region's backward has run.
#pragma once

#include <memory>
#include <vector>

#include "kestrel/runtime/autograd_meta.h"

namespace kestrel::autograd::detail {
std::vector<std::shared_ptr<AutogradMeta>>*& leaf_capture();
}
