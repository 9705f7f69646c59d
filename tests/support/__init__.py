"""Test infrastructure shared by test modules (real servers, helpers)."""
