import sys

from leveret.cli import main

sys.exit(main())
