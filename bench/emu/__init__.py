"""Emulated hosts: namespaces, shaped links, and the processes that run in them."""
