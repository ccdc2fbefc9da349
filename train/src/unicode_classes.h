// Private: Unicode classes the BPE pre-tokenizer needs (see unicode_classes.cpp for the tables).
#pragma once

namespace kestrel::train::unicode {

bool is_letter(char32_t c);      // \p{L}
bool is_number(char32_t c);      // \p{N}
bool is_whitespace(char32_t c);  // \s (the White_Space property)

}  // namespace kestrel::train::unicode
