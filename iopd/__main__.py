import sys

from iopd.cli import main

sys.exit(main())
