"""The post-process worker role: token streams in, OpenAI response events out."""
