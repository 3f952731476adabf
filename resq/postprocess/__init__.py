"""Turning a token stream into OpenAI response events (shared by workers and the inline API)."""
