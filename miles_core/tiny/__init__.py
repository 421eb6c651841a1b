"""Building blocks for the families' tiny offline pipelines (no model hub needed)."""
