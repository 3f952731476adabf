"""Test support: process harness for end-to-end tests and stream invariant checks."""
