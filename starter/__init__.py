"""The client library and the `exports` command line."""
