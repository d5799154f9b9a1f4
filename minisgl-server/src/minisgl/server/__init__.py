"""minisgl server package: the ``minisgl`` command (and, later, the HTTP server)."""
