"""resq: the OpenAI Responses API for local Hugging Face models, through a task queue.

This package holds what every role shares: settings, wire formats, the Redis
layout, the Celery app, the event builder and the ``resq`` command.
"""

__version__ = "0.1.0"
