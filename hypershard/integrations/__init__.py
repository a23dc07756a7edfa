"""Integrations of hypershard into other training frameworks (see docs/llamafactory.md)."""
