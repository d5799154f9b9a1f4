"""minisgl attention backend plugins."""
