// Private: the pieces of checkpoint_io shared between checkpoint_io.cpp (writing, finding, loading)
// and checkpoint_manifest.cpp (the manifest and verification).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace kestrel::train {

// "step_00000042"; parse_... takes only "step_" followed by digits.
std::string checkpoint_step_name(int64_t step);
std::optional<int64_t> parse_checkpoint_step_name(const std::string& name);

// Writes dir/manifest.json listing the size and XXH64 of every regular file already in `dir`.
void write_checkpoint_manifest(const std::string& dir, int64_t step, uint64_t data_position,
                               const std::string& optimizer_state);

}  // namespace kestrel::train
