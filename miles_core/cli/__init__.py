"""The ``miles-core`` command line."""
