// The target-side check every remote access passes: region, key, bounds, read-only.
#include <gtest/gtest.h>

#include <vector>

#include "core/region.h"

using namespace tether;
using core::RegionRegistry;
using core::RegionState;

namespace {

struct Fixture : ::testing::Test {
  EndpointId id{{1, 2, 3}};
  RegionRegistry reg{id};
  std::vector<uint8_t> mem = std::vector<uint8_t>(4096);
  Region r = reg.add(mem.data(), mem.size(), MemoryKind::kHost, -1, false).take();

  RemoteRegion remote(uint64_t off, uint64_t len) {
    auto bytes = r.descriptor(off, len);
    EXPECT_TRUE(bytes.is_ok());
    auto parsed = RemoteRegion::parse(bytes.value());
    EXPECT_TRUE(parsed.is_ok());
    return parsed.take();
  }
  Code resolve(const RemoteRegion& d, uint64_t off, uint64_t len, bool write = true) {
    RegionState* pin = nullptr;
    Code c = reg.resolve(d.region_id, d.key, d.offset, d.length, off, len, write, &pin);
    if (c == Code::kOk) pin->unpin();
    return c;
  }
};

}  // namespace

TEST_F(Fixture, GrantsExactlyTheDescriptorRange) {
  RemoteRegion d = remote(100, 50);
  EXPECT_EQ(resolve(d, 100, 50), Code::kOk);
  EXPECT_EQ(resolve(d, 120, 30), Code::kOk);
  EXPECT_EQ(resolve(d, 99, 1), Code::kOutOfRange);
  EXPECT_EQ(resolve(d, 100, 51), Code::kOutOfRange);
  EXPECT_EQ(resolve(d, 149, UINT64_MAX), Code::kOutOfRange);  // overflow-safe
}

TEST_F(Fixture, WidenedDescriptorIsDenied) {
  RemoteRegion d = remote(100, 50);
  d.length = 4096 - 100;  // holder of a narrow grant tries to widen it
  EXPECT_EQ(resolve(d, 100, 60), Code::kAccessDenied);
  RemoteRegion e = remote(0, 10);
  e.key ^= 1;
  EXPECT_EQ(resolve(e, 0, 10), Code::kAccessDenied);
}

TEST_F(Fixture, DeregisteredRegionIsNotFound) {
  RemoteRegion d = remote(0, 4096);
  ASSERT_TRUE(reg.unpublish(r).is_ok());
  EXPECT_EQ(resolve(d, 0, 1), Code::kNotFound);
  EXPECT_EQ(reg.unpublish(r).code(), Code::kNotFound);
  EXPECT_EQ(r.descriptor().status().code(), Code::kNotFound);
}

TEST_F(Fixture, ReadOnlyRegionRefusesWrites) {
  Region ro = reg.add(mem.data(), 16, MemoryKind::kHost, -1, true).take();
  auto d = RemoteRegion::parse(ro.descriptor().value()).take();
  RegionState* pin = nullptr;
  EXPECT_EQ(reg.resolve(d.region_id, d.key, d.offset, d.length, 0, 16, true, &pin), Code::kAccessDenied);
  ASSERT_EQ(reg.resolve(d.region_id, d.key, d.offset, d.length, 0, 16, false, &pin), Code::kOk);
  pin->unpin();
}

TEST_F(Fixture, DescriptorArgumentsAreChecked) {
  EXPECT_EQ(r.descriptor(4097, 0).status().code(), Code::kOutOfRange);
  EXPECT_EQ(r.descriptor(4000, 97).status().code(), Code::kOutOfRange);
  EXPECT_TRUE(r.descriptor(4096, 0).is_ok());
  EXPECT_EQ(RemoteRegion::parse("short").status().code(), Code::kInvalidArgument);
  std::string garbage(RemoteRegion::kEncodedSize, 'x');
  EXPECT_EQ(RemoteRegion::parse(garbage).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(reg.add(nullptr, 10, MemoryKind::kHost, -1, false).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(reg.add(mem.data(), 0, MemoryKind::kHost, -1, false).status().code(), Code::kInvalidArgument);
}

// A pulled read's send (PeerState::on_pull) checks the range once, keeping the region by shared_ptr, then
// pins it chunk by chunk while it is still published: never after unpublish, so deregister cannot miss one.
TEST_F(Fixture, PushedChunksPinOnlyAPublishedRegion) {
  RemoteRegion d = remote(0, 4096);
  std::shared_ptr<RegionState> held;
  EXPECT_EQ(reg.resolve(d.region_id, d.key ^ 1, d.offset, d.length, 0, 10, false, &held), Code::kAccessDenied);
  EXPECT_EQ(held, nullptr);
  ASSERT_EQ(reg.resolve(d.region_id, d.key, d.offset, d.length, 0, 4096, false, &held), Code::kOk);
  ASSERT_EQ(held.get(), r.state().get());
  EXPECT_EQ(held->pins.load(), 1);
  held->unpin();
  ASSERT_TRUE(reg.pin_published(*held));
  EXPECT_EQ(held->pins.load(), 1);
  held->unpin();
  ASSERT_TRUE(reg.unpublish(r).is_ok());
  EXPECT_FALSE(reg.pin_published(*held));
  EXPECT_EQ(held->pins.load(), 0);
  EXPECT_EQ(reg.resolve(d.region_id, d.key, d.offset, d.length, 0, 1, false, &held), Code::kNotFound);
}
