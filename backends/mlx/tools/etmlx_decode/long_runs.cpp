#include "long_runs.h"

namespace etmlx {

namespace {

bool is_space(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

// What a cut between two bytes of different kinds separates: the regex
// pre-tokenizers end a letter run, a digit run and a punctuation run there.
int kind(unsigned char c) {
  if (c >= 0x80) return 0;
  if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') return 1;
  if (c >= '0' && c <= '9') return 2;
  return is_space(c) ? 3 : 4;
}

bool char_boundary(std::string_view text, size_t at) {
  return at == text.size() || (static_cast<unsigned char>(text[at]) & 0xC0) != 0x80;
}

// Whether an occurrence of one of `keep_whole` spans the cut before byte `at`.
bool splits_a_token(std::string_view text, size_t at, const std::vector<std::string>& keep_whole) {
  for (const std::string& token : keep_whole) {
    for (size_t back = 1; back < token.size() && back <= at; ++back) {
      if (text.compare(at - back, token.size(), token) == 0) return true;
    }
  }
  return false;
}

// The cut in (lo, hi]: the last kind change, else the last character boundary,
// that splits no added token; hi when every byte there is inside one.
size_t choose_cut(std::string_view text, size_t lo, size_t hi, const std::vector<std::string>& keep_whole) {
  for (const bool want_kind_change : {true, false}) {
    for (size_t at = hi; at > lo; --at) {
      if (!char_boundary(text, at)) continue;
      const auto before = static_cast<unsigned char>(text[at - 1]), after = static_cast<unsigned char>(text[at]);
      if (want_kind_change && kind(before) == kind(after)) continue;
      if (!splits_a_token(text, at, keep_whole)) return at;
    }
  }
  while (hi > lo + 1 && !char_boundary(text, hi)) --hi;
  return hi;
}

}  // namespace

std::vector<std::string_view> split_long_runs(std::string_view text, size_t max_run,
                                              const std::vector<std::string>& keep_whole) {
  std::vector<std::string_view> pieces;
  if (max_run < 8) max_run = 8;  // room for a UTF-8 character and a choice of cut
  size_t piece = 0, run = 0;
  for (size_t at = 1; at < text.size(); ++at) {
    if (is_space(static_cast<unsigned char>(text[at])) != is_space(static_cast<unsigned char>(text[at - 1]))) {
      run = at;
    }
    const size_t from = run > piece ? run : piece;  // the run so far, within this piece
    if (at - from < max_run) continue;
    const size_t cut = choose_cut(text, from + max_run / 2, at, keep_whole);
    pieces.push_back(text.substr(piece, cut - piece));
    piece = cut;
  }
  if (piece < text.size() || pieces.empty()) pieces.push_back(text.substr(piece));
  return pieces;
}

}  // namespace etmlx
