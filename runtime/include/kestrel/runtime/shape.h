// Shapes and strides (in elements), with the small helpers views and kernels need.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace kestrel {

using Shape = std::vector<int64_t>;
using Strides = std::vector<int64_t>;

int64_t numel(const Shape& s);
Strides contiguous_strides(const Shape& s);
std::string shape_str(const Shape& s);  // "[2, 3, 4]"
// Wraps a possibly negative dimension index; throws "[component] dim d out of range for rank r".
int normalize_dim(int64_t dim, int64_t rank, const char* component);
// Broadcast of two shapes (numpy rules), or throws naming the component and both shapes.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* component);

}  // namespace kestrel
