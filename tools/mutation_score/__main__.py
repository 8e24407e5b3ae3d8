"""``python -m tools.mutation_score``: the mutation score (see ``tools.mutation_score.cli``)."""

import sys

from tools.mutation_score.cli import main

sys.exit(main())
