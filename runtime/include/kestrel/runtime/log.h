// Library logging: every message Kestrel prints (notices, warnings, the trainer's progress lines)
// goes through one process-wide callback, so an embedding application can route them into its
// own logger or silence them. The default sink writes "[component] message" to stderr.
//
// Policy: logging never throws into the caller and never exits; a callback that throws has its
// exception swallowed. The callback may be called from any thread (concurrently), so it must be
// thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "kestrel/runtime/error.h"

namespace kestrel {

enum class LogLevel : uint8_t { Debug, Info, Warning, Error };
std::string_view log_level_name(LogLevel level);  // "debug", "info", "warning", "error"

using LogCallback = std::function<void(LogLevel level, std::string_view component, std::string_view message)>;

// Installs `callback` for the whole process; an empty function restores the default stderr sink.
void set_log_callback(LogCallback callback);
// True when an application callback is installed (the trainer then routes its progress lines there
// instead of printing them to stdout).
bool log_callback_installed();

// Messages below `level` are dropped before they reach the callback (default: Info).
void set_log_level(LogLevel level);
LogLevel log_level();
bool log_enabled(LogLevel level);

// Sends one message (already formatted) to the current sink.
void log_message(LogLevel level, std::string_view component, std::string_view message);

// Formats streamable parts only when the level is enabled: log_to(LogLevel::Warning, "attention", "slow path: ", why).
template <typename... Args>
void log_to(LogLevel level, const char* component, Args&&... parts) {
  if (log_enabled(level)) log_message(level, component, detail::concat(std::forward<Args>(parts)...));
}

}  // namespace kestrel
