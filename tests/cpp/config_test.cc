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

TEST(Config, EnvironmentIsParsedAsTheKeywordAndBadValuesNameTheVariable) {
  setenv("TETHER_WINDOW", "77", 1);
  setenv("TETHER_PEER_TIMEOUT_MS", "1234", 1);
  setenv("TETHER_CHUNK_BYTES", "4M", 1);
  setenv("TETHER_DISABLE_IPC", "true", 1);
  setenv("TETHER_LANE_TIMEOUT_MS", "2.5s", 1);
  Result<Config> c = Config::from_env();
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c.value().window, 77u);
  EXPECT_EQ(c.value().peer_timeout_ms, 1234u);
  EXPECT_EQ(c.value().chunk_bytes, 4u << 20);
  EXPECT_TRUE(c.value().disable_ipc);
  EXPECT_EQ(c.value().lane_timeout_ms, 2500u);
  setenv("TETHER_CHUNK_BYTES", "4Q", 1);
  Result<Config> bad = Config::from_env();
  for (const char* v : {"TETHER_WINDOW", "TETHER_PEER_TIMEOUT_MS", "TETHER_CHUNK_BYTES", "TETHER_DISABLE_IPC",
                        "TETHER_LANE_TIMEOUT_MS"})
    unsetenv(v);
  ASSERT_EQ(bad.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "TETHER_CHUNK_BYTES='4Q': expected a size in bytes (e.g. 4194304, 4M, 4MiB)");
}

TEST(Config, ValueKindsTakeTheirSpellings) {
  Config c;
  for (const char* v : {"4194304", "4M", "4MiB", "4m", "4096K", "0.00390625G", "0x400000"}) {
    c.chunk_bytes = 0;
    ASSERT_TRUE(c.set("chunk_bytes", v).is_ok()) << v;
    EXPECT_EQ(c.chunk_bytes, 4u << 20) << v;
  }
  for (const char* v : {"4Q", "1.3", "-4M", "4 M", "M", "4MiBs", "1e6", "99999999999T"})
    EXPECT_EQ(c.set("chunk_bytes", v).code(), Code::kInvalidArgument) << v;
  EXPECT_EQ(c.set("socket_buffer", "4G").code(), Code::kInvalidArgument);  // a 32-bit field
  for (const char* v : {"yes", "ON", "True", "1"}) {
    c.disable_ipc = false;
    ASSERT_TRUE(c.set("disable_ipc", v).is_ok()) << v;
    EXPECT_TRUE(c.disable_ipc) << v;
  }
  ASSERT_TRUE(c.set("pin_threads", "off").is_ok());
  EXPECT_EQ(c.pin_threads, 0u);
  for (const char* v : {"2.5", "2500ms", "2.5s"}) {
    ASSERT_TRUE(c.set("peer_timeout", v).is_ok()) << v;
    EXPECT_EQ(c.peer_timeout_ms, 2500u) << v;
  }
  ASSERT_TRUE(c.set("busy_poll_us", "0.05ms").is_ok());
  EXPECT_EQ(c.busy_poll_us, 50u);
  Status s = c.set("transport", "fabirc");
  EXPECT_EQ(s.message(), "option transport='fabirc': expected auto, tcp, ipc, fabric or netplugin");
  ASSERT_TRUE(c.set("unpack", "").is_ok());
  EXPECT_EQ(c.unpack, "");
}

TEST(Config, ProcessWideKnobsAreCheckedToo) {
  EXPECT_TRUE(Config::check_process_env().is_ok());
  setenv("TETHER_NET_FAULT", "sideways", 1);
  Status s = Config::check_process_env();
  unsetenv("TETHER_NET_FAULT");
  EXPECT_EQ(s.message(), "TETHER_NET_FAULT='sideways': expected consume_early");
}

}  // namespace
}  // namespace tether
