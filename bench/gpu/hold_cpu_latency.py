#!/usr/bin/env python3
"""Runs a command while this process holds the CPUs out of deep idle states (a PM QoS request of 0 us
on /dev/cpu_dma_latency, released when it exits): how much of a latency is thread wake-up from idle.
Needs root (the device machine has it).

    python3 bench/gpu/hold_cpu_latency.py python3 bench/gpu/compare_ipc_gpu.py --channels 16
"""
import os
import struct
import subprocess
import sys

if __name__ == "__main__":
    fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    os.write(fd, struct.pack("i", 0))  # held while fd is open
    print("cpu_dma_latency: held at 0 us", flush=True)
    sys.exit(subprocess.call(sys.argv[1:]))
