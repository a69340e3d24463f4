"""Command-line tools: ``python -m puzzle.tools.<name>`` (export_hf)."""
