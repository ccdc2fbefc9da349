// JSON parsing with errors that name the file and position but never quote the file's bytes.
#include "kestrel/models/json_text.h"

#include "kestrel/runtime/error.h"

namespace kestrel::models {

std::string json_error_text(const std::exception& e) {
  std::string s = e.what();
  if (s.rfind("[json.exception.", 0) == 0) {
    const size_t close = s.find("] ");
    if (close != std::string::npos) s.erase(0, close + 2);
  }
  if (const size_t at = s.find("; last read:"); at != std::string::npos) s.erase(at);
  if (s.rfind("number overflow", 0) == 0) s = "number overflow (a number too large for a double)";
  return s;
}

nlohmann::json parse_json_text(std::string_view text, const std::string& what, const char* component) {
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    throw make_error(component, what, " is not valid JSON: ", json_error_text(e));
  }
}

}  // namespace kestrel::models
