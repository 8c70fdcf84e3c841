// Which NIXL releases the core calls (nixl.h: kMinVersion, kEndVersion, WheelVersion,
// VersionRefusal): the range check, and the version read from the wheel's metadata beside
// the library in the layouts pip installs. Load itself (once per process) refusing a release
// outside the range is tests/unit/test_nixl_version.py's, in a process of its own.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "nixl.h"

namespace nx = datadist::nixl;

namespace {

/// A fresh directory under TMPDIR, removed (with what the test put there) at the end.
struct TempDir {
  std::string path;
  TempDir() {
    const char *tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/dd_nixl_version_XXXXXX";
    path = mkdtemp(templ.data()) ? templ : "";
  }
  ~TempDir() {
    if (!path.empty()) (void)!std::system(("rm -rf '" + path + "'").c_str());
  }
};

void Write(const std::string &path, const std::string &text) { std::ofstream(path) << text; }

/// site/<libs>/libnixl_capi.so and, when `version` is given, site/<dist>/METADATA.
std::string Install(const std::string &site, const std::string &libs, const std::string &dist,
                    const std::string &version) {
  mkdir((site + "/" + libs).c_str(), 0700);
  Write(site + "/" + libs + "/libnixl_capi.so", "");
  if (!version.empty()) {
    mkdir((site + "/" + dist).c_str(), 0700);
    Write(site + "/" + dist + "/METADATA",
          "Metadata-Version: 2.4\nName: nixl-cu12\nVersion: " + version + "\nSummary: x\n\nVersion: 9.9.9\n");
  }
  return site + "/" + libs + "/libnixl_capi.so";
}

}  // namespace

TEST(NixlVersion, TheReleasesWrittenAgainstAreTaken) {
  EXPECT_EQ(nx::VersionRefusal("1.5.1"), "");
  EXPECT_EQ(nx::VersionRefusal(nx::kMinVersion), "");
  EXPECT_EQ(nx::VersionRefusal("1.5.9.post1"), "");  // a suffix after three numbers is ignored
}

TEST(NixlVersion, OthersAreRefusedSayingWhichAreTaken) {
  for (const char *v : {"1.4.1", "0.10.1", nx::kEndVersion, "2.0.0", "1.50.0"}) {
    const std::string why = nx::VersionRefusal(v);
    EXPECT_NE(why.find(std::string("NIXL ") + v + " is outside"), std::string::npos) << why;
    EXPECT_NE(why.find(std::string(">= ") + nx::kMinVersion + ", < " + nx::kEndVersion), std::string::npos) << why;
  }
  for (const char *v : {"", "1.5", "one.five.zero", "1..5"}) {
    const std::string why = nx::VersionRefusal(v);
    EXPECT_NE(why.find("NIXL's version"), std::string::npos) << v << ": " << why;
  }
}

TEST(NixlVersion, ReadFromTheWheelBesideTheLibrary) {
  TempDir site;
  ASSERT_FALSE(site.path.empty());
  // meson-python's layout (nixl-cu12 1.5.1): .nixl_cu12.mesonpy.libs beside the dist-info
  EXPECT_EQ(nx::WheelVersion(Install(site.path, ".nixl_cu12.mesonpy.libs", "nixl_cu12-1.5.1.dist-info", "1.5.1")),
            "1.5.1");
  // auditwheel's (<module>.libs), another module's dist-info beside it not taken
  Install(site.path, "other.libs", "other-7.0.0.dist-info", "7.0.0");
  EXPECT_EQ(nx::WheelVersion(Install(site.path, "nixl_cu13.libs", "nixl_cu13-1.4.0.dist-info", "1.4.0")), "1.4.0");
  // the library in the package folder itself
  EXPECT_EQ(nx::WheelVersion(Install(site.path, "nixl", "nixl-1.6.2.dist-info", "1.6.2")), "1.6.2");
}

TEST(NixlVersion, NoWheelNoVersion) {
  TempDir site;
  ASSERT_FALSE(site.path.empty());
  EXPECT_EQ(nx::WheelVersion(Install(site.path, ".nixl_cu12.mesonpy.libs", "", "")), "");
  EXPECT_EQ(nx::WheelVersion(site.path + "/nowhere/libnixl_capi.so"), "");
}
