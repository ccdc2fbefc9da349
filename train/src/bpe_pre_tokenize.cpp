// The byte-level BPE pre-tokenizer split (GPT-2, Qwen2, Llama 3 regexes; see bpe_tokenizer.h),
// written as a scanner instead of a regex engine. The regexes are alternations matched leftmost-
// first by a backtracking engine, and every character starts a match of some alternative (it is a
// letter, a number, whitespace or "other"), so the split is: at each position, the first
// alternative that matches there, taken as long as its greedy quantifiers allow. The backtracking
// cases are spelled out where they occur (\s+(?!\S) and \s*[\r\n]+).
#include <cstdint>
#include <string>
#include <vector>

#include "kestrel/train/bpe_tokenizer.h"
#include "unicode_classes.h"

namespace kestrel::train {
namespace {

// One decoded code point and its byte span; invalid UTF-8 bytes decode to themselves + 0x110000
// (outside Unicode: neither letter, number nor whitespace, so they split like punctuation).
struct Char {
  char32_t cp;
  size_t begin, end;
};

std::vector<Char> decode_utf8(const std::string& s) {
  std::vector<Char> out;
  out.reserve(s.size());
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    const auto b0 = static_cast<unsigned char>(s[i]);
    int len = b0 < 0x80 ? 1 : (b0 >> 5) == 6 ? 2 : (b0 >> 4) == 14 ? 3 : (b0 >> 3) == 30 ? 4 : 0;
    char32_t cp = len == 1 ? b0 : len == 2 ? (b0 & 0x1F) : len == 3 ? (b0 & 0x0F) : (b0 & 0x07);
    bool ok = len > 0 && i + static_cast<size_t>(len) <= n;
    for (int k = 1; ok && k < len; ++k) {
      const auto b = static_cast<unsigned char>(s[i + static_cast<size_t>(k)]);
      ok = (b & 0xC0) == 0x80;
      cp = (cp << 6) | (b & 0x3F);
    }
    // Overlong forms, surrogates and values past U+10FFFF are invalid too.
    if (ok) ok = !(len == 2 && cp < 0x80) && !(len == 3 && cp < 0x800) && !(len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) &&
                 !(cp >= 0xD800 && cp <= 0xDFFF);
    if (!ok) {
      out.push_back({static_cast<char32_t>(0x110000 + b0), i, i + 1});
      i += 1;
    } else {
      out.push_back({cp, i, i + static_cast<size_t>(len)});
      i += static_cast<size_t>(len);
    }
  }
  return out;
}

class Scanner {
 public:
  Scanner(const std::vector<Char>& c) : c_(c), n_(c.size()) {}

  bool letter(size_t i) const { return i < n_ && unicode::is_letter(c_[i].cp); }
  bool number(size_t i) const { return i < n_ && unicode::is_number(c_[i].cp); }
  bool space(size_t i) const { return i < n_ && unicode::is_whitespace(c_[i].cp); }
  bool other(size_t i) const { return i < n_ && !letter(i) && !number(i) && !space(i); }  // [^\s\p{L}\p{N}]
  bool newline(size_t i) const { return i < n_ && (c_[i].cp == '\r' || c_[i].cp == '\n'); }
  bool is(size_t i, char32_t ch) const { return i < n_ && c_[i].cp == ch; }
  bool is_ci(size_t i, char ch) const { return i < n_ && (c_[i].cp == static_cast<char32_t>(ch) || c_[i].cp == static_cast<char32_t>(ch - 32)); }

  template <typename Pred>
  size_t run(size_t i, Pred p) const {  // end of the maximal run of p starting at i
    while (p(i)) ++i;
    return i;
  }

  // 's|'t|'re|'ve|'m|'ll|'d (case-insensitively for Qwen2 / Llama 3): end, or 0 for no match.
  size_t contraction(size_t i, bool ci) const {
    if (!is(i, '\'')) return 0;
    auto at = [&](size_t k, char ch) { return ci ? is_ci(k, ch) : is(k, static_cast<char32_t>(ch)); };
    if (at(i + 1, 's') || at(i + 1, 't') || at(i + 1, 'm') || at(i + 1, 'd')) return i + 2;
    if ((at(i + 1, 'r') && at(i + 2, 'e')) || (at(i + 1, 'v') && at(i + 2, 'e')) || (at(i + 1, 'l') && at(i + 2, 'l')))
      return i + 3;
    return 0;
  }

  // \s+(?!\S): the whitespace run, less its last character when a non-space follows.
  size_t spaces_not_before_text(size_t i) const {
    size_t e = run(i, [&](size_t k) { return space(k); });
    if (e == i) return 0;
    if (e == n_) return e;
    return e - 1 > i ? e - 1 : 0;
  }

  size_t next_gpt2(size_t i) const {
    if (size_t e = contraction(i, false)) return e;
    const size_t j = is(i, ' ') ? i + 1 : i;  // " ?" is greedy: with the space if what follows matches
    auto letter_p = [&](size_t k) { return letter(k); };
    auto number_p = [&](size_t k) { return number(k); };
    auto other_p = [&](size_t k) { return other(k); };
    if (letter(j)) return run(j, letter_p);
    if (letter(i)) return run(i, letter_p);
    if (number(j)) return run(j, number_p);
    if (number(i)) return run(i, number_p);
    if (other(j)) return run(j, other_p);
    if (other(i)) return run(i, other_p);
    if (size_t e = spaces_not_before_text(i)) return e;
    return run(i, [&](size_t k) { return space(k); });
  }

  size_t next_qwen(size_t i, size_t max_digits) const {
    if (size_t e = contraction(i, true)) return e;
    auto letter_p = [&](size_t k) { return letter(k); };
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if (i < n_ && !newline(i) && !letter(i) && !number(i) && letter(i + 1)) return run(i + 1, letter_p);
    if (letter(i)) return run(i, letter_p);
    // \p{N}{1,max}
    if (number(i)) {
      size_t e = i;
      while (e - i < max_digits && number(e)) ++e;
      return e;
    }
    // " ?[^\s\p{L}\p{N}]+[\r\n]*"
    const size_t j = is(i, ' ') && other(i + 1) ? i + 1 : i;
    if (other(j)) {
      size_t e = run(j, [&](size_t k) { return other(k); });
      return run(e, [&](size_t k) { return newline(k); });
    }
    // \s*[\r\n]+: \s* backs off to just before the last newline of the whitespace run, and
    // [\r\n]+ then takes that newline (the characters after it, if any, are not newlines).
    size_t e = run(i, [&](size_t k) { return space(k); });
    for (size_t k = e; k > i; --k)
      if (newline(k - 1)) return k;
    if (size_t e2 = spaces_not_before_text(i)) return e2;
    return e;
  }

 private:
  const std::vector<Char>& c_;
  size_t n_;
};

}  // namespace

std::vector<std::string> bpe_pre_tokenize(const std::string& text, BpeSplit split) {
  const std::vector<Char> chars = decode_utf8(text);
  Scanner sc(chars);
  std::vector<std::string> out;
  size_t i = 0;
  while (i < chars.size()) {
    size_t e = split == BpeSplit::Gpt2 ? sc.next_gpt2(i) : sc.next_qwen(i, split == BpeSplit::Qwen2 ? 1 : 3);
    if (e <= i) e = i + 1;  // unreachable by construction; never loop forever
    out.push_back(text.substr(chars[i].begin, chars[e - 1].end - chars[i].begin));
    i = e;
  }
  return out;
}

}  // namespace kestrel::train
