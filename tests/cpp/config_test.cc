// Config::set: every option by its keyword, strict parsing, errors naming the option.
#include <gtest/gtest.h>

#include <cstdlib>

#include "tether/config.h"

namespace tether {
namespace {

TEST(Config, SetsEachKindOfOption) {
  Config c;
  ASSERT_TRUE(c.set("channels", "7").is_ok());
  EXPECT_EQ(c.channels, 7u);
  ASSERT_TRUE(c.set("chunk_bytes", "0x100000").is_ok());
  EXPECT_EQ(c.chunk_bytes, 1u << 20);
  ASSERT_TRUE(c.set("peer_timeout", "2.5").is_ok());
  EXPECT_EQ(c.peer_timeout_ms, 2500u);
  ASSERT_TRUE(c.set("transport", "tcp").is_ok());
  EXPECT_EQ(c.transport, "tcp");
  ASSERT_TRUE(c.set("disable_ipc", "true").is_ok());
  EXPECT_TRUE(c.disable_ipc);
  ASSERT_TRUE(c.set("port", "65535").is_ok());
  EXPECT_EQ(c.port, 65535);
}

TEST(Config, RefusesBadValuesNamingTheOption) {
  Config c;
  const uint32_t before = c.channels;
  for (const char* bad : {"x", "-1", " 1", "1x", "", "99999999999999999999"}) {
    Status s = c.set("channels", bad);
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("channels"), std::string::npos) << s.message();
  }
  EXPECT_EQ(c.channels, before);
  EXPECT_EQ(c.set("port", "65536").code(), Code::kInvalidArgument);
  EXPECT_EQ(c.set("peer_timeout", "-3").code(), Code::kInvalidArgument);
  EXPECT_EQ(c.set("peer_timeout", "nan").code(), Code::kInvalidArgument);
  EXPECT_EQ(c.set("disable_ipc", "maybe").code(), Code::kInvalidArgument);
  Status s = c.set("chanels", "4");
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("chanels"), std::string::npos);
}

TEST(Config, GetGivesWhatSetTakes) {
  Config a;
  a.peer_timeout_ms = 2500;
  a.channels = 9;
  a.disable_ipc = true;
  a.transport = "tcp";
  for (const std::string& name : Config::option_names()) {
    Config b;
    ASSERT_TRUE(b.set(name, a.get(name)).is_ok()) << name << "=" << a.get(name);
    EXPECT_EQ(b.get(name), a.get(name)) << name;
  }
  EXPECT_EQ(a.get("peer_timeout"), "2.5");
  EXPECT_EQ(a.get("nonsense"), "");
}

TEST(Config, EveryOptionNameIsSettableAndEnvStillApplies) {
  for (const std::string& name : Config::option_names()) {
    Config c;
    EXPECT_TRUE(c.set(name, "1").is_ok()) << name;  // "1" is valid for every kind
  }
  setenv("TETHER_WINDOW", "77", 1);
  setenv("TETHER_PEER_TIMEOUT_MS", "1234", 1);
  Config c = Config::from_env();
  unsetenv("TETHER_WINDOW");
  unsetenv("TETHER_PEER_TIMEOUT_MS");
  EXPECT_EQ(c.window, 77u);
  EXPECT_EQ(c.peer_timeout_ms, 1234u);
}

}  // namespace
}  // namespace tether
