"""From flags to a launch: the argument table, cross-flag validation, the run setup every role reads, and
`--dry-run`."""
