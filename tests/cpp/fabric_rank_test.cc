// Rail ranking by GPU-NIC affinity, on a fake sysfs tree and synthetic fi_info entries (no libfabric
// needed): where each rail's NIC sits (rail_location), the order per device (rank_rails) and which
// rails new chunks are offered to (pick_rails).
//
// The tree (numa 0 under pci0000:00, numa 1 under pci0000:80):
//   pci0000:00/0000:00:01.0/0000:01:00.0 (switch A) /0000:02:00.0/0000:03:00.0  GPU0
//                                                   /0000:02:01.0/0000:04:00.0  NIC a   (cxi2)
//   pci0000:00/0000:00:02.0/0000:05:00.0 (switch B) /0000:06:00.0/0000:07:00.0  NIC b   (cxi1)
//                                                   /0000:06:01.0/0000:08:00.0  GPU1
//   pci0000:80/0000:80:01.0/0000:81:00.0                                        NIC c   (cxi0)
//   pci0000:80/0000:80:02.0/0000:82:00.0/virtio3                                eth3 (virtio netdev)
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "transport/fabric/discovery.h"

using namespace tether::transport::fabric;
namespace fs = std::filesystem;

namespace {

struct FakeSysfs : ::testing::Test {
  void SetUp() override {
    char tmpl[] = "/tmp/tether-sysfs-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    root = tmpl;
    gpu0 = device("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0", 0);
    nic_a = device("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0", 0);
    nic_b = device("pci0000:00/0000:00:02.0/0000:05:00.0/0000:06:00.0/0000:07:00.0", 0);
    gpu1 = device("pci0000:00/0000:00:02.0/0000:05:00.0/0000:06:01.0/0000:08:00.0", 0);
    nic_c = device("pci0000:80/0000:80:01.0/0000:81:00.0", 1);
    const std::string virtio_fn = device("pci0000:80/0000:80:02.0/0000:82:00.0", 1);
    fs::create_directories(virtio_fn + "/virtio3");
    fs::create_directories(root + "/class/net/eth3");
    fs::create_symlink(virtio_fn + "/virtio3", root + "/class/net/eth3/device");
    fs::create_directories(root + "/class/net/lo");  // virtual: no device link
  }
  void TearDown() override { fs::remove_all(root); }

  // Creates devices/<rel> with its numa_node and the /bus/pci/devices/<function> link; returns its path.
  std::string device(const std::string& rel, int numa) {
    const std::string path = root + "/devices/" + rel;
    fs::create_directories(path);
    std::ofstream(path + "/numa_node") << numa << "\n";
    fs::create_directories(root + "/bus/pci/devices");
    fs::create_symlink(path, root + "/bus/pci/devices/" + path.substr(path.rfind('/') + 1));
    return path;
  }

  // A synthetic fi_info: domain `name`, optionally a PCI address and a NIC device name.
  struct Info {
    fi_info info{};
    fi_domain_attr dom{};
    fid_nic nic{};
    fi_bus_attr bus{};
    fi_device_attr dev{};
    std::string name, dev_name;
  };
  std::unique_ptr<Info> info(const std::string& name, int pci_bus = -1, const std::string& dev_name = "") {
    auto i = std::make_unique<Info>();
    i->name = name;
    i->dev_name = dev_name;
    i->dom.name = i->name.data();
    i->info.domain_attr = &i->dom;
    if (pci_bus >= 0 || !dev_name.empty()) i->info.nic = &i->nic;
    if (pci_bus >= 0) {
      i->bus.bus_type = FI_BUS_PCI;
      i->bus.attr.pci = {0, uint8_t(pci_bus), 0, 0};
      i->nic.bus_attr = &i->bus;
    }
    if (!dev_name.empty()) {
      i->dev.name = i->dev_name.data();
      i->nic.device_attr = &i->dev;
    }
    return i;
  }

  // Rails in discovery order: cxi0 = NIC c (numa 1), cxi1 = NIC b, cxi2 = NIC a, cxi3 = unknown.
  std::vector<tether::sys::Nic> rails() {
    std::vector<tether::sys::Nic> out;
    for (auto& i : {info("cxi0", 0x81), info("cxi1", 0x07), info("cxi2", 0x04), info("cxi3")})
      out.push_back(rail_location(&i->info, root));
    return out;
  }

  std::string real(const std::string& p) { return fs::canonical(p).string(); }

