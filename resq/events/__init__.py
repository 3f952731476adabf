"""OpenAI Responses stream events: pure builders, output assembly, and the one emit point."""
