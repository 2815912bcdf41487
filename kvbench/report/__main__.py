import sys

from kvbench.report.cli import main

sys.exit(main())
