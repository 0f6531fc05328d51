"""mixprec's implementation. Import from ``mixprec``; nothing here is public."""
