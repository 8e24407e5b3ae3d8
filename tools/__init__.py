"""Developer tools that are not part of the parity suite itself (the mutation score)."""
