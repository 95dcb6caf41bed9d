import sys

from leveret.cli.main import main

sys.exit(main())
