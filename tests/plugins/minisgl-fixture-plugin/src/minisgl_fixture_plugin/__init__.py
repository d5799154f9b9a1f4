"""A third-party minisgl plugin used by the test suite (and the worked example in docs/plugins.md).

The entry point is :mod:`minisgl_fixture_plugin.plugin`; this package import stays empty so that
loading the plugin imports nothing heavy.
"""
