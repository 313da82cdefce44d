import sys

from txmq.cli import main

sys.exit(main())
