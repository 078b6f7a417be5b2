"""``python -m attngen.bench ...`` is ``attngen bench ...``."""

import sys

from . import main

sys.exit(main())
