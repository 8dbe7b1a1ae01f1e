"""Process-level plumbing: launch detection and the process group, collectives that also work as
one process, stop signals and exit codes, rank-0 logging, fault injection for tests."""
