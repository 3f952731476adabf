"""Post-processing inside the API process (``RESQ_POSTPROCESS_WORKERS=0``).

The same leased post-processor the post-process workers run, on a pool of
threads, like TensorRT-LLM's ``num_postprocess_workers=0``: no extra
processes, at the cost of the API's own CPU. When an API dies, the reaper of
another API (or of this one once restarted) takes its responses over after
their leases lapse.
"""

from __future__ import annotations

from concurrent.futures import Future

from resq.postprocess.service import PostprocessService
from resq.settings import Settings


class InlinePostprocessor:
    """Runs post-processing of responses on the API's own threads."""

    def __init__(self, settings: Settings, holder_id: str) -> None:
        self._service = PostprocessService(settings, holder_id)
        self._service.start()

    def submit(self, response_id: str) -> Future[str]:
        """Start post-processing ``response_id`` in the background."""
        return self._service.submit(response_id)

    def take_over_lapsed(self) -> None:
        """Adopt responses whose post-processor (another API) died."""
        self._service.take_over_lapsed()

    def close(self) -> None:
        """Stop taking work; running post-processors finish their response."""
        self._service.close()
