"""The inputs a run reads: checkpoints and their kinds, device maps, the host it runs on, the library-version
differences (compat), and the ledger of which given input each item consumed."""
