"""The project's mutation engine: AST mutants of the implementations, judged by the tests that cover them.

``scripts/mutation-score`` runs it; ``cli`` is the entry point, ``operators`` finds and applies
mutants, ``coverage_map`` maps lines to tests, ``runner`` runs mutants in forked children,
``patching`` puts a mutant into a live module, ``report`` scores and renders.
"""
