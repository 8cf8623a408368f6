"""scape_ds."""
