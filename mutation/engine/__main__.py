"""``python -m mutation.engine``: the mutation score (see ``mutation.engine.cli``)."""

import sys

from mutation.engine.cli import main

sys.exit(main())
