import sys

from kvbench.store.verify import main

sys.exit(main())
