"""Shared helpers for the tether Python tests, one module per concern:

data        seeded random and poisoned buffers, byte-exact comparison, bounded waits
proc        what /proc says about a process; dropping the right to attach to another
wire        wire.h and descriptor byte layouts, to craft handshakes, frames and descriptors by hand
sockets     raw sockets against a listener: a handshake completed by hand, a hand-made peer
transports  which transports work here; the testnet NCCL net plugin
gpu         GPU test modules: what GPUs are here (or the module's skip), this process's GPU regions
child       a real second process driven over a pipe (`Child`), running agent.py's commands
"""
