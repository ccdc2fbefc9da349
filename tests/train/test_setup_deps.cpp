// tools/setup_deps.sh on simulated machines (issue 18 item 6): runs tools/test_setup_deps.sh, which
// puts fake bin folders on PATH (cmake and ninja from "pip", no Debian packages, an apt-get that
// cannot reach a registry or installs nothing, not root) and checks that set-up goes on when all is
// present, installs only what is missing, and otherwise names what is missing and exits 1.
// It installs nothing and takes about 15 s (a CMake probe per case).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "support/temp_dir.h"

using kestrel::testing::source_dir;

TEST(SetupDeps, SimulatedMachines) {
  const std::string script = source_dir() + "/tools/test_setup_deps.sh";
  if (!std::filesystem::exists(script)) GTEST_SKIP() << "no " << script;
  const int rc = std::system(("bash '" + script + "'").c_str());
  ASSERT_TRUE(WIFEXITED(rc)) << "the script did not exit normally";
  EXPECT_EQ(WEXITSTATUS(rc), 0) << "tools/test_setup_deps.sh failed; its output above names the case";
}
