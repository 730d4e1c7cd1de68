"""Hot ops of the restore paths."""
