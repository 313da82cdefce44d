"""``python -m txmq.cli``: the ``txmq`` command."""

import sys

from txmq.cli.main import main

sys.exit(main())
