"""The layer a team writes to judge flowstage with fastpath-parity: each module maps one path's ``--impl`` contract
onto the framework's own stages, and declares what those stages drive and support. ``planted`` holds two realistic
bugs the suite must catch."""
