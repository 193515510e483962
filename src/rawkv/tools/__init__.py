"""Command-line tools that ship with rawkv."""
