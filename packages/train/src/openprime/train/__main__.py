"""`python -m openprime.train ...`: the `openprime` command, where its script is not on PATH."""

import sys

from openprime.train.entry import main

sys.exit(main())
