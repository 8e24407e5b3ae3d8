"""Reports: verdicts into the terminal table, markdown, JSON and HTML with pictures, report diffs, and benchmark
tables."""
