"""User-facing operations, one module per kernel family."""
