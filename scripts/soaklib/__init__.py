"""The pieces of scripts/soak.py (issue 41)."""
