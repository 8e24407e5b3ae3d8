"""Judging: metrics and policies into verdicts, floors and growth budgets, check ids, and the check and ablation
registries with the catalogue that fills them."""
