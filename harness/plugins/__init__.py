"""Extension: the registries installed packages fill through entry points, and conformance (a user's own
implementation put under test with --impl)."""