  std::string root, gpu0, gpu1, nic_a, nic_b, nic_c;
};

TEST_F(FakeSysfs, RailLocationFromPciAddressNetdevOrNothing) {
  auto r = rails();
  EXPECT_EQ(r[0].name, "cxi0");
  EXPECT_EQ(r[0].pci_path, real(nic_c));
  EXPECT_EQ(r[0].numa_node, 1);
  EXPECT_EQ(r[2].pci_path, real(nic_a));
  EXPECT_EQ(r[2].numa_node, 0);
  EXPECT_TRUE(r[3].pci_path.empty());  // no bus attributes, no such netdev
  EXPECT_EQ(r[3].numa_node, -1);
  // tcp: no PCI address; the domain (or the NIC's device name) is an interface: its PCI function,
  // walking up from a virtio device.
  EXPECT_EQ(rail_location(&info("eth3")->info, root).pci_path, real(root + "/devices/pci0000:80/0000:80:02.0/0000:82:00.0"));
  EXPECT_EQ(rail_location(&info("tcp-dom", -1, "eth3")->info, root).numa_node, 1);
  EXPECT_TRUE(rail_location(&info("lo")->info, root).pci_path.empty());
  // A PCI address sysfs does not know falls back to the names.
  EXPECT_EQ(rail_location(&info("eth3", 0x99)->info, root).numa_node, 1);
}

TEST_F(FakeSysfs, GpuUnderSwitchARanksTheRailUnderSwitchAFirst) {
  auto r = rails();
  RailOrder o = rank_rails(r, real(gpu0), 0);
  EXPECT_EQ(o.rails, (std::vector<uint32_t>{2, 1, 0, 3}));  // a (same switch), b (same root), c, unknown
  EXPECT_EQ(o.best, 1u);
  o = rank_rails(r, real(gpu1), 0);  // GPU1 shares switch B with NIC b
  EXPECT_EQ(o.rails, (std::vector<uint32_t>{1, 2, 0, 3}));
  EXPECT_EQ(o.best, 1u);
}

TEST_F(FakeSysfs, NumaWhenThePciPathSaysNothing) {
  auto r = rails();
  RailOrder o = rank_rails(r, "", 1);  // GPU's PCI path unknown, its NUMA node known
  EXPECT_EQ(o.rails, (std::vector<uint32_t>{0, 1, 2, 3}));
  EXPECT_EQ(o.best, 1u);
  o = rank_rails(r, "", 0);
  EXPECT_EQ(o.rails, (std::vector<uint32_t>{1, 2, 0, 3}));  // b and a equally near (NUMA 0), discovery order
  EXPECT_EQ(o.best, 2u);
}

TEST_F(FakeSysfs, HostMemoryByNumaNode) {
  auto r = rails();
  // Host memory has no PCI path: the process's NUMA node decides; -1 (spans nodes) ties every known rail.
  EXPECT_EQ(rank_rails(r, "", 1).rails.front(), 0u);
  RailOrder any = rank_rails(r, "", -1);
  EXPECT_EQ(any.rails, (std::vector<uint32_t>{0, 1, 2, 3}));
  EXPECT_EQ(any.best, 3u);
}

TEST_F(FakeSysfs, UnknownLocationsLastInDiscoveryOrder) {
  std::vector<tether::sys::Nic> r;
  for (auto& i : {info("u0"), info("far", 0x81), info("u1"), info("u2")}) r.push_back(rail_location(&i->info, root));
  // Device on NUMA 0: "far" is on NUMA 1 but known, so it still goes before the unknown ones.
  RailOrder o = rank_rails(r, "", 0);
  EXPECT_EQ(o.rails, (std::vector<uint32_t>{1, 0, 2, 3}));
  EXPECT_EQ(o.best, 1u);
  // Nothing known (libfabric tcp over loopback): discovery order, all equally near.
  std::vector<tether::sys::Nic> unknown(3);
  o = rank_rails(unknown, real(gpu0), 0);
  EXPECT_EQ(o.rails, (std::vector<uint32_t>{0, 1, 2}));
  EXPECT_EQ(o.best, 3u);
}

TEST(FabricRank, PickRailsRotatesOverTheNearThenRanks) {
  RailOrder o{{2, 3, 1, 0}, 2};  // rails 2 and 3 equally near
  uint32_t out[4];
  // One chunk: alternates between the two near rails.
  ASSERT_EQ(pick_rails(o, 4, 1, 0, out), 1u);
  EXPECT_EQ(out[0], 2u);
  ASSERT_EQ(pick_rails(o, 4, 1, 1, out), 1u);
  EXPECT_EQ(out[0], 3u);
  // Three chunks: both near ones, then the next ranked.
  ASSERT_EQ(pick_rails(o, 4, 3, 1, out), 3u);
  EXPECT_EQ(std::vector<uint32_t>(out, out + 3), (std::vector<uint32_t>{3, 2, 1}));
  // Many: every lane, near first.
  ASSERT_EQ(pick_rails(o, 4, 4, 0, out), 4u);
  EXPECT_EQ(std::vector<uint32_t>(out, out + 4), (std::vector<uint32_t>{2, 3, 1, 0}));
  // A peer with lanes on rails 0 and 1 only: the near rails are not its; its two rotate.
  ASSERT_EQ(pick_rails(o, 2, 1, 0, out), 1u);
  EXPECT_EQ(out[0], 1u);
  ASSERT_EQ(pick_rails(o, 2, 1, 1, out), 1u);
  EXPECT_EQ(out[0], 0u);
  ASSERT_EQ(pick_rails(o, 2, 2, 0, out), 2u);
  // Lanes on rails 0..2: rail 2 is the only near one it has.
  ASSERT_EQ(pick_rails(o, 3, 1, 7, out), 1u);
  EXPECT_EQ(out[0], 2u);
}

}  // namespace
