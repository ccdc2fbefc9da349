#include "kestrel/runtime/shape.h"

#include "kestrel/runtime/error.h"

namespace kestrel {

int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Strides contiguous_strides(const Shape& s) {
  Strides st(s.size());
  int64_t acc = 1;
  for (int i = static_cast<int>(s.size()) - 1; i >= 0; --i) {
    st[i] = acc;
    acc *= s[i];
  }
  return st;
}

std::string shape_str(const Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) r += ", ";
    r += std::to_string(s[i]);
  }
  return r + "]";
}

int normalize_dim(int64_t dim, int64_t rank, const char* component) {
  int64_t d = dim < 0 ? dim + rank : dim;
  KESTREL_CHECK(d >= 0 && d < rank, component, "dim ", dim, " out of range for a ", rank, "-D tensor");
  return static_cast<int>(d);
}

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* component) {
  size_t r = std::max(a.size(), b.size());
  Shape out(r);
  for (size_t i = 0; i < r; ++i) {
    int64_t da = i < r - a.size() ? 1 : a[i - (r - a.size())];
    int64_t db = i < r - b.size() ? 1 : b[i - (r - b.size())];
    KESTREL_CHECK(da == db || da == 1 || db == 1, component, "shapes ", shape_str(a), " and ",
                  shape_str(b), " do not broadcast");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

}  // namespace kestrel
