// JSON read from files, parsed so that an error says what is wrong and where, never quoting the
// file's bytes: a path taken from an untrusted index may name a file that is not JSON at all (a key,
// a password file), and its first bytes must not end up in a log.
#pragma once

#include <exception>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace kestrel::models {

// The JSON library's message for `e` without its exception id and without the input it quotes
// ("; last read: '...'", the digits of an overflowing number): "parse error at line 1, column 3:
// syntax error while parsing value - invalid literal".
std::string json_error_text(const std::exception& e);

// Parses `text`; throws kestrel::Error "[component] <what> is not valid JSON: <json_error_text>"
// for any failure of the JSON library (syntax, number overflow, ...).
nlohmann::json parse_json_text(std::string_view text, const std::string& what, const char* component);

}  // namespace kestrel::models
