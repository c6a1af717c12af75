"""Notebook side: %vpipe magics, live dashboard figures and the partition editor widget (no torch here)."""
