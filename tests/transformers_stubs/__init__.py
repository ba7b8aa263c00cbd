"""Package marker: see tests/transformers_stubs/README.md."""
