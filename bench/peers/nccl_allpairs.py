"""NCCL all-pairs send/recv on N GPUs (every rank sends to and receives from every other at once):
the reference for `tether bench --full-mesh --device gpu`. The code lives in the package
(tether.nccl_mesh) so `tether bench --full-mesh --device gpu --nccl` finds it after `pip install .`.

    python3 bench/peers/nccl_allpairs.py --gpus 8 --sizes 16M,256M [--socket] [--json PATH]
"""
import glob
import os
import sys

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python")
if glob.glob(os.path.join(_SRC, "tether", "_tether*.so")):  # a source tree built in place (the dev loop)
    sys.path.insert(0, _SRC)
from tether.nccl_mesh import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
