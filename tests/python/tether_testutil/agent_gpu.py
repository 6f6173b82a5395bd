"""The child's commands for GPU memory beyond a plain tensor (agent.py's `register` makes those):
CUDA VMM allocations as KV-cache pools make them, a GPU filled to the brim, a second region over the
head of a buffer, and whether a buffer can be named by a legacy CUDA IPC handle."""
from __future__ import annotations

from .data import POISON, poisoned, rand_bytes


class GpuCommands:
    """Mixed into the child's Agent: uses its ep, gpu, buffers, regions and bg_state."""

    def cmd_register_vmm(self, name, size, device, pieces=3, fill=("poison", POISON)):
        """GPU memory from CUDA's VMM API as KV-cache pools make it: `pieces` physical allocations
        (cuMemCreate, shareable as POSIX fds) mapped back to back into one reserved range, seen by torch
        through __cuda_array_interface__ (get/fill work as for other GPU buffers). Kept until exit."""
        import ctypes as C
        import torch
        kind, arg = fill
        buf = rand_bytes(arg, size) if kind == "seed" else poisoned(size, arg)
        torch.cuda.set_device(device)
        torch.zeros(1, device=f"cuda:{device}")  # the primary context, current on this thread
        cu = C.CDLL("libcuda.so.1")

        def ok(r, what):
            assert r == 0, f"{what}: CUresult {r}"

        class Prop(C.Structure):  # CUmemAllocationProp
            _fields_ = [("type", C.c_int), ("handle_types", C.c_int), ("loc_type", C.c_int), ("loc_id", C.c_int),
                        ("win32", C.c_void_p), ("compression", C.c_ubyte), ("rdma", C.c_ubyte), ("usage", C.c_ushort),
                        ("reserved", C.c_ubyte * 4)]

        class Access(C.Structure):  # CUmemAccessDesc
            _fields_ = [("loc_type", C.c_int), ("loc_id", C.c_int), ("flags", C.c_int)]

        prop = Prop(1, 1, 1, device)  # pinned, POSIX fd shareable, on GPU `device`
        gran = C.c_size_t()
        ok(cu.cuMemGetAllocationGranularity(C.byref(gran), C.byref(prop), 0), "cuMemGetAllocationGranularity")
        piece = -(-(-(-size // pieces)) // gran.value) * gran.value
        va = C.c_uint64()
        ok(cu.cuMemAddressReserve(C.byref(va), C.c_size_t(piece * pieces), C.c_size_t(0), C.c_uint64(0),
                                  C.c_ulonglong(0)), "cuMemAddressReserve")
        for i in range(pieces):
            h = C.c_ulonglong()
            ok(cu.cuMemCreate(C.byref(h), C.c_size_t(piece), C.byref(prop), C.c_ulonglong(0)), "cuMemCreate")
            ok(cu.cuMemMap(C.c_uint64(va.value + i * piece), C.c_size_t(piece), C.c_size_t(0), h, C.c_ulonglong(0)),
               "cuMemMap")
            ok(cu.cuMemRelease(h), "cuMemRelease")  # the mapping keeps it
        ok(cu.cuMemSetAccess(C.c_uint64(va.value), C.c_size_t(piece * pieces), C.byref(Access(1, device, 3)),
                             C.c_size_t(1)), "cuMemSetAccess")

        class Raw:
            __cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (va.value, False), "version": 3}

        t = torch.as_tensor(Raw(), device=f"cuda:{device}")
        t.copy_(torch.from_numpy(buf))
        torch.cuda.synchronize(device)
        self.gpu.pop(name, None)
        self.buffers.pop(name, None)
        self.gpu[name] = t
        self.regions[name] = self.ep.register(t)
        return self.regions[name].descriptor()

    def cmd_fill_gpu(self, device):
        """Takes GPU `device`'s memory with cuMemAlloc until none is left (held until free_gpu): what a
        serving engine that reserved the GPU leaves. Returns (bytes taken, bytes still free)."""
        import ctypes as C
        import torch
        torch.cuda.set_device(device)
        torch.zeros(1, device=f"cuda:{device}")  # the primary context, current on this thread
        cu = C.CDLL("libcuda.so.1")
        self.bg_state.setdefault("filler", [])
        taken, step = 0, 1 << 30
        while step >= 64 * 1024:
            p = C.c_uint64()
            if cu.cuMemAlloc_v2(C.byref(p), C.c_size_t(step)) == 0:
                self.bg_state["filler"].append(p.value)
                taken += step
            else:
                step //= 2
        free, total = C.c_size_t(), C.c_size_t()
        assert cu.cuMemGetInfo_v2(C.byref(free), C.byref(total)) == 0
        return taken, free.value

    def cmd_free_gpu(self):
        import ctypes as C
        cu = C.CDLL("libcuda.so.1")
        for p in self.bg_state.pop("filler", []):
            assert cu.cuMemFree_v2(C.c_uint64(p)) == 0

    def cmd_register_head(self, name, of, size):
        """Registers the first `size` bytes of GPU buffer `of` as a second region `name`: the same base,
        another size (for VMM memory, another span)."""
        self.gpu[name] = self.gpu[of][:size]
        self.regions[name] = self.ep.register(self.gpu[name])
        return self.regions[name].descriptor()

    def cmd_legacy_ipc_capable(self, name):
        """Whether GPU buffer `name` can be named by a legacy CUDA IPC handle (False: VMM memory)."""
        import ctypes
        v = ctypes.c_uint32(0)
        r = ctypes.CDLL("libcuda.so.1").cuPointerGetAttribute(ctypes.byref(v), 10, ctypes.c_uint64(self.gpu[name].data_ptr()))
        assert r == 0, f"cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE): CUresult {r}"
        return bool(v.value)
