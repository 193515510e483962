"""Helpers the tests share, imported as `support.<module>` (tests/ is on
sys.path: pytest puts the directory of tests/conftest.py there)."""
