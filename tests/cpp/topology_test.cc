// NIC topology helpers: CPU lists, bindings, subnets, NIC lists from a peer, pairing and thread placement.
#include "sys/topology.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>

namespace tether::sys {
namespace {

TEST(Topology, CpuLists) {
  auto r = parse_cpu_list("0-3,8, 10-11");
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r.value(), (std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(format_cpu_list(r.value()), "0-3,8,10-11");
  EXPECT_TRUE(parse_cpu_list("").value().empty());
  for (const char* bad : {"3-1", "a", "1-", "-2", "1,,x", "99999"}) EXPECT_FALSE(parse_cpu_list(bad).is_ok()) << bad;
}

TEST(Topology, CpuBindings) {
  auto r = parse_cpu_bindings("eth1:8-21;eth2:22-35");
  ASSERT_TRUE(r.is_ok());
  ASSERT_EQ(r.value().size(), 2u);
  EXPECT_EQ(r.value()[0].nic, "eth1");
  EXPECT_EQ(r.value()[0].cpus.size(), 14u);
  EXPECT_EQ(r.value()[1].cpus.front(), 22);
  EXPECT_FALSE(parse_cpu_bindings("eth1").is_ok());
  EXPECT_FALSE(parse_cpu_bindings(":1-2").is_ok());
  EXPECT_FALSE(parse_cpu_bindings("eth1:").is_ok());
  EXPECT_FALSE(parse_cpu_bindings("eth1:x").is_ok());
}

TEST(Topology, Subnets) {
  NicAddr a{AF_INET, "10.1.2.1", 24};
  EXPECT_TRUE(same_subnet(a, "10.1.2.200", 24));
  EXPECT_FALSE(same_subnet(a, "10.1.3.1", 24));
  EXPECT_TRUE(same_subnet(a, "10.1.2.9", 0));   // remote prefix unknown: ours decides
  EXPECT_FALSE(same_subnet(a, "fe80::1", 64));  // families differ
  NicAddr b{AF_INET6, "fd00:1::1", 64};
  EXPECT_TRUE(same_subnet(b, "fd00:1::2", 64));
  EXPECT_FALSE(same_subnet(b, "fd00:2::2", 64));
}

TEST(Topology, NicListRoundTrip) {
  std::vector<RemoteNic> in{{"eth1", {AF_INET, "10.0.1.2", 24}}, {"eth2", {AF_INET6, "fd00::2", 64}}};
  auto out = decode_nic_list(encode_nic_list(in));
  ASSERT_TRUE(out.is_ok());
  ASSERT_EQ(out.value().size(), 2u);
  EXPECT_EQ(out.value()[1].name, "eth2");
  EXPECT_EQ(out.value()[1].addr.addr, "fd00::2");
  EXPECT_EQ(out.value()[1].addr.family, AF_INET6);
  EXPECT_EQ(out.value()[0].addr.prefix, 24);
  for (const char* bad : {"eth1\n", "eth1 10.0.0.1\n", "eth1 nonsense/24\n", "eth1 10.0.0.1/999\n"})
    EXPECT_FALSE(decode_nic_list(bad).is_ok()) << bad;
}

Nic nic(const std::string& name, const std::string& addr, int prefix = 24) {
  Nic n;
  n.name = name;
  n.up = true;
  n.addrs.push_back(NicAddr{AF_INET, addr, prefix});
  return n;
}

TEST(Topology, PairsShareSubnetsAndSpreadOverLinks) {
  std::vector<Nic> local{nic("a0", "10.9.0.1"), nic("a1", "10.9.1.1"), nic("a2", "10.9.2.1"), nic("x", "192.168.5.1")};
  std::vector<RemoteNic> remote{{"b2", {AF_INET, "10.9.2.2", 24}}, {"b0", {AF_INET, "10.9.0.2", 24}},
                                {"b1", {AF_INET, "10.9.1.2", 24}}, {"far", {AF_INET, "172.16.0.1", 16}}};
  auto p = pair_nics(local, remote);
  ASSERT_EQ(p.size(), 3u);  // "x" and "far" share no subnet with anything
  EXPECT_EQ(p[0].local_name, "a0");  // local use order
  EXPECT_EQ(p[0].remote_addr, "10.9.0.2");
  EXPECT_EQ(p[0].remote_name, "b0");
  EXPECT_EQ(p[1].local_name, "a1");
  EXPECT_EQ(p[2].local_addr, "10.9.2.1");
  EXPECT_EQ(p[2].remote_addr, "10.9.2.2");
  EXPECT_EQ(p[2].local, 2);
  EXPECT_TRUE(pair_nics(local, {{"far", {AF_INET, "172.16.0.1", 16}}}).empty());
}

TEST(Topology, ThreadsFollowTheirNic) {
  Plan plan;
  plan.data = {nic("a0", "10.9.0.1"), nic("a1", "10.9.1.1")};
  for (int t = 0; t < 4; ++t) plan.threads.push_back(ThreadPlacement{t % 2, {}, ""});
  // NIC 1 is served by threads 1 and 3, in turn.
  EXPECT_EQ(plan.thread_for_lane(0, 1, 0), 1u);
  EXPECT_EQ(plan.thread_for_lane(5, 1, 1), 3u);
  EXPECT_EQ(plan.thread_for_lane(7, 1, 2), 1u);
  EXPECT_EQ(plan.thread_for_lane(6, -1, 0), 2u);  // no NIC: by lane
  plan.threads.resize(1);
  plan.threads[0].nic = 0;
  EXPECT_EQ(plan.thread_for_lane(3, 1, 0), 0u);  // fewer threads than NICs
}

TEST(Topology, PlanRejectsUnknownNames) {
  Config c;
  c.nics = "no-such-nic0";
  auto r = make_plan(c);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("no-such-nic0"), std::string::npos);
  c.nics = "lo";
  c.tx_cpus = "nope:0";
  EXPECT_FALSE(make_plan(c).is_ok());
  c.tx_cpus = "lo:0";
  auto ok = make_plan(c);
  ASSERT_TRUE(ok.is_ok()) << ok.status().message();
  EXPECT_EQ(ok.value().data.size(), 1u);
  EXPECT_EQ(ok.value().threads[0].cpus, std::vector<int>{0});
  c.control_nic = "nope";
  EXPECT_FALSE(make_plan(c).is_ok());
}

}  // namespace
}  // namespace tether::sys
