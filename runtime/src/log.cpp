// The process-wide log sink behind kestrel/runtime/log.h: an atomic level and a callback behind a
// mutex-protected shared_ptr (copied out before the call, so a callback may log or replace itself).
#include "kestrel/runtime/log.h"

#include <atomic>
#include <cstdio>
#include <memory>
#include <mutex>

namespace kestrel {

namespace {

std::mutex g_mu;
std::shared_ptr<const LogCallback> g_callback;  // null: default sink
std::atomic<int> g_level{static_cast<int>(LogLevel::Info)};

void default_sink(LogLevel level, std::string_view component, std::string_view message) {
  const char* tag = level == LogLevel::Warning ? "warning: " : level == LogLevel::Error ? "error: " : "";
  std::fprintf(stderr, "[%.*s] %s%.*s\n", static_cast<int>(component.size()), component.data(), tag,
               static_cast<int>(message.size()), message.data());
}

}  // namespace

std::string_view log_level_name(LogLevel level) {
  switch (level) {
    case LogLevel::Debug: return "debug";
    case LogLevel::Info: return "info";
    case LogLevel::Warning: return "warning";
    case LogLevel::Error: return "error";
  }
  return "unknown";
}

void set_log_callback(LogCallback callback) {
  std::shared_ptr<const LogCallback> next;
  if (callback) next = std::make_shared<const LogCallback>(std::move(callback));
  std::lock_guard<std::mutex> lock(g_mu);
  g_callback = std::move(next);
}

bool log_callback_installed() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_callback != nullptr;
}

void set_log_level(LogLevel level) { g_level.store(static_cast<int>(level), std::memory_order_relaxed); }
LogLevel log_level() { return static_cast<LogLevel>(g_level.load(std::memory_order_relaxed)); }
bool log_enabled(LogLevel level) { return static_cast<int>(level) >= g_level.load(std::memory_order_relaxed); }

void log_message(LogLevel level, std::string_view component, std::string_view message) {
  if (!log_enabled(level)) return;
  std::shared_ptr<const LogCallback> cb;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    cb = g_callback;
  }
  try {
    if (cb)
      (*cb)(level, component, message);
    else
      default_sink(level, component, message);
  } catch (...) {
    // A throwing callback must not unwind through library code (destructors, kernels' callers).
  }
}

}  // namespace kestrel
