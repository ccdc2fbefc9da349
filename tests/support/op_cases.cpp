// The list of op-case families for the table-driven harness (support/op_table.h). To add a family:
// write tests/support/op_cases_<family>.cpp defining add_<family>_cases, then add one declaration
// and one list entry below.
#include "support/op_table.h"

namespace kestrel::testing {

void add_elementwise_cases(std::vector<OpCase>& cases);
void add_reduce_cases(std::vector<OpCase>& cases);
void add_matmul_cases(std::vector<OpCase>& cases);
void add_shape_cases(std::vector<OpCase>& cases);
void add_softmax_cases(std::vector<OpCase>& cases);
void add_norm_cases(std::vector<OpCase>& cases);
void add_rope_cases(std::vector<OpCase>& cases);
void add_activation_cases(std::vector<OpCase>& cases);
void add_embedding_cases(std::vector<OpCase>& cases);
void add_patch_cases(std::vector<OpCase>& cases);
void add_attention_cases(std::vector<OpCase>& cases);
void add_cross_entropy_cases(std::vector<OpCase>& cases);
void add_optim_cases(std::vector<OpCase>& cases);

std::vector<OpCase> all_op_cases() {
  using AddCases = void (*)(std::vector<OpCase>&);
  const AddCases families[] = {
      add_elementwise_cases,
      add_reduce_cases,
      add_matmul_cases,
      add_shape_cases,
      add_softmax_cases,
      add_norm_cases,
      add_rope_cases,
      add_activation_cases,
      add_embedding_cases,
      add_patch_cases,
      add_attention_cases,
      add_cross_entropy_cases,
      add_optim_cases,
  };
  std::vector<OpCase> cases;
  for (AddCases add : families) add(cases);
  return cases;
}

}  // namespace kestrel::testing
