"""Speculative decoding's drafters: what decode devices guess before a verify step checks it (core/speculation.py
decides how many)."""
