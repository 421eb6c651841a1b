"""An example miles-core plugin (see docs/plugins.md)."""
