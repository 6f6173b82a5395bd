// The virtual-function order of nixlBackendEngine in the declarations the NIXL plugin builds against
// (src/nixl/abi by default, a NIXL tree with -DTETHER_NIXL_SRC): libnixl calls a backend by slot, so
// every function must sit where the NIXL 1.4.1 and 1.5.1 wheels call it (the slots below were read
// from both wheels' libplugin_UCX.so; tests/python/test_nixl_abi.py reads them from the installed
// wheels). Sizes and offsets are asserted at compile time (src/nixl/abi/checks.h).
#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>

#include "nixl/backend_api.h"

namespace {

// The vtable byte offset an Itanium-ABI pointer to a virtual member function encodes.
template <class PMF>
ptrdiff_t vtable_offset(PMF f) {
  static_assert(sizeof(PMF) == 2 * sizeof(ptrdiff_t));
  ptrdiff_t raw[2];
  std::memcpy(raw, &f, sizeof raw);
#if defined(__aarch64__) || defined(__arm__)
  EXPECT_EQ(raw[1] & 1, 1) << "not a virtual function";
  return raw[0];
#else
  EXPECT_EQ(raw[0] & 1, 1) << "not a virtual function";
  return raw[0] - 1;
#endif
}

size_t slot(ptrdiff_t offset) { return size_t(offset) / sizeof(void*); }

using E = nixlBackendEngine;

TEST(NixlAbi, EngineVirtualSlots) {
  // Slots 0 and 1 are the destructors.
  EXPECT_EQ(slot(vtable_offset(&E::supportsRemote)), 2u);
  EXPECT_EQ(slot(vtable_offset(&E::supportsLocal)), 3u);
  EXPECT_EQ(slot(vtable_offset(&E::supportsNotif)), 4u);
  EXPECT_EQ(slot(vtable_offset(&E::getSupportedMems)), 5u);
  EXPECT_EQ(slot(vtable_offset(&E::registerMem)), 6u);
  EXPECT_EQ(slot(vtable_offset(&E::deregisterMem)), 7u);
  EXPECT_EQ(slot(vtable_offset(&E::connect)), 8u);
  EXPECT_EQ(slot(vtable_offset(&E::disconnect)), 9u);
  EXPECT_EQ(slot(vtable_offset(&E::unloadMD)), 10u);
  EXPECT_EQ(slot(vtable_offset(&E::prepXfer)), 11u);
  EXPECT_EQ(slot(vtable_offset(&E::postXfer)), 12u);
  EXPECT_EQ(slot(vtable_offset(&E::checkXfer)), 13u);
  EXPECT_EQ(slot(vtable_offset(&E::releaseReqH)), 14u);
  using RemoteView = nixl_status_t (E::*)(const nixl_remote_meta_dlist_t&, nixlMemViewH&, const nixl_opt_b_args_t*) const;
  using LocalView = nixl_status_t (E::*)(const nixl_meta_dlist_t&, nixlMemViewH&, const nixl_opt_b_args_t*) const;
  EXPECT_EQ(slot(vtable_offset(static_cast<RemoteView>(&E::prepMemView))), 15u);
  EXPECT_EQ(slot(vtable_offset(static_cast<LocalView>(&E::prepMemView))), 16u);
  EXPECT_EQ(slot(vtable_offset(&E::releaseMemView)), 17u);
  EXPECT_EQ(slot(vtable_offset(&E::getPublicData)), 18u);
  EXPECT_EQ(slot(vtable_offset(&E::getConnInfo)), 19u);  // libnixl: call *0x98(vtable)
  EXPECT_EQ(slot(vtable_offset(&E::loadRemoteConnInfo)), 20u);
  EXPECT_EQ(slot(vtable_offset(&E::loadRemoteMD)), 21u);
  EXPECT_EQ(slot(vtable_offset(&E::loadLocalMD)), 22u);
  EXPECT_EQ(slot(vtable_offset(&E::getNotifs)), 23u);
  EXPECT_EQ(slot(vtable_offset(&E::genNotif)), 24u);
  EXPECT_EQ(slot(vtable_offset(&E::queryMem)), 25u);
  EXPECT_EQ(slot(vtable_offset(&E::estimateXferCost)), 26u);
}

TEST(NixlAbi, HandleAndMetadataDestructorsFirst) {
  // libnixl holds requests and metadata by these bases: a virtual destructor and nothing else.
  EXPECT_TRUE(std::has_virtual_destructor_v<nixlBackendReqH>);
  EXPECT_TRUE(std::has_virtual_destructor_v<nixlBackendMD>);
  EXPECT_EQ(sizeof(nixlBackendReqH), sizeof(void*));
}

}  // namespace
