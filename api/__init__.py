"""The API role: HTTP, validation, enqueueing and SSE relay. Imports neither torch nor transformers."""
