// Runs every case of the op table (support/op_table.h) on the CPU: forward against its float64
// reference with f64, f32 and bf16 inputs, and backward against finite differences in f64.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "support/op_table.h"

namespace kestrel::testing {
namespace {

const std::vector<OpCase>& table() {
  static const std::vector<OpCase> cases = all_op_cases();
  return cases;
}

// Indices of the cases whose shape class is small enough for finite differences.
std::vector<size_t> gradcheck_cases() {
  std::vector<size_t> idx;
  for (size_t i = 0; i < table().size(); ++i)
    if (table()[i].gradcheck) idx.push_back(i);
  return idx;
}

std::string case_name(const ::testing::TestParamInfo<size_t>& info) { return table()[info.param].id(); }

class OpTable : public ::testing::TestWithParam<size_t> {};
class OpTableGrad : public ::testing::TestWithParam<size_t> {};

TEST_P(OpTable, ForwardMatchesFloat64Reference) {
  const OpCase& c = table()[GetParam()];
  for (DType dt : c.dtypes) EXPECT_TRUE(check_forward(c, dt));
}

TEST_P(OpTableGrad, BackwardMatchesFiniteDifferences) { EXPECT_TRUE(check_backward(table()[GetParam()])); }

INSTANTIATE_TEST_SUITE_P(Cpu, OpTable, ::testing::Range<size_t>(0, table().size()), case_name);
INSTANTIATE_TEST_SUITE_P(Cpu, OpTableGrad, ::testing::ValuesIn(gradcheck_cases()), case_name);

TEST(OpTableSummary, CaseIdsAreUniqueAndCoverageIsPrinted) {
  std::set<std::string> ids;
  std::map<std::string, int> per_op;
  int grad = 0;
  for (const OpCase& c : table()) {
    EXPECT_TRUE(ids.insert(c.id()).second) << "duplicate case " << c.id();
    ++per_op[c.name];
    grad += c.gradcheck;
  }
  std::string list;
  for (const auto& [name, n] : per_op) list += " " + name + "(" + std::to_string(n) + ")";
  std::printf("op table: %zu ops, %zu cases (%d with gradcheck):%s\n", per_op.size(), table().size(), grad, list.c_str());
}

}  // namespace
}  // namespace kestrel::testing
