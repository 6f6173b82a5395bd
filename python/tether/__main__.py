import sys

from tether.cli import main

sys.exit(main())
